"""Reading a request: the route table (``endpoints``) and each generation API's parse
(``apis/``), the parsed request and the checks every API shares (``request``), body JSON,
prompt token counting, prefix blocks, the engine context a prompt must fit, the finished answer
(``answer``), the error answers (``openai_errors``, ``responses``) and the readers of the usage
an engine reports (``usage``, ``sse``). No sockets: the bottom room, importing no other room.

Other rooms import what they use from here (``__all__``); modules of this room import
each other directly.
"""

from __future__ import annotations

from kvgate_agent.sidecar.reading import responses
from kvgate_agent.sidecar.reading.answer import Answer
from kvgate_agent.sidecar.reading.apis.traits import ApiTraits
from kvgate_agent.sidecar.reading.endpoints import GENERATION_PATHS, SAFE_METHODS, Passthrough
from kvgate_agent.sidecar.reading.engine_context import EngineContext, models_context
from kvgate_agent.sidecar.reading.openai_errors import (
    SERVER_ERROR,
    RequestError,
    body_too_slow,
    error_body,
)
from kvgate_agent.sidecar.reading.prefix_blocks import PrefixNaming
from kvgate_agent.sidecar.reading.request import ParsedRequest, canonical_path, is_json
from kvgate_agent.sidecar.reading.request_start import HEADER, waited_seconds
from kvgate_agent.sidecar.reading.responses import DECISION_HEADER
from kvgate_agent.sidecar.reading.sse import StreamAccountant
from kvgate_agent.sidecar.reading.tokens import (
    PromptCount,
    PromptCounter,
    TokenizerError,
    default_within_context,
    optimistic_prompt_tokens,
    output_within_context,
    prompt_over_context,
)

__all__ = [
    "DECISION_HEADER",
    "GENERATION_PATHS",
    "HEADER",
    "SAFE_METHODS",
    "SERVER_ERROR",
    "Answer",
    "ApiTraits",
    "EngineContext",
    "ParsedRequest",
    "Passthrough",
    "PrefixNaming",
    "PromptCount",
    "PromptCounter",
    "RequestError",
    "StreamAccountant",
    "TokenizerError",
    "body_too_slow",
    "canonical_path",
    "default_within_context",
    "error_body",
    "is_json",
    "models_context",
    "optimistic_prompt_tokens",
    "output_within_context",
    "prompt_over_context",
    "responses",
    "waited_seconds",
]
