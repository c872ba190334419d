"""Which requests go through admission, which pass through, which are refused: the route table
of the generation APIs (:data:`GENERATION_PATHS`) and the pass-through allowlist
(:class:`Passthrough`), side by side.

Every generation API of the engines kvgate supports is admission-controlled, its cost and KV
taken from that API's own length fields by its module in :mod:`kvgate_agent.sidecar.reading.apis`
(adding an API: one module there and one line here):

=====================================  ===========  ==========================================
path                                   API          output limit, sequences
=====================================  ===========  ==========================================
``/v1/chat/completions``,              CHAT         ``max_completion_tokens``/``max_tokens``;
``/chat/completions`` (llama.cpp)                   ``max(n, best_of, n_cmpl)``
``/v1/completions``                    COMPLETIONS  ``max_tokens``; ``max(n, best_of, n_cmpl)``
                                                    x prompts
``/v1/responses`` (vLLM)               RESPONSES    ``max_output_tokens``; 1
``/v1/messages`` (vLLM, Anthropic)     MESSAGES     ``max_tokens`` (required); 1
``/generate`` with ``inputs`` (TGI),   TGI          ``parameters.max_new_tokens``;
``/generate_stream`` (TGI)                          ``parameters.best_of``
``/generate`` with ``text`` or         SGLANG       ``sampling_params.max_new_tokens``;
``input_ids`` (SGLang)                              ``sampling_params.n`` x prompts
``/completion``, ``/completions``,     LLAMACPP     ``n_predict``/``max_tokens`` (``-1``:
``/infill`` (llama.cpp)                             unbounded, so the policy default is sent);
                                                    ``n_cmpl`` (or ``n``) x the prompts of a
                                                    multi-prompt list
=====================================  ===========  ==========================================

Any other request with a mutating method (POST, PUT, PATCH, DELETE, ...) is refused with 404
unless its path is on the pass-through allowlist (:data:`DEFAULT_PASSTHROUGH` plus the
``--passthrough-path`` setting); GET, HEAD and OPTIONS pass on every other path (read-only by
HTTP's method semantics, RFC 9110 §9.2.1). Pure logic: no HTTP framework.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvgate_agent.sidecar.reading.apis.base import Route
from kvgate_agent.sidecar.reading.apis.generate import GENERATE
from kvgate_agent.sidecar.reading.apis.llamacpp import LLAMACPP
from kvgate_agent.sidecar.reading.apis.messages import MESSAGES
from kvgate_agent.sidecar.reading.apis.openai import CHAT, COMPLETIONS
from kvgate_agent.sidecar.reading.apis.responses import RESPONSES
from kvgate_agent.sidecar.reading.apis.tgi import TGI_STREAM

__all__ = [
    "DEFAULT_PASSTHROUGH",
    "GENERATION_PATHS",
    "SAFE_METHODS",
    "Passthrough",
]

#: Every admission-controlled path and the API that reads its body (``/generate``: TGI's or
#: SGLang's, told apart by the body).
GENERATION_PATHS: dict[str, Route] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/chat/completions": CHAT,
    "/v1/responses": RESPONSES,
    "/v1/messages": MESSAGES,
    "/generate": GENERATE,
    "/generate_stream": TGI_STREAM,
    "/completion": LLAMACPP,
    "/completions": LLAMACPP,
    "/infill": LLAMACPP,
}
#: Methods that pass through on any path but a generation one (RFC 9110 §9.2.1 "safe").
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: Paths any method may reach the model server on without admission: tokenizer utilities, CPU
#: only (vLLM's and llama.cpp's ``/tokenize``, ``/detokenize``; TGI's ``/tokenize`` and
#: ``/chat_tokenize``, https://huggingface.github.io/text-generation-inference/; vLLM's
#: Anthropic ``/v1/messages/count_tokens``; llama.cpp's ``/apply-template``), and vLLM's
#: ``POST /v1/responses/{response_id}/cancel``, which stops a generation rather than starting
#: one (https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html).
DEFAULT_PASSTHROUGH: tuple[str, ...] = (
    "/tokenize",
    "/detokenize",
    "/chat_tokenize",
    "/v1/messages/count_tokens",
    "/apply-template",
    "/v1/responses/*/cancel",
)


@dataclass(frozen=True, slots=True)
class Passthrough:
    """The pass-through allowlist for mutating methods: exact paths, prefixes written with a
    trailing ``*`` (``/admin/*``), or paths with ``*`` standing for one whole segment
    (``/v1/responses/*/cancel``). Entries are matched against the canonical path
    (:func:`~kvgate_agent.sidecar.reading.request.canonical_path`).

    Raises:
        ValueError: an entry that does not start with ``/``, or that could never match: a
            ``?`` (the query is not part of the path), a non-canonical path (empty, ``.`` or
            ``..`` segments, ``%`` escapes, a trailing ``/``), a ``*`` inside a segment, or a
            generation path (:data:`GENERATION_PATHS`: always admission-controlled).
    """

    exact: frozenset[str]
    prefixes: tuple[str, ...]
    patterns: tuple[tuple[str, ...], ...] = ()  # segments; "*" matches any one

    @classmethod
    def of(cls, extra: Iterable[str] = ()) -> Passthrough:
        """:data:`DEFAULT_PASSTHROUGH` plus ``extra``."""
        exact: set[str] = set()
        prefixes: list[str] = []
        patterns: list[tuple[str, ...]] = []
        for entry in (*DEFAULT_PASSTHROUGH, *extra):
            _check_entry(entry)
            if entry.endswith("*") and "*" not in entry[:-1]:
                prefixes.append(entry[:-1])
            elif "*" in entry:
                patterns.append(tuple(entry.split("/")))
            else:
                exact.add(entry)
        return cls(frozenset(exact), tuple(prefixes), tuple(patterns))

    def allows(self, path: str) -> bool:
        """``path`` (canonical) may be forwarded with any method."""
        if path in self.exact or any(path.startswith(p) for p in self.prefixes):
            return True
        segs = path.split("/")
        return any(
            len(p) == len(segs) and all(a in ("*", b) for a, b in zip(p, segs, strict=True))
            for p in self.patterns
        )


def _check_entry(entry: str) -> None:
    """Refuse an allowlist entry that could never match (see :class:`Passthrough`)."""
    if not entry.startswith("/"):
        raise ValueError(f"a pass-through path must start with '/', got {entry!r}")
    if "?" in entry:
        raise ValueError(f"a pass-through path has no query ('?'), got {entry!r}")
    prefix = entry.endswith("*") and "*" not in entry[:-1]
    body = entry[:-1] if prefix else entry
    segments = body.split("/")[1:]
    if prefix and segments and segments[-1] == "":
        segments.pop()  # "/admin/*": the prefix "/admin/"
    if any(seg in ("", ".", "..") or "%" in seg for seg in segments) and body != "/":
        raise ValueError(f"a pass-through path must be canonical (never matched), got {entry!r}")
    if any("*" in seg and seg != "*" for seg in segments):
        raise ValueError(f"'*' must be a whole segment or the last character, got {entry!r}")
    if entry in GENERATION_PATHS:
        raise ValueError(f"{entry!r} is a generation path: it is always admission-controlled")
