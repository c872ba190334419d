"""The context per request: the most tokens one sequence (prompt + output) may hold, from the
policy's ``model.maxModelLen`` and the engine's own context (vLLM's ``max_model_len`` in
``GET /v1/models``, llama.cpp's slot context), the smaller winning: the engine refuses or cuts
whatever passes its own, whatever the policy states.

Pure: the probe (:mod:`kvgate_agent.sidecar.engine.probe`) reads the engine and tells
:class:`EngineContext` what it found.
"""

from __future__ import annotations

import logging

log = logging.getLogger("kvgate.sidecar")


class EngineContext:
    """The engine's context per request, once read, and the context per request it and the
    policy make together.

    Attributes:
        tokens: the engine's context per request (tokens; llama.cpp: one slot's), None until
            read.
    """

    def __init__(self) -> None:
        self.tokens: int | None = None
        self._said: tuple[int, int] | None = None  # (stated, engine's) last warned about

    def learn(self, tokens: int, stated: int | None) -> None:
        """The engine serves ``tokens`` per request; the policy states ``stated``
        (``model.maxModelLen``, None: none): a warning, once, when the policy states more."""
        self.tokens = tokens
        self.per_request(stated)

    def per_request(self, stated: int | None) -> int | None:
        """The context per request, tokens: the smaller of ``stated`` (the policy's
        ``model.maxModelLen``, None: none) and the engine's, the one known when only one is,
        None when neither is. A policy stating more than the engine has is logged once (again
        only when either figure changes)."""
        engine = self.tokens
        if engine is None or stated is None:
            return engine if stated is None else stated
        if stated <= engine:
            return stated
        if self._said != (stated, engine):
            self._said = (stated, engine)
            log.warning(
                "the policy's model.maxModelLen of %d tokens is above the engine's context of "
                "%d tokens: enforcing the engine's",
                stated,
                engine,
            )
        return engine


def models_context(data: object) -> int | None:
    """The context per request (tokens) a ``GET /v1/models`` answer reports: the smallest of
    its models' (:func:`context_of`), None when none reports one or one reports 0 or less."""
    models = data.get("data") if isinstance(data, dict) else None
    lens = (
        [n for m in models if (n := context_of(m)) is not None] if isinstance(models, list) else []
    )
    return min(lens) if lens and min(lens) > 0 else None


def context_of(model: object) -> int | None:
    """One ``/v1/models`` entry's context length (tokens): vLLM's ``max_model_len``, else
    llama.cpp's ``meta.n_ctx`` (the slot's context); None when neither is a whole number."""
    if not isinstance(model, dict):
        return None
    n = model.get("max_model_len")
    if n is None and isinstance(meta := model.get("meta"), dict):
        n = meta.get("n_ctx")
    return n if type(n) is int else None
