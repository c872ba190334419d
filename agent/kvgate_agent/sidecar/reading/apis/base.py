"""What the sidecar knows of one generation API (OpenAI chat or completions, Responses,
Anthropic Messages, TGI, SGLang, llama.cpp): :class:`Api`, one object per API, each in its own
module of this package. Adding an API is one new module here plus one line in the route table
(:data:`kvgate_agent.sidecar.reading.endpoints.GENERATION_PATHS`).

The request path reads an API's object at three places, never its name: parsing the body
(:meth:`Route.parse`, into a :class:`~kvgate_agent.sidecar.reading.request.ParsedRequest` that
carries the object), the 400 answer naming a field (:attr:`Api.prompt_param`,
:attr:`Api.limit_param`) and reading the usage the engine reports (:meth:`Api.body_usage`,
:meth:`Api.event_reader`). Types only: no code runs here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvgate_agent.sidecar.reading.apis.traits import ApiTraits

if TYPE_CHECKING:
    from kvgate_agent.sidecar.reading.request import ParsedRequest

__all__ = ["Api", "ApiTraits", "Route"]


@runtime_checkable
class Route(Protocol):
    """What a generation path's body is parsed by: an :class:`Api`, or (TGI's and SGLang's
    shared ``/generate``) a choice of one by the body."""

    @property
    def name(self) -> str:
        """A short name for logs and tests (``"chat"``, ``"tgi"``, ``"generate"``); never sent
        anywhere."""
        ...

    def parse(
        self,
        raw: bytes,
        *,
        default_max_tokens: int,
        max_tokens_cap: int | None,
        max_model_len: int | None,
    ) -> ParsedRequest:
        """Decode and validate a request body: its output limit (the client's clamped to
        ``max_tokens_cap``, or ``default_max_tokens`` bounded by the cap and
        ``max_model_len``), its sequences and the prompt in counting shape.

        Raises:
            RequestError: 400 ``invalid_request_error`` naming the offending field as the API
                calls it (dotted for nested ones: ``parameters.best_of``); ``param`` None for a
                body that is not UTF-8 JSON or not an object.
        """
        ...


@runtime_checkable
class Api(Route, ApiTraits, Protocol):
    """One generation API: how its requests are parsed (:meth:`parse`, the API's length,
    sequence and prompt fields), what its 400s name, and how its usage is read (the last two
    are :class:`~kvgate_agent.sidecar.reading.apis.traits.ApiTraits`, what a parsed request
    carries)."""
