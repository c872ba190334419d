"""Pure tests of the kvgate-sim continuous-batching engine (no clock, no I/O)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvgate_bench.sim.engine import SimEngine
from kvgate_bench.sim.sequences import EngineConfig, RequestRejected, StepResult, cdiv


def make(blocks: int = 64, block_size: int = 4, **kw: Any) -> SimEngine:
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_batched_tokens", 256)
    return SimEngine(EngineConfig(num_gpu_blocks=blocks, block_size=block_size, watermark=0, **kw))


def check_invariants(eng: SimEngine) -> None:
    assert eng.used_blocks == sum(s.blocks for s in eng.running) <= eng.config.num_gpu_blocks
    assert all(s.blocks == 0 for s in eng.waiting)
    assert len(eng.running) <= eng.config.max_num_seqs
    assert 0.0 <= eng.kv_usage <= 1.0
    for s in eng.running:  # a running request holds exactly the blocks for its computed KV
        assert s.blocks == cdiv(s.num_computed, eng.config.block_size)


def drain(eng: SimEngine, limit: int = 100_000) -> dict[str, list[int]]:
    """Step until idle; returns the token indices each request received, in order."""
    tokens: dict[str, list[int]] = {}
    for _ in range(limit):
        if not eng.has_work:
            return tokens
        result = eng.step()
        for rid, index in result.new_tokens.items():
            tokens.setdefault(rid, []).append(index)
        check_invariants(eng)
    raise AssertionError("engine did not drain")


def test_prefill_produces_first_token_then_one_per_step() -> None:
    eng = make()
    eng.submit("a", prompt_tokens=10, max_tokens=3)
    r = eng.step()
    assert r.admitted == ["a"] and r.prefill_tokens == 10 and r.new_tokens == {"a": 0}
    assert eng.used_blocks == cdiv(10, 4)
    r = eng.step()
    assert r.prefill_tokens == 0 and r.decode_tokens == 1 and r.new_tokens == {"a": 1}
    r = eng.step()
    assert r.finished == ["a"] and r.new_tokens == {"a": 2}
    assert eng.used_blocks == 0 and not eng.has_work and eng.finished_total == 1


def test_fifo_admission_and_head_of_line_blocking() -> None:
    eng = make(blocks=10, block_size=4)
    eng.submit("big", prompt_tokens=30, max_tokens=2)  # 8 blocks
    eng.submit("bigger", prompt_tokens=20, max_tokens=2)  # 5 blocks: does not fit yet
    eng.submit("tiny", prompt_tokens=1, max_tokens=2)  # would fit, but FIFO blocks it
    assert eng.step().admitted == ["big"]
    assert [s.request_id for s in eng.waiting] == ["bigger", "tiny"]
    assert eng.step().finished == ["big"]
    assert eng.step().admitted == ["bigger", "tiny"]


def test_max_num_seqs_and_prefill_budget_limit_admission() -> None:
    eng = make(max_num_seqs=2)
    for i in range(3):
        eng.submit(f"r{i}", prompt_tokens=4, max_tokens=5)
    assert eng.step().admitted == ["r0", "r1"]
    assert eng.num_running == 2 and eng.num_waiting == 1

    eng = make(max_model_len=100, max_num_batched_tokens=100)
    for i in range(3):
        eng.submit(f"r{i}", prompt_tokens=40, max_tokens=5)
    r = eng.step()
    assert r.admitted == ["r0", "r1"] and r.prefill_tokens == 80


def test_watermark_reserved_for_admission_only() -> None:
    eng = SimEngine(EngineConfig(num_gpu_blocks=100, block_size=1, max_model_len=100,
                                 max_num_batched_tokens=100, watermark=0.05))  # fmt: skip
    assert eng.config.watermark_blocks == 5
    eng.submit("a", prompt_tokens=90, max_tokens=6)
    eng.submit("b", prompt_tokens=6, max_tokens=2)
    assert eng.step().admitted == ["a"]  # b would leave fewer than 5 free blocks
    for _ in range(4):  # decoding may eat into the watermark
        eng.step()
    assert eng.used_blocks == 94 and eng.num_waiting == 1
    with pytest.raises(RequestRejected):
        eng.check(prompt_tokens=90, max_tokens=10)  # peak 99 blocks > 100 - 5


def test_preemption_recomputes_and_still_finishes_with_max_tokens() -> None:
    # 8 blocks of 4 tokens; two requests each peaking at 4 + 15 = 19 tokens (5 blocks).
    eng = make(blocks=8, block_size=4)
    eng.submit("old", prompt_tokens=4, max_tokens=16, tenant="t1")
    eng.submit("new", prompt_tokens=4, max_tokens=16, tenant="t2")
    preempted: list[str] = []
    resumed_prefill: list[int] = []
    tokens: dict[str, list[int]] = {}
    while eng.has_work:
        was_waiting = {s.request_id: s.generated for s in eng.waiting}
        r = eng.step()
        check_invariants(eng)
        preempted += r.preempted
        for rid in r.admitted:
            if was_waiting.get(rid):
                resumed_prefill.append(r.prefill_tokens)
                assert r.prefill_tokens == 4 + was_waiting[rid]  # prompt + generated so far
        for rid, i in r.new_tokens.items():
            tokens.setdefault(rid, []).append(i)
    # The most recently admitted request is the victim, and goes back to the front.
    assert preempted and set(preempted) == {"new"}
    assert eng.preemptions_total == len(preempted)
    assert eng.preemptions_by_tenant == {"t2": len(preempted)}
    assert resumed_prefill
    assert tokens == {"old": list(range(16)), "new": list(range(16))}
    assert eng.used_blocks == 0


def test_preempted_request_goes_to_front_of_waiting_and_blocks_admission() -> None:
    eng = make(blocks=4, block_size=2)
    eng.submit("a", prompt_tokens=4, max_tokens=5)  # peak 8 tokens = 4 blocks
    eng.submit("b", prompt_tokens=4, max_tokens=5)
    eng.step()  # both admitted: 2 + 2 blocks
    eng.submit("c", prompt_tokens=1, max_tokens=1)
    r = eng.step()  # both need a third block: b is preempted, no admission this step
    assert r.preempted == ["b"] and r.admitted == [] and list(r.new_tokens) == ["a"]
    assert [s.request_id for s in eng.waiting] == ["b", "c"]
    assert eng.get("b") is not None and eng.get("b").num_computed == 0  # type: ignore[union-attr]


def test_cancel_frees_blocks_wherever_the_request_is() -> None:
    eng = make(blocks=4, block_size=4)
    eng.submit("r1", prompt_tokens=8, max_tokens=4)
    eng.submit("r2", prompt_tokens=8, max_tokens=4)
    eng.submit("w", prompt_tokens=8, max_tokens=4)
    eng.step()
    assert eng.used_blocks == 4 and eng.num_running == 2 and eng.num_waiting == 1
    assert eng.cancel("r1") and eng.used_blocks == 2
    assert eng.cancel("w") and eng.num_waiting == 0
    assert not eng.cancel("r1") and not eng.cancel("nope")
    assert eng.cancelled_total == 2
    assert drain(eng) == {"r2": [1, 2, 3]}  # its first token came in the first step
    assert eng.used_blocks == 0


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "param"),
    [(0, 1, "prompt"), (256, 1, "messages"), (10, 0, "max_tokens"), (200, 57, "max_tokens")],
)
def test_submit_rejects_like_vllm(prompt: int, max_tokens: int, param: str) -> None:
    eng = make(blocks=1000)
    with pytest.raises(RequestRejected) as exc:
        eng.submit("x", prompt, max_tokens)
    assert exc.value.param == param and not eng.has_work


def test_submit_rejects_requests_that_can_never_fit_the_pool() -> None:
    eng = make(blocks=4, block_size=4)  # 16 tokens
    eng.submit("fits", prompt_tokens=10, max_tokens=7)  # peak 16 tokens
    with pytest.raises(RequestRejected, match="KV blocks"):
        eng.submit("too-big", prompt_tokens=10, max_tokens=8)
    with pytest.raises(ValueError, match="duplicate"):
        eng.submit("fits", prompt_tokens=1, max_tokens=1)


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        EngineConfig(num_gpu_blocks=0)
    with pytest.raises(ValueError):
        EngineConfig(num_gpu_blocks=10, max_model_len=8192, max_num_batched_tokens=4096)


def test_step_without_work_is_a_noop() -> None:
    assert make().step() == StepResult()


Op = tuple[str, int, int, str]
ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(1, 60), st.integers(1, 60), st.sampled_from("ab")),
        st.tuples(st.just("step"), st.integers(1, 5), st.just(0), st.just("")),
        st.tuples(st.just("cancel"), st.integers(0, 30), st.just(0), st.just("")),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=ops,
    blocks=st.integers(8, 40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    max_num_seqs=st.integers(1, 8),
)
def test_random_workloads_keep_invariants_and_finish(
    ops: list[Op], blocks: int, block_size: int, max_num_seqs: int
) -> None:
    eng = SimEngine(
        EngineConfig(num_gpu_blocks=blocks, block_size=block_size, max_model_len=128,
                     max_num_batched_tokens=128, max_num_seqs=max_num_seqs)
    )  # fmt: skip
    expected: dict[str, int] = {}
    got: dict[str, list[int]] = {}
    submitted: list[str] = []

    def step() -> None:
        for rid, i in eng.step().new_tokens.items():
            got.setdefault(rid, []).append(i)
        check_invariants(eng)

    for kind, a, b, tenant in ops:
        if kind == "submit":
            rid = f"r{len(submitted)}"
            submitted.append(rid)
            try:
                eng.submit(rid, a, b, tenant)
            except RequestRejected:
                continue
            expected[rid] = b
        elif kind == "step":
            for _ in range(a):
                step()
        elif submitted and eng.cancel(rid := submitted[a % len(submitted)]):
            expected.pop(rid)
            got.pop(rid, None)
            check_invariants(eng)
    for _ in range(100_000):
        if not eng.has_work:
            break
        step()
    event("preempted" if eng.preemptions_total else "no preemption")
    assert not eng.has_work and eng.used_blocks == 0
    # Every surviving request got exactly max_tokens tokens, in order, despite preemptions.
    assert got == {rid: list(range(n)) for rid, n in expected.items()}
