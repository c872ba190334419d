"""The lent slot (issue 33): a quiet tenant's request that the adaptive concurrency limit alone
would refuse for its TTFT SLO starts at once on one slot above that limit, when a tenant far
above its share holds the slots (:func:`kvgate_agent.admission.fairqueue.reserve.slot_lent`,
:func:`kvgate_agent.admission.overload.act`)."""

from __future__ import annotations

from typing import Any

from kvgate_agent.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionRequest,
    Outcome,
    Reason,
    Ticket,
)
from kvgate_agent.admission.fairqueue.reserve import slot_lent
from kvgate_agent.admission.limits import Limits
from kvgate_bench.kit.toolkit import FakeClock


def req(tenant: str, prompt: int = 10, max_tokens: int = 10) -> AdmissionRequest:
    return AdmissionRequest(tenant, prompt, max_tokens, predicted_output_tokens=max_tokens)


def loaded(limit: int, **kw: Any) -> tuple[AdmissionController, FakeClock, Ticket]:
    """A controller under a TTFT SLO of 1 s whose requests take 4 s each (learned from four
    of ``noisy``'s), the adaptive limit at ``limit`` under a cap of 4 (as the ceiling sets it),
    and one more of ``noisy``'s in flight: a newcomer would wait past its SLO."""
    clock = FakeClock(1000.0)
    cfg: dict[str, Any] = {"max_concurrency": 4, "queue_max_length": 100}
    cfg.update(kw)
    cfg.setdefault("ttft_slo_seconds", 1.0)
    c = AdmissionController(AdmissionConfig(**cfg), clock)
    for _ in range(4):
        t = c.submit(req("noisy")).ticket
        assert t is not None
        clock.advance(4.0)
        c.release(t, completion_tokens=10)
    c._limits.concurrency_limit = limit  # the adaptive limit (slo.py) brought down to it
    held = c.submit(req("noisy")).ticket
    assert held is not None
    return c, clock, held


def test_a_quiet_tenant_takes_a_lent_slot_beside_a_flooding_one() -> None:
    c, _, _ = loaded(1)
    d = c.submit(req("quiet"))
    assert d.outcome is Outcome.ADMITTED and d.ticket is not None
    assert d.reason is Reason.LENT_SLOT  # counted apart in the decisions metric
    assert c.stats().in_flight == 2
    # One slot at most, and never to the tenant above its share.
    assert c.submit(req("other")).ticket is None
    assert c.submit(req("noisy")).ticket is None


def test_no_slot_is_lent_to_the_flooding_tenant_or_between_equals() -> None:
    c, _, held = loaded(1)
    assert c.submit(req("noisy")).ticket is None  # its own tenant holds the slot
    c.release(held, completion_tokens=10)
    free = c.submit(req("quiet"))
    assert free.ticket is not None and free.reason is Reason.OK  # the slot was free, not lent
    # noisy holds nothing now, but quiet is not above noisy's service: nothing lent.
    d = c.submit(req("noisy"))
    assert d.ticket is None
    assert c.stats().in_flight == 1


def test_nothing_is_lent_at_the_hard_cap() -> None:
    c, _, _ = loaded(4)
    for _ in range(3):
        assert c.submit(req("noisy")).ticket is not None
    d = c.submit(req("quiet"))  # four in flight of the engine's four: nothing above the cap
    assert d.ticket is None
    assert d.outcome is not Outcome.ADMITTED


def test_no_slot_is_lent_while_the_wait_fits_the_slo() -> None:
    c, _, _ = loaded(1, ttft_slo_seconds=60.0)
    d = c.submit(req("quiet"))
    assert d.ticket is None and d.waiter is not None  # queued: its wait fits its budget
    assert d.reason is Reason.OK


def test_slot_lent_reads_the_shares() -> None:
    limits = Limits(AdmissionConfig(max_concurrency=4), 0.0, 100)
    limits.concurrency_limit = 1
    assert not slot_lent(limits, req("quiet"), 1)  # nothing in flight
    limits.reserve(req("noisy"), 10, 0.0)  # charged at admission: its attained service
    assert slot_lent(limits, req("quiet"), 1)
    assert not slot_lent(limits, req("noisy"), 1)
    limits.concurrency_cap = 1  # the engine's own slots: nothing above them
    assert not slot_lent(limits, req("quiet"), 1)
