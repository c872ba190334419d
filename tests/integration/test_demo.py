"""The demo's core on a short, fast load (kvgate-sim and the sidecar in this event loop), and the
load generator's pure summarisation functions."""

from __future__ import annotations

import dataclasses
import time

import pytest
import yaml

from kvgate_agent.contract.policy import RateLimitPolicy, parse_policy
from kvgate_bench.demo import http as demo
from kvgate_bench.demo.loadgen import (
    RequestResult,
    chat_body,
    prompt_text,
    summarize,
    summarize_one,
)
from kvgate_bench.kit.toolkit import percentile
from kvgate_bench.sim.server import count_chat_prompt_tokens

# ---------------------------------------------------------------------- loadgen (pure)


def _res(tenant: str = "t", status: int = 200, **kw: object) -> RequestResult:
    kw.setdefault("complete", status == 200)
    return RequestResult(tenant, status, 0.0, **kw)  # type: ignore[arg-type]


def test_percentile_interpolates_like_numpy() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_summarize_counts_each_outcome_once() -> None:
    results = [
        _res("a", ttft=0.1, completion_tokens=10),
        _res("a", ttft=0.3, completion_tokens=20, degraded=True, decision="degraded"),
        _res("a", 429, retry_after=3.0, decision="rejected"),
        _res("a", 0, error="cut off"),
        _res("a", 200, complete=False, completion_tokens=5, error="stream ended"),
        _res("b", ttft=0.2, completion_tokens=7, decision="queued", queue_wait=0.5),
        _res("b", 503),
    ]
    s = summarize(results, ["a", "b", "c"])
    assert list(s) == ["a", "b", "c", "*"]
    a = s["a"]
    assert (a.requests, a.completed, a.rejected_429, a.failed, a.rejected_other) == (5, 2, 1, 2, 0)
    assert a.degraded == 1 and a.queued == 0
    assert a.completion_tokens == 30  # the broken stream's 5 tokens are not counted
    assert a.ttft_p50 == pytest.approx(0.2)
    assert a.retry_after_max == 3.0
    b = s["b"]
    assert (b.completed, b.rejected_other, b.queued, b.queue_wait_p99) == (1, 1, 1, 0.5)
    assert s["c"].requests == 0 and s["c"].ttft_p99 is None
    total = s["*"]
    assert total.requests == 7 and total.completion_tokens == 37
    assert all(x.accounted for x in s.values())


def test_summarize_default_tenant_order_is_first_seen() -> None:
    s = summarize([_res("z"), _res("y"), _res("z")])
    assert list(s) == ["z", "y", "*"]
    assert summarize_one("z", []).requests == 0


def test_queued_means_waited_in_the_sidecar_queue() -> None:
    assert _res(decision="queued").queued
    assert _res(decision="degraded", queue_wait=1.2).queued
    assert not _res(decision="admitted").queued
    assert not _res(decision="degraded", queue_wait=None).queued


@pytest.mark.parametrize("tokens", [7, 50, 333, 4000])
def test_prompt_has_the_requested_size_on_the_simulator(tokens: int) -> None:
    messages = [{"role": "user", "content": prompt_text(tokens)}]
    assert count_chat_prompt_tokens(messages) == tokens
    assert b'"stream":true' in chat_body("m", tokens, 16)


# ---------------------------------------------------------------------- demo


def test_schedule_is_deterministic_bursty_and_sorted() -> None:
    cfg = demo.DemoConfig(duration=8.0, seed=3)
    a, b = demo.build_schedule(cfg), demo.build_schedule(cfg)
    assert a == b
    assert a != demo.build_schedule(dataclasses.replace(cfg, seed=4))
    assert [r.at for r in a] == sorted(r.at for r in a)
    assert {r.tenant for r in a} == set(demo.TENANTS)
    in_burst = sum(1 for r in a if (r.at % cfg.burst_period) < cfg.burst_length)
    burst_share = cfg.burst_length / cfg.burst_period
    assert in_burst / len(a) > 2 * burst_share  # arrivals concentrate in the bursts
    for r in a:
        prof = next(p for p in cfg.profiles if p.name == r.tenant)
        assert prof.prompt_tokens[0] <= r.prompt_tokens <= prof.prompt_tokens[1]
        assert prof.max_tokens[0] <= r.max_tokens <= prof.max_tokens[1]


def _fast_policy() -> RateLimitPolicy:
    """The example policy with a short queue wait, so the short run drains quickly."""
    doc = yaml.safe_load(demo.DEFAULT_POLICY.read_text())
    doc["spec"]["queue"]["maxWaitSeconds"] = 1
    return parse_policy(doc)


#: The demo's tenants scaled to a half-size pool and shorter outputs, so a run takes ~3 s.
FAST_PROFILES = (
    demo.TenantProfile("chat", 2.5, 8.0, (30, 150), (32, 96)),
    demo.TenantProfile("long-prompt", 0.5, 1.0, (1000, 2500), (64, 128)),
    demo.TenantProfile("long-output", 0.3, 10.0, (50, 300), (512, 1024)),
)


async def test_demo_core_short_run() -> None:
    cfg = dataclasses.replace(
        demo.DemoConfig(),
        duration=1.5,
        decode_ms=1.0,
        drain_timeout=20.0,  # not a cut-off on a busy machine: cut-offs count as failed below
        seed=4,
        kv_capacity_tokens=8192,
        profiles=FAST_PROFILES,
    )
    started = time.monotonic()
    report = await demo.run_demo(cfg, policy=_fast_policy())
    # Two short runs (~3 s each), not a stuck one: the bound is generous (60 s) for a busy
    # machine; a request that never ends is caught as a cut-off (failed == 0) below.
    assert time.monotonic() - started < 60

    n = len(report.schedule)
    assert n > 10
    for run in (report.direct, report.kvgate):
        assert len(run.results) == n  # every request accounted for
        sums = run.summaries()
        assert list(sums) == [*demo.TENANTS, "*"]
        assert sums["*"].requests == n
        assert all(s.accounted for s in sums.values())
        assert sum(s.requests for t, s in sums.items() if t != "*") == n
        assert set(run.preemptions) <= set(demo.TENANTS)
        assert sums["*"].failed == 0 and sums["*"].rejected_other == 0  # no 5xx, no cut-offs
    # Without kvgate: nothing is refused. With it: never more preemptions.
    assert report.direct.summaries()["*"].rejected_429 == 0
    assert report.kvgate.preemptions_total <= report.direct.preemptions_total
    assert report.kvgate.preemptions_total == 0  # reservations cover every running sequence
    # The sidecar answered every request (decision header) and the direct run never saw one.
    assert all(r.decision is not None for r in report.kvgate.results)
    assert all(r.decision is None for r in report.direct.results)

    rows = demo.report_rows(report)
    assert len(rows) == 2 * (len(demo.TENANTS) + 1)
    assert all(len(r) == len(demo.COLUMNS) for r in rows)
    assert [r[1] for r in rows[:2]] == ["without", "kvgate"]
    text = demo.format_report(report)
    assert "TTFT p99" in text and "preemptions" in text
    lines = demo.takeaway(report)
    assert 2 <= len(lines) <= 3
    if report.direct.preemptions_total > 0:
        assert f"preempted {report.direct.preemptions_total} times" in lines[0]
