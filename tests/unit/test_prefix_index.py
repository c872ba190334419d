"""Prefix-aware reservations and charges: the prefix index (LRU, runs, the engine's
confirmation) and what the admission core reserves, charges and settles with it."""

from __future__ import annotations

from typing import Any

from kvgate_agent.admission import AdmissionController, AdmissionRequest, AsyncAdmission
from kvgate_agent.admission.prefix_index import TRUST_ALPHA, TRUST_START, PrefixIndex
from tests.unit.test_admission import make


def test_run_is_the_leading_blocks_held_at_most_the_prompt_less_a_block() -> None:
    idx = PrefixIndex(max_blocks=100)
    idx.remember([1, 2, 3, 4])
    assert idx.run([1, 2, 9, 4], 200, 16) == 32  # stops at the first unknown block
    assert idx.run([7, 1, 2], 200, 16) == 0
    # a 64-token prompt: at most 48 tokens (three blocks) may be cached
    assert idx.run([1, 2, 3, 4], 64, 16) == 48
    assert idx.run([1, 2, 3, 4], 10, 16) == 0


def test_the_index_is_bounded_least_recently_admitted_first() -> None:
    idx = PrefixIndex(max_blocks=3)
    idx.remember([1, 2, 3])
    idx.remember([1])  # refreshed
    idx.remember([4])
    assert len(idx) == 3
    assert idx.run([1], 100, 16) == 16
    assert idx.run([2], 100, 16) == 0  # the oldest went
    assert idx.run([4], 100, 16) == 16


def test_trust_starts_at_its_fraction_and_follows_the_engine() -> None:
    idx = PrefixIndex()
    assert idx.trust == TRUST_START
    assert idx.expect(64, 16) == 32
    idx.confirm(64, 64)
    assert idx.trust == TRUST_START + TRUST_ALPHA * (1 - TRUST_START)
    idx.confirm(0, 100)  # no run: nothing to confirm
    assert idx.trust == TRUST_START + TRUST_ALPHA * (1 - TRUST_START)
    for _ in range(500):
        idx.confirm(64, 0)
    assert idx.trust < 0.01
    assert idx.expect(64, 16) == 0
    for _ in range(500):
        idx.confirm(64, 1000)  # never above 1
    assert 0.99 < idx.trust <= 1.0


SPEC: dict[str, Any] = {"model": {"blockSize": 16}, "capacity": {"kvCacheTokens": 100_000}}


def _submit(c: AdmissionController, blocks: list[int] | None, prompt: int = 160) -> Any:
    r = AdmissionRequest("a", prompt, 32, prefix_blocks=blocks)
    d = c.submit(r)
    assert d.ticket is not None
    return r, d.ticket


def test_a_repeated_prefix_reserves_and_charges_only_the_uncached_prompt() -> None:
    c = make(SPEC)
    blocks = list(range(10))
    _, first = _submit(c, blocks)
    assert first.kv_tokens == 192 and first.cached_tokens == 0  # nothing seen yet
    r, second = _submit(c, blocks)
    # run: 9 blocks (144 tokens; never the last block), trusted at TRUST_START: 64 tokens
    assert r.prefix_run == 144
    assert second.cached_tokens == 64
    assert second.kv_tokens == 192 - 64
    assert second.fair_charged == first.fair_charged - 64 * c.config.fair_prompt_weight
    assert c.stats().kv_reserved_tokens == 192 + 128
    # settled with the engine's report: the counter is charged the uncached prompt, the
    # confirmation moves the trust, every token is given back
    trust = c._limits.prefixes.trust
    assert c.release(second, completion_tokens=32, cached_tokens=144)
    assert second.fair_charged == c.config.fair_prompt_weight * 16 + (
        c.config.fair_output_weight * 32
    )
    assert c._limits.prefixes.trust > trust
    assert c.release(first, completion_tokens=32)
    assert c.stats().kv_reserved_tokens == 0 and c.stats().in_flight == 0


def test_without_block_hashes_nothing_changes() -> None:
    blind, aware = make(SPEC), make(SPEC)
    for _ in range(3):
        _, t1 = _submit(blind, None)
        _, t2 = _submit(aware, list(range(10)))
    assert t1.cached_tokens == 0 and t1.kv_tokens == 192
    assert t2.cached_tokens > 0 and t2.kv_tokens < 192
    # a caller's own expected count works without hashes
    c = make(SPEC)
    d = c.submit(AdmissionRequest("a", 160, 32, cached_prefix_tokens=96))
    assert d.ticket is not None and d.ticket.kv_tokens == 96


async def test_the_sidecars_api_settles_with_the_engines_cached_tokens() -> None:
    a = AsyncAdmission(make(SPEC))
    blocks = list(range(10))
    first = (await a.admit(AdmissionRequest("a", 160, 32, prefix_blocks=blocks))).ticket
    second = (await a.admit(AdmissionRequest("a", 160, 32, prefix_blocks=blocks))).ticket
    assert first is not None and second is not None and second.prefix_run == 144
    a.release(second, completion_tokens=32, cached_tokens=144)
    a.release(first, completion_tokens=32)
    assert second.fair_charged == 16 * a.core.config.fair_prompt_weight + 32 * (
        a.core.config.fair_output_weight
    )
    assert a.stats().kv_reserved_tokens == 0
    a.close()
