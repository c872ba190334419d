"""What the sidecar knows of one generation API (OpenAI chat or completions, Responses,
Anthropic Messages, TGI, SGLang, llama.cpp): :class:`Api`, one object per API, each in its own
module of this package. Adding an API is one new module here plus one line in the route table
(:data:`kvgate_agent.sidecar.endpoints.GENERATION_PATHS`).

The request path reads an API's object at three places, never its name: parsing the body
(:meth:`Route.parse`, into a :class:`~kvgate_agent.sidecar.request.ParsedRequest` that carries
the object), the 400 answer naming a field (:attr:`Api.prompt_param`, :attr:`Api.limit_param`)
and reading the usage the engine reports (:meth:`Api.body_usage`, :meth:`Api.event_reader`).
Types only: no code runs here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # both import this module for the type
    from kvgate_agent.sidecar.request import ParsedRequest
    from kvgate_agent.sidecar.usage import EventReader

__all__ = ["Api", "Route"]


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
class Api(Route, Protocol):
    """One generation API: how its requests are parsed (:meth:`parse`, the API's length,
    sequence and prompt fields), what its 400s name, and how its usage is read."""

    @property
    def prompt_param(self) -> str:
        """The request field holding the prompt: the ``param`` of a "prompt too long" 400."""
        ...

    @property
    def limit_param(self) -> str:
        """The request field holding the output limit: the ``param`` of a "too long" 400."""
        ...

    @property
    def stream_usage_option(self) -> bool:
        """The API asks for a stream's usage with OpenAI's ``stream_options.include_usage``
        (chat, completions): the sidecar adds it when the client did not, and strips the usage
        chunk on the way back."""
        ...

    def body_usage(self, data: bytes) -> tuple[int | None, int | None, int | None]:
        """(prompt_tokens, completion_tokens, cached_tokens) a whole response body reports,
        each None when absent or not a non-negative integer (a batch's list of results summed).
        ``cached_tokens``: the prompt tokens the engine found in its prefix cache (vLLM's
        ``usage.prompt_tokens_details.cached_tokens``, llama.cpp's ``timings.cache_n``,
        Anthropic's ``cache_read_input_tokens``, SGLang's ``meta_info.cached_tokens``). Never
        raises on upstream content."""
        ...

    def event_reader(self) -> EventReader | None:
        """A new reader of one stream's JSON events; None when
        :class:`~kvgate_agent.sidecar.sse.StreamAccountant` reads the stream itself (OpenAI
        chat and completions)."""
        ...
