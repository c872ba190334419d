"""What a parsed request knows of the API it came in on (:class:`ApiTraits`): the fields its 400s
name and how the engine's usage is read from its answers. The part of
:class:`~kvgate_agent.sidecar.reading.apis.base.Api` below both the parse and the parsed request:
:class:`~kvgate_agent.sidecar.reading.request.ParsedRequest` carries an object of this type, and
``Api.parse`` returns a ``ParsedRequest``, so neither module imports the other. Types only:
no code runs here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvgate_agent.sidecar.reading.usage import EventReader

__all__ = ["ApiTraits"]


@runtime_checkable
class ApiTraits(Protocol):
    """What a generation API's parsed request carries: its 400s' field names, whether it asks
    for a stream's usage, and its usage readers."""

    @property
    def name(self) -> str:
        """A short name for logs and tests (``"chat"``, ``"tgi"``); never sent anywhere."""
        ...

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
        :class:`~kvgate_agent.sidecar.reading.sse.StreamAccountant` reads the stream itself (OpenAI
        chat and completions)."""
        ...
