"""The engine model's prefix cache (pure, no clock): hits, LRU eviction, shared blocks counted
once, blocks kept after a finish or a preemption, no KV leak, the cached prefill skipped in the
step time, and the cache off (or no content keys) leaving the engine as it was."""

from __future__ import annotations

from typing import Any

from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from kvgate_bench.sim.engine import SimEngine
from kvgate_bench.sim.prefix_cache import (
    BlockPool,
    ListedKeys,
    SessionKeys,
    chain_hash,
    extend_chain,
    token_block_keys,
)
from kvgate_bench.sim.sequences import EngineConfig, StepResult
from kvgate_bench.sim.steptime import StepTimeModel


def make(blocks: int = 64, block_size: int = 4, caching: bool = True, **kw: Any) -> SimEngine:
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_batched_tokens", 256)
    steptime = StepTimeModel("test", a_s=0.01, b_s=0.001)
    cfg = EngineConfig(
        num_gpu_blocks=blocks, block_size=block_size, watermark=0, prefix_caching=caching, **kw
    )
    return SimEngine(cfg, steptime)


def check_pool(eng: SimEngine) -> None:
    """No leak: used + cached + empty = the pool, and used = the running sequences' own blocks
    plus the distinct cached blocks they reference."""
    pool = eng.pool
    assert pool.used + pool.cached + pool.empty == eng.config.num_gpu_blocks
    assert min(pool.used, pool.cached, pool.empty) >= 0
    own = sum(s.blocks - len(s.held) for s in eng.running)
    shared = {h for s in eng.running for h in s.held}
    assert pool.used == own + len(shared)
    assert all(s.blocks == 0 and not s.held for s in eng.waiting)


def drain(eng: SimEngine) -> list[StepResult]:
    out = []
    while eng.has_work:
        out.append(eng.step())
        check_pool(eng)
    return out


def test_pool_hits_the_longest_cached_run_and_evicts_least_recently_used_first() -> None:
    pool = BlockPool(6)
    a = extend_chain([], SessionKeys("a"), 3)
    b = extend_chain([], SessionKeys("b"), 2)
    pool.take(5)  # five blocks of two sequences' own content...
    for h in (*a, *b):
        assert pool.register(h)  # ... that fill and join the cache
    assert pool.lookup(a) == 3 and pool.lookup([a[0], 99, a[2]]) == 1
    pool.release(a, 0)  # a finishes first: its tail is released first
    pool.release(b, 0)
    assert (pool.used, pool.cached, pool.empty) == (0, 5, 1)
    pool.take(3)  # one empty block, then two evictions: a's tail, then a's middle
    assert pool.evictions == 2 and pool.lookup(a) == 1 and pool.lookup(b) == 2
    pool.acquire(b[:1])  # a hit moves b's head out of the LRU ...
    pool.release(b[:1], 0)  # ... and back at its most recent end
    pool.take(2)  # a's head, then b's tail go; b's head was used more recently
    assert pool.lookup(a) == 0 and pool.lookup(b) == 1 and pool.cached == 1


def test_chain_hashes_depend_on_the_whole_prefix() -> None:
    assert extend_chain([], SessionKeys("s"), 2)[1] == chain_hash(
        chain_hash(None, ("s", 0)), ("s", 1)
    )
    x = extend_chain([], ListedKeys(("p", "q")), 5)
    y = extend_chain([], ListedKeys(("r", "q")), 5)
    assert len(x) == 2 and x[1] != y[1]  # same block content, another parent
    keys = token_block_keys(list(range(10)), 4)
    assert keys(0) == (0, 1, 2, 3) and keys(1) == (4, 5, 6, 7) and keys(2) is None


def test_a_repeated_prefix_is_not_prefilled_again_and_costs_no_step_time() -> None:
    eng = make()
    eng.submit("t0", 10, 3, output_tokens=3, block_keys=SessionKeys("s"))
    first = drain(eng)
    assert first[0].prefill_tokens == 10 and first[0].cached_tokens == 0
    # t0 computed 10 + 2 tokens: 3 full blocks of 4 stay cached after it finished.
    assert eng.used_blocks == 0 and eng.cached_blocks == 3
    seq = eng.submit("t1", 17, 2, output_tokens=2, block_keys=SessionKeys("s"))
    r = eng.step()
    assert r.admitted == ["t1"] and r.cached_tokens == 12 and r.prefill_tokens == 5
    assert seq.cached_tokens == 12 and seq.num_computed == 17
    assert r.duration_s == eng.steptime.seconds(5, 0, 0)  # only the uncached tokens are priced
    drain(eng)
    other = eng.submit("u", 17, 2, output_tokens=2, block_keys=SessionKeys("u"))
    assert eng.step().prefill_tokens == 17 and other.cached_tokens == 0  # another conversation


def test_shared_blocks_count_once_in_kv_use() -> None:
    eng = make(blocks=32)
    keys = ListedKeys(("sys", "tem", "pro"))  # a 12-token prompt prefix both requests share
    eng.submit("a", 14, 8, output_tokens=8, block_keys=keys)
    eng.step()
    eng.submit("b", 14, 8, output_tokens=8, block_keys=keys)
    r = eng.step()
    a, b = eng.get("a"), eng.get("b")
    assert a is not None and b is not None and r.cached_tokens == 12
    assert a.held == b.held and len(a.held) == 3
    assert eng.used_blocks == a.blocks + b.blocks - 3
    check_pool(eng)


