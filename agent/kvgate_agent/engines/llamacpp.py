"""llama.cpp's ``llama-server``: its KV layout from ``GET /props`` (and ``GET /slots``), parsed
into a :class:`SlotLayout` (pure: the HTTP is the sidecar's,
:mod:`kvgate_agent.sidecar.engine.probe`).

llama-server serves ``total_slots`` requests at once (``--parallel N``; "auto" is 4 slots with a
unified KV cache). Without a unified KV cache (``--no-kv-unified``, the default when
``--parallel`` is given) the context ``-c`` is split evenly: each slot holds ``n_ctx / N`` tokens
(rounded down to a multiple of 256), a request's prompt + output must fit in its slot, and the
KV pool is ``N × slot`` tokens. ``/props`` reports the slot's size
(``default_generation_settings.n_ctx``) and ``total_slots``; ``/slots`` reports each slot's
``n_ctx`` (enabled by default, ``--no-slots`` turns it off).
Source: ``tools/server/server-context.cpp`` (``get_res_props``, ``n_ctx_slot``) and
``src/llama-context.cpp`` (``n_ctx_seq``), https://github.com/ggml-org/llama.cpp.

A unified KV cache (``--kv-unified``) is not visible in either answer: each slot then reports
the whole pool, and ``N × slot`` over-counts the pool N times. Give ``capacity.kvCacheTokens``
explicitly for such a server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Largest plausible slot context, tokens (no GGUF model trains beyond 10 M tokens today).
MAX_SLOT_TOKENS = 10_000_000
#: Largest plausible number of slots (llama.cpp's LLAMA_MAX_SEQ is 256).
MAX_SLOTS = 4096


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """How a llama-server holds requests.

    Attributes:
        slots: requests served at once (``total_slots``).
        slot_tokens: context of one slot (tokens): the per-request limit on prompt + output.
        kv_capacity_tokens: the KV pool (tokens), ``slots × slot_tokens``.
    """

    slots: int
    slot_tokens: int

    @property
    def kv_capacity_tokens(self) -> int:
        return self.slots * self.slot_tokens


class LayoutError(ValueError):
    """``/props`` or ``/slots`` is not a llama-server's answer, or its figures are implausible."""


def _positive(value: Any, what: str, limit: int) -> int:
    if type(value) is not int or not 0 < value <= limit:
        raise LayoutError(f"{what} is {value!r}, not a whole number in 1..{limit}")
    return value


def parse_props(props: Any, slots: Any = None) -> SlotLayout:
    """The slot layout from the JSON bodies of ``GET /props`` and (optional) ``GET /slots``.

    Args:
        props: parsed ``/props``: ``{"total_slots": N, "default_generation_settings":
            {"n_ctx": slot tokens, ...}, ...}``.
        slots: parsed ``/slots`` (a list of ``{"id": i, "n_ctx": tokens, ...}``), or None when
            not read (``--no-slots`` answers 501). When given, its length is the slot count and
            the smallest ``n_ctx`` the per-request limit.

    Raises:
        LayoutError: a field missing, not a positive whole number, or implausible.
    """
    if not isinstance(props, dict):
        raise LayoutError("/props is not a JSON object")
    settings = props.get("default_generation_settings")
    if not isinstance(settings, dict):
        raise LayoutError("/props has no default_generation_settings")
    n_slots = _positive(props.get("total_slots"), "total_slots", MAX_SLOTS)
    slot_tokens = _positive(
        settings.get("n_ctx"), "default_generation_settings.n_ctx", MAX_SLOT_TOKENS
    )
    if slots is not None:
        if not isinstance(slots, list) or not slots:
            raise LayoutError("/slots is not a non-empty list")
        sizes = [_positive(_n_ctx(s), "slot n_ctx", MAX_SLOT_TOKENS) for s in slots]
        n_slots = _positive(len(sizes), "the number of /slots", MAX_SLOTS)
        slot_tokens = min(sizes)
    return SlotLayout(n_slots, slot_tokens)


def _n_ctx(slot: Any) -> Any:
    return slot.get("n_ctx") if isinstance(slot, dict) else None
