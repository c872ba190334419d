"""Fair shares across a pool (issue 34, item 3): the pool's view of the tenants' service on other
replicas (``fairqueue/pool.py``): what a replica publishes, the rates and the fair level it
reads off the pool's sums, its fallback when the sums are stale, and how the fair reserve and the
order use it. Clock injected; no sleeps."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate_agent.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionRequest,
    PoolShare,
)
from kvgate_agent.admission.fairqueue.pool import POOL_RESERVE
from kvgate_bench.kit.toolkit import FakeClock


def controller(clock: FakeClock | None = None, **kw: Any) -> tuple[AdmissionController, FakeClock]:
    clock = clock if clock is not None else FakeClock(1000.0)
    base: dict[str, Any] = {"max_concurrency": 10, "queue_max_length": 1000}
    base.update(kw)
    return AdmissionController(AdmissionConfig(**base), clock), clock


def req(tenant: str, weight: float = 1.0, **kw: Any) -> AdmissionRequest:
    return AdmissionRequest(tenant, 10, 10, predicted_output_tokens=10, weight=weight, **kw)


class Pool:
    """The pool's sums (the store's hash), in memory."""

    def __init__(self) -> None:
        self.totals: dict[str, tuple[float, float]] = {}

    def add(self, deltas: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        for t, (u, r) in deltas.items():
            u0, r0 = self.totals.get(t, (0.0, 0.0))
            self.totals[t] = (u0 + u, r0 + r)
        return dict(self.totals)


def feed(p: PoolShare, pool: Pool, now: float, **weighted: tuple[float, float]) -> dict[str, float]:
    """Another replica served each tenant (units, weight) since the last sync; sync ``p``."""
    pool.add({t: (u, u * w) for t, (u, w) in weighted.items()})
    sent = p.take(now)
    return p.update(pool.add(sent), sent, now)


def test_a_replica_publishes_what_it_charged_after_credit_only_growing() -> None:
    c, clock = controller()
    p = PoolShare()
    c.attach_pool(p)
    t = c.submit(req("gold", weight=4.0)).ticket
    assert t is not None
    # prompt 10 + 2 x 10 output = 30 units charged at admission, weight 4
    assert p.take(clock()) == {"gold": (7.5, 30.0)}
    c.release(t, completion_tokens=2)  # used 10 + 4 = 14: 16 credited, nothing published
    assert p.take(clock()) == {}
    t = c.submit(req("gold", weight=4.0)).ticket  # the credit (4 weighted units) pays first
    assert t is not None
    assert p.take(clock()) == {"gold": (3.5, 14.0)}


def test_rates_fair_level_and_excess_from_the_pool_sums() -> None:
    p, pool = PoolShare(tau_s=1e-6), Pool()
    feed(p, pool, 0.0, premium=(0.0, 4.0), regular=(0.0, 1.0))
    # one second: premium served 200 raw (50 weighted), regular 100 raw (100 weighted): 2:1
    feed(p, pool, 1.0, premium=(50.0, 4.0), regular=(100.0, 1.0))
    # L = 300 raw/s over weights 4 + 1 = 60 weighted units/s
    assert p.level == pytest.approx(60.0)
    assert p.excess("regular", 1.0) == pytest.approx(100 / 60)
    assert p.excess("premium", 1.0) == pytest.approx(50 / 60)
    assert p.over_share("regular", 1.0) and not p.over_share("premium", 1.0)
    # served 4:1, both at the fair level: nobody over
    feed(p, pool, 2.0, premium=(50.0, 4.0), regular=(50.0, 1.0))
    assert not p.over_share("regular", 2.0) and not p.over_share("premium", 2.0)


def test_the_remote_service_is_the_growth_less_what_this_replica_sent() -> None:
    c, clock = controller()
    p, pool = PoolShare(), Pool()
    c.attach_pool(p)
    feed(p, pool, clock(), a=(0.0, 1.0))  # (a tenant's first read only sets where it starts)
    assert c.submit(req("a")).ticket is not None  # 30 units here
    pool.add({"a": (100.0, 100.0)})  # and 100 on another replica
    clock.now += 1
    sent = p.take(clock())
    assert sent == {"a": (30.0, 30.0)}
    remote = p.update(pool.add(sent), sent, clock())
    assert remote == pytest.approx({"a": 100.0})
    before = c.tenant_stats().fair_shares
    c.pool_synced(remote)
    (after,) = [s for s in c.tenant_stats().fair_shares if s[0] == "a"]
    (was,) = [s for s in before if s[0] == "a"]
    assert after[1] == pytest.approx(was[1] + 100.0)


def test_the_order_here_follows_the_service_elsewhere() -> None:
    c, clock = controller(max_concurrency=1)
    p, pool = PoolShare(), Pool()
    c.attach_pool(p)
    held = c.submit(req("x")).ticket
    assert held is not None
    c.submit(req("busy-elsewhere"))
    c.submit(req("quiet"))
    feed(p, pool, clock(), **{"busy-elsewhere": (0.0, 1.0)})
    clock.now += 0.5
    c.pool_synced(feed(p, pool, clock(), **{"busy-elsewhere": (1000.0, 1.0)}))
    c.release(held, completion_tokens=10)
    c.pump()
    (w,) = c.take_resolved()
    assert w.request.tenant == "quiet"


def over_pool(clock: FakeClock) -> tuple[AdmissionController, PoolShare]:
    """A pod where ``regular`` (weight 1) is alone but over its pool-wide share: premium
    (weight 4) is served as much raw as regular on the other replicas."""
    c, _ = controller(clock)
    p, pool = PoolShare(tau_s=1e-6), Pool()
    c.attach_pool(p)
    feed(p, pool, clock(), premium=(0.0, 4.0), regular=(0.0, 1.0))
    clock.now += 1
    c.pool_synced(feed(p, pool, clock(), premium=(100.0, 4.0), regular=(400.0, 1.0)))
    assert p.over_share("regular", clock()) and not p.over_share("premium", clock())
    return c, p


def test_a_tenant_over_its_pool_share_leaves_the_pool_reserve_even_alone_here() -> None:
    clock = FakeClock(1000.0)
    c, _ = over_pool(clock)
    keep = round(10 * (1 - POOL_RESERVE))
    got = [c.submit(req("regular")) for _ in range(10)]
    assert sum(d.ticket is not None for d in got) == keep  # alone, yet the reserve is kept
    # refused at once, not queued (a router retries elsewhere; the queue stays short)
    assert all(d.waiter is None and d.status == 429 for d in got[keep:])
    assert "share of the pool" in got[-1].message
    # a premium request spilled here finds room at once
    assert c.submit(req("premium", weight=4.0)).ticket is not None


def test_stale_pool_figures_fall_back_to_local_counters_only() -> None:
    clock = FakeClock(1000.0)
    c, p = over_pool(clock)
    clock.now += p.stale_s + 0.1  # the store away: no read since
    assert not p.fresh(clock()) and p.excess("regular", clock()) == 0.0
    got = [c.submit(req("regular")).ticket for _ in range(10)]
    assert all(t is not None for t in got)  # work-conserving, as with the exchange off


def test_a_tenant_is_judged_by_its_class_the_tenants_of_its_weight() -> None:
    for by_class in (True, False):
        p, pool = PoolShare(tau_s=1e-6, by_class=by_class), Pool()
        feed(p, pool, 0.0, p1=(0.0, 4.0), p2=(0.0, 4.0), r1=(0.0, 1.0))
        # premium served 4:1 as a class (p1 + p2 = 200 raw against 50), unevenly inside it
        feed(p, pool, 1.0, p1=(40.0, 4.0), p2=(10.0, 4.0), r1=(50.0, 1.0))
        assert p.level == pytest.approx(250 / 9)
        assert p.over_share("r1", 1.0)
        # by class premium is under its share (25 / 27.8); on its own p1 is over (40 / 27.8)
        assert p.over_share("p1", 1.0) is not by_class
        assert not p.over_share("p2", 1.0)


def test_unsent_deltas_go_with_the_next_sync_and_a_restarted_store_restarts_the_rates() -> None:
    p, pool = PoolShare(tau_s=1e-6, by_class=False), Pool()
    p.charged("a", 5.0, 5.0)
    lost = p.take(0.0)
    p.unsent(lost)
    p.charged("a", 1.0, 1.0)
    assert p.take(0.5) == {"a": (6.0, 6.0)}
    feed(p, pool, 1.0, a=(10.0, 1.0), b=(10.0, 1.0))
    feed(p, pool, 2.0, a=(30.0, 1.0), b=(10.0, 1.0))
    assert p.over_share("a", 2.0)
    # the store restarted empty: sums lower than before, rates wait for the next read
    pool.totals = {}
    assert feed(p, pool, 3.0, a=(1.0, 1.0), b=(1.0, 1.0)) == {}
    feed(p, pool, 4.0, a=(10.0, 1.0), b=(10.0, 1.0))
    assert not p.over_share("a", 4.0) and p.excess("a", 4.0) == pytest.approx(1.0)


def test_the_sync_is_due_every_period_and_bad_settings_are_refused() -> None:
    p = PoolShare(sync_s=0.5)
    assert p.due(0.0)
    p.take(0.0)
    assert not p.due(0.4) and p.due(0.5)
    with pytest.raises(ValueError):
        PoolShare(reserve=1.0)
    with pytest.raises(ValueError):
        PoolShare(sync_s=0.0)


def test_without_the_pool_nothing_is_published_or_held() -> None:
    c, _ = controller()
    got = [c.submit(req("regular")).ticket for _ in range(10)]
    assert all(t is not None for t in got)
