"""llama.cpp's llama-server as an engine: its slot layout from ``/props`` and ``/slots``, its
``llamacpp:*`` metrics, and the per-request context check. The bodies are in the shape
llama-server answers (``tools/server/server-context.cpp``: ``get_res_props``, the slot's
``to_json``; ``server-task.cpp``: ``to_metrics``); the integration tests read the real ones
(tests/integration/test_llamacpp_real.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate_agent.engines.llamacpp import LayoutError, SlotLayout, parse_props
from kvgate_agent.engines.scrape import parse_engine_metrics
from kvgate_agent.sidecar.reading.engine_context import context_of as _context_of
from kvgate_agent.sidecar.reading.tokens import PromptCount, prompt_over_context


def props(n_ctx: Any = 512, total_slots: Any = 4) -> dict[str, Any]:
    return {
        "default_generation_settings": {"params": {"n_predict": -1}, "n_ctx": n_ctx},
        "total_slots": total_slots,
        "model_alias": "gemma",
        "endpoint_slots": True,
        "endpoint_metrics": True,
        "build_info": "b11434",
    }


def slots(*sizes: Any) -> list[dict[str, Any]]:
    return [
        {"id": i, "n_ctx": n, "speculative": False, "is_processing": False}
        for i, n in enumerate(sizes)
    ]


LLAMACPP_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 120
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 48
# HELP llamacpp:n_tokens_max Largest observed sequence length (prompt + generation)
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 96
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 331.5
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing {processing}
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred {deferred}
"""


def test_props_alone_give_slots_times_slot_context() -> None:
    layout = parse_props(props(512, 4))
    assert layout == SlotLayout(slots=4, slot_tokens=512)
    assert layout.kv_capacity_tokens == 2048


def test_slots_give_the_count_and_the_smallest_slot() -> None:
    assert parse_props(props(512, 4), slots(512, 512, 256)) == SlotLayout(3, 256)


@pytest.mark.parametrize(
    ("body", "listed", "match"),
    [
        ([], None, "not a JSON object"),
        ({"total_slots": 4}, None, "default_generation_settings"),
        (props(0), None, "n_ctx is 0"),
        (props(512.0), None, "n_ctx is 512.0"),
        (props(True), None, "n_ctx is True"),
        (props(512, -1), None, "total_slots is -1"),
        (props(512, None), None, "total_slots is None"),
        (props(20_000_000), None, "n_ctx is 20000000"),
        (props(), [], "non-empty list"),
        (props(), {"slots": []}, "non-empty list"),
        (props(), [{"id": 0}], "slot n_ctx is None"),
        (props(), ["x"], "slot n_ctx is None"),
    ],
)
def test_a_body_that_is_not_llama_servers_is_refused(body: Any, listed: Any, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        parse_props(body, listed)


@pytest.mark.parametrize(("processing", "deferred"), [(0, 0), (2, 5)])
def test_llamacpp_metrics_are_running_and_waiting(processing: int, deferred: int) -> None:
    s = parse_engine_metrics(LLAMACPP_METRICS.format(processing=processing, deferred=deferred))
    assert s.ok and s.engine == "llamacpp"
    assert (s.running, s.waiting) == (processing, deferred)
    assert s.kv_capacity_tokens is None and s.kv_used_tokens is None and s.kv_usage is None
    assert s.invalid == {}


def test_llamacpp_bad_gauges_are_unknown_not_idle() -> None:
    s = parse_engine_metrics(LLAMACPP_METRICS.format(processing="-1", deferred="0.5"))
    assert s.ok and s.running is None and s.waiting is None
    assert set(s.invalid) == {"running", "waiting"}


def test_models_entry_context_vllm_then_llamacpp_meta() -> None:
    assert _context_of({"id": "m", "max_model_len": 4096}) == 4096
    assert _context_of({"id": "m", "owned_by": "llamacpp", "meta": {"n_ctx": 512}}) == 512
    assert _context_of({"id": "m", "meta": {"n_ctx": "512"}}) is None
    assert _context_of("m") is None


@pytest.mark.parametrize(
    ("prompt", "refused"),
    [
        (PromptCount(511, 2000, exact=True), False),  # one token of room: the engine serves it
        (PromptCount(512, 2000, exact=True), True),  # llama-server: prompt >= n_ctx is refused
        # An estimate is judged at its low end (6 bytes a token): 3072 bytes -> >= 512.
        (PromptCount(1118, 3072, exact=False, overhead_tokens=0), True),
        (PromptCount(1115, 3066, exact=False, overhead_tokens=0), False),
    ],
)
def test_a_prompt_without_room_for_output_is_refused(prompt: PromptCount, refused: bool) -> None:
    why = prompt_over_context(prompt, 2.75, 512)
    assert (why is not None) is refused
    if why is not None:
        assert "512 tokens" in why and "shorten the prompt" in why


def test_an_estimate_does_not_refuse_what_the_engine_serves() -> None:
    """950 x "word " (4,750 bytes) is 951 tokens for Gemma 3 and served in a 1024-token slot;
    at the optimistic 4.5 bytes a token it read 1,056 and was refused."""
    prompt = PromptCount(1728, 4750, exact=False, overhead_tokens=0)
    assert prompt_over_context(prompt, 2.75, 1024) is None
    assert prompt_over_context(PromptCount(1728, 4750, exact=True), 2.75, 1024) is not None
