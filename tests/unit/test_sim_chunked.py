"""Chunked prefill and true output lengths in the kvgate-sim engine (pure, no clock)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvgate_bench.sim.engine import SimEngine
from kvgate_bench.sim.sequences import EngineConfig, StepResult, cdiv


def chunked(blocks: int = 256, block_size: int = 4, budget: int = 64, **kw: Any) -> SimEngine:
    kw.setdefault("max_model_len", 512)
    return SimEngine(
        EngineConfig(num_gpu_blocks=blocks, block_size=block_size, watermark=0,
                     max_num_batched_tokens=budget, chunked_prefill=True, **kw)
    )  # fmt: skip


def check_invariants(eng: SimEngine, r: StepResult) -> None:
    cfg = eng.config
    assert eng.used_blocks == sum(s.blocks for s in eng.running) <= cfg.num_gpu_blocks
    assert all(s.blocks == 0 and s.num_computed == 0 for s in eng.waiting)
    assert len(eng.running) <= cfg.max_num_seqs
    for s in eng.running:
        assert s.blocks == cdiv(s.num_computed, cfg.block_size)
    # The budget bounds every token scheduled in the step, decodes included.
    assert r.prefill_tokens + r.decode_tokens <= cfg.max_num_batched_tokens
    assert r.decode_tokens == r.decode_seqs


def test_long_prompt_is_prefilled_in_chunks_and_its_first_token_comes_last() -> None:
    eng = chunked(budget=64)
    eng.submit("long", prompt_tokens=150, max_tokens=3)
    eng.submit("short", prompt_tokens=10, max_tokens=2)
    r = eng.step()
    assert r.admitted == ["long"] and r.prefill_tokens == 64 and r.new_tokens == {}
    assert eng.get("long").num_computed == 64 and eng.num_waiting == 1  # type: ignore[union-attr]
    r = eng.step()  # the budget all goes to the partial prefill: nothing admitted
    assert r.admitted == [] and r.prefill_tokens == 64 and r.new_tokens == {}
    r = eng.step()  # 22 tokens finish "long" (first token); "short" takes 10 of the 42 left
    assert r.admitted == ["short"] and r.prefill_tokens == 22 + 10
    assert r.new_tokens == {"long": 0, "short": 0}
    r = eng.step()
    assert r.prefill_tokens == 0 and r.decode_seqs == 2 and r.context_tokens == 151 + 11
    assert r.new_tokens == {"long": 1, "short": 1} and r.finished == ["short"]


def test_decodes_come_first_and_count_against_the_budget() -> None:
    eng = chunked(budget=16)
    for i in range(3):
        eng.submit(f"d{i}", prompt_tokens=4, max_tokens=50)
    eng.step()  # 3 x 4 prefill tokens, three first tokens
    eng.submit("p", prompt_tokens=100, max_tokens=2)
    r = eng.step()  # three decodes, then 13 of p's prompt
    assert r.decode_seqs == 3 and r.prefill_tokens == 13 and r.admitted == ["p"]
    assert set(r.new_tokens) == {"d0", "d1", "d2"}
    r = eng.step()
    assert r.decode_seqs == 3 and r.prefill_tokens == 13
    assert eng.get("p").num_computed == 26  # type: ignore[union-attr]


def test_budget_smaller_than_the_batch_skips_decodes_without_losing_them() -> None:
    eng = chunked(budget=2)
    for i in range(3):
        eng.submit(f"r{i}", prompt_tokens=1, max_tokens=3)
    got: dict[str, list[int]] = {}
    while eng.has_work:
        r = eng.step()
        check_invariants(eng, r)
        for rid, i in r.new_tokens.items():
            got.setdefault(rid, []).append(i)
    assert got == {f"r{i}": [0, 1, 2] for i in range(3)}


def test_preemption_during_chunked_prefill_resets_and_reprefills_at_the_front() -> None:
    # 12 blocks of 4 tokens; "old" decodes and grows while "new" prefills in chunks.
    eng = chunked(blocks=12, block_size=4, budget=8)
    eng.submit("old", prompt_tokens=8, max_tokens=30)
    assert eng.step().new_tokens == {"old": 0}
    eng.submit("new", prompt_tokens=30, max_tokens=5)
    eng.submit("later", prompt_tokens=4, max_tokens=1)
    preemptions = 0
    tokens: dict[str, list[int]] = {"old": [0]}
    for _ in range(1000):
        if not eng.has_work:
            break
        new = eng.get("new")
        r = eng.step()
        check_invariants(eng, r)
        for rid, i in r.new_tokens.items():
            tokens.setdefault(rid, []).append(i)
        if "new" in r.preempted:
            preemptions += 1
            assert new is not None and new.num_computed == 0 and new.blocks == 0
            assert eng.waiting[0] is new  # at the FRONT, ahead of "later"
            assert not r.admitted  # no admission in a step that preempted
    assert preemptions, "the pool was meant to overflow"
    assert eng.preemptions_total == preemptions  # "old", admitted first, is never the victim
    # Every request still gets all its tokens, in order.
    assert tokens == {"old": list(range(30)), "new": list(range(5)), "later": [0]}
    assert eng.used_blocks == 0


def test_resumed_request_reprefills_prompt_plus_generated_in_chunks() -> None:
    eng = chunked(blocks=6, block_size=4, budget=4)
    eng.submit("a", prompt_tokens=4, max_tokens=12)
    eng.submit("b", prompt_tokens=4, max_tokens=12)
    resumed: dict[str, int] = {}  # preempted id -> tokens generated before its preemption
    reprefill_steps: dict[str, int] = {}
    checked = 0
    for _ in range(1000):
        if not eng.has_work:
            break
        r = eng.step()
        check_invariants(eng, r)
        for rid in r.preempted:
            seq = eng.get(rid)
            assert seq is not None
            resumed[rid], reprefill_steps[rid] = seq.generated, 0
        for rid in list(resumed):
            seq = eng.get(rid)
            if rid in r.preempted or seq is None or seq.num_computed == 0:
                continue
            if rid not in r.new_tokens:  # a re-prefill chunk: no token
                reprefill_steps[rid] += 1
                assert seq.num_computed < seq.prompt_tokens + resumed[rid]
                continue
            generated = resumed.pop(rid)
            # The re-prefill covered prompt + every generated token, then sampled the next one.
            assert r.new_tokens[rid] == generated
            assert seq.num_computed == seq.prompt_tokens + generated
            assert reprefill_steps.pop(rid) >= 1  # 4 + generated > the budget of 4: chunked
            checked += 1
    assert checked and eng.preemptions_total >= checked and eng.used_blocks == 0


@pytest.mark.parametrize(
    ("output_tokens", "max_tokens", "produced", "reason"),
    [(7, 50, 7, "stop"), (80, 50, 50, "length"), (50, 50, 50, "length"), (None, 9, 9, "length"),
     (1, 50, 1, "stop")],
)  # fmt: skip
def test_true_length_is_capped_by_max_tokens(
    output_tokens: int | None, max_tokens: int, produced: int, reason: str
) -> None:
    for eng in (chunked(), SimEngine(EngineConfig(num_gpu_blocks=256, max_model_len=512,
                                                  max_num_batched_tokens=512))):  # fmt: skip
        seq = eng.submit("r", prompt_tokens=20, max_tokens=max_tokens, output_tokens=output_tokens)
        assert seq.target_tokens == produced and seq.finish_reason == reason
        got: list[int] = []
        reasons: dict[str, str] = {}
        while eng.has_work:
            r = eng.step()
            got += [r.new_tokens["r"]] if "r" in r.new_tokens else []
            reasons.update(r.finish_reasons)
        assert got == list(range(produced)) and reasons == {"r": reason}
        assert eng.used_blocks == 0 and eng.finished_total == 1


def test_output_tokens_must_be_positive() -> None:
    with pytest.raises(ValueError, match="output_tokens"):
        chunked().submit("r", prompt_tokens=5, max_tokens=5, output_tokens=0)


def test_chunked_config_allows_a_budget_below_max_model_len() -> None:
    EngineConfig(num_gpu_blocks=10, max_model_len=8192, max_num_batched_tokens=512,
                 chunked_prefill=True)  # fmt: skip
    with pytest.raises(ValueError):
        EngineConfig(num_gpu_blocks=10, max_num_batched_tokens=0, chunked_prefill=True)


Op = tuple[str, int, int, int]
ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(1, 90), st.integers(1, 30), st.integers(0, 40)),
        st.tuples(st.just("step"), st.integers(1, 5), st.just(0), st.just(0)),
        st.tuples(st.just("cancel"), st.integers(0, 30), st.just(0), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=ops,
    blocks=st.integers(8, 40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(1, 64),
)
def test_random_chunked_workloads_keep_invariants_and_finish(
    ops: list[Op], blocks: int, block_size: int, max_num_seqs: int, budget: int
) -> None:
    eng = SimEngine(
        EngineConfig(num_gpu_blocks=blocks, block_size=block_size, max_model_len=128,
                     max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                     chunked_prefill=True)
    )  # fmt: skip
    expected: dict[str, tuple[int, str]] = {}
    got: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    submitted: list[str] = []

    def step() -> None:
        r = eng.step()
        check_invariants(eng, r)
        for rid, i in r.new_tokens.items():
            got.setdefault(rid, []).append(i)
        reasons.update(r.finish_reasons)

    for kind, a, b, c in ops:
        if kind == "submit":
            rid = f"r{len(submitted)}"
            submitted.append(rid)
            try:
                seq = eng.submit(rid, a, b, output_tokens=c or None)
            except ValueError:  # RequestRejected included
                continue
            expected[rid] = (seq.target_tokens, "stop" if c and c < b else "length")
        elif kind == "step":
            for _ in range(a):
                step()
        elif submitted and eng.cancel(rid := submitted[a % len(submitted)]):
            expected.pop(rid)
            got.pop(rid, None)
    for _ in range(100_000):
        if not eng.has_work:
            break
        step()
    event("preempted" if eng.preemptions_total else "no preemption")
    assert not eng.has_work and eng.used_blocks == 0
    assert got == {rid: list(range(n)) for rid, (n, _) in expected.items()}
    assert reasons == {rid: reason for rid, (_, reason) in expected.items()}