def test_preempted_blocks_stay_cached_until_evicted_and_the_resume_reuses_them() -> None:
    eng = make(blocks=8, max_model_len=64, max_num_batched_tokens=64)
    eng.submit("a", 12, 20, output_tokens=20, block_keys=ListedKeys(("a0", "a1", "a2")))
    eng.submit("b", 12, 20, output_tokens=20)
    preempted: list[str] = []
    while not preempted:
        preempted = eng.step().preempted
        check_pool(eng)
    assert preempted == ["b"]  # b came last; its blocks were its own content
    assert eng.cached_blocks == 0
    eng.cancel("a")  # a's three prompt blocks stay cached, its others empty
    assert eng.cached_blocks == 3 and eng.used_blocks == 0
    again = eng.submit("a2", 12, 1, output_tokens=1, block_keys=ListedKeys(("a0", "a1", "a2")))
    r = eng.step()  # b resumes first and takes free blocks; a2 still finds 2 blocks (11 tokens max)
    check_pool(eng)
    assert again.cached_tokens == 8 and r.cached_tokens == 8


def test_eviction_makes_room_for_new_work_instead_of_blocking_it() -> None:
    eng = make(blocks=6, max_model_len=24, max_num_batched_tokens=24)
    eng.submit("a", 16, 1, output_tokens=1, block_keys=SessionKeys("a"))
    drain(eng)
    assert eng.cached_blocks == 4 and eng.free_blocks == 6  # cached blocks count as free
    eng.submit("b", 20, 2, output_tokens=2)
    r = eng.step()
    assert r.admitted == ["b"] and eng.pool.evictions == 3 and eng.cached_blocks == 1
    drain(eng)


def run_trace(caching: bool, keyed: bool, seed: int) -> list[tuple[object, ...]]:
    import random

    rng = random.Random(seed)
    eng = make(blocks=40, caching=caching, max_model_len=96, max_num_batched_tokens=96)
    out: list[tuple[object, ...]] = []
    for i in range(60):
        if rng.random() < 0.5:
            session = f"s{rng.randrange(3)}"
            keys = SessionKeys(session) if keyed else None
            eng.submit(
                f"r{i}",
                rng.randint(1, 40),
                rng.randint(1, 30),
                output_tokens=rng.randint(1, 30),
                block_keys=keys,
            )
        r = eng.step()
        out.append((r.new_tokens, r.finished, r.preempted, r.admitted, r.prefill_tokens,
                    r.decode_seqs, r.context_tokens, r.duration_s, eng.used_blocks))  # fmt: skip
    return out


def test_cache_off_or_no_content_keys_is_the_engine_without_a_cache() -> None:
    for seed in range(5):
        plain = run_trace(caching=False, keyed=False, seed=seed)
        assert run_trace(caching=True, keyed=False, seed=seed) == plain
        assert run_trace(caching=False, keyed=True, seed=seed) == plain


ops = st.lists(
    st.tuples(
        st.sampled_from(["submit", "step", "cancel"]),
        st.integers(1, 60),
        st.integers(1, 40),
        st.integers(0, 3),
    ),
    max_size=50,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=ops,
    blocks=st.integers(12, 48),
    block_size=st.sampled_from([1, 2, 4]),
    chunked=st.booleans(),
    budget=st.integers(8, 128),
)
# Found by hypothesis: the chain that ``cache_hit`` extends over the whole prompt was offered to
# the cache before those blocks were computed (a block counted as used and cached at once).
@example(
    ops=[("submit", 50, 3, 0), ("submit", 7, 1, 1)], blocks=28, block_size=2, chunked=True, budget=9
)
def test_random_sessions_never_leak_kv_and_finish(
    ops: list[tuple[str, int, int, int]], blocks: int, block_size: int, chunked: bool, budget: int
) -> None:
    eng = SimEngine(
        EngineConfig(num_gpu_blocks=blocks, block_size=block_size, max_model_len=128,
                     max_num_batched_tokens=budget if chunked else 128, max_num_seqs=6,
                     chunked_prefill=chunked)
    )  # fmt: skip
    submitted: list[str] = []
    hits = 0
    for kind, a, b, c in ops:
        if kind == "submit":
            rid = f"r{len(submitted)}"
            submitted.append(rid)
            keys = SessionKeys(f"s{c}") if c else None  # 0: content of its own
            try:
                eng.submit(rid, a, b, output_tokens=b, block_keys=keys)
            except ValueError:  # RequestRejected included
                continue
        elif kind == "step":
            for _ in range(a % 5 + 1):
                hits += eng.step().cached_tokens
                check_pool(eng)
        elif submitted:
            eng.cancel(submitted[a % len(submitted)])
            check_pool(eng)
    for _ in range(100_000):
        if not eng.has_work:
            break
        hits += eng.step().cached_tokens
        check_pool(eng)
    event("cache hit" if hits else "no hit")
    assert not eng.has_work and eng.used_blocks == 0
    assert eng.cached_blocks + eng.pool.empty == blocks
