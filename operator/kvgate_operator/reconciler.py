"""The reconcile loop: read the cluster, compute desired state, write the differences.

Level-triggered: watch events (delivered by kopf) only *trigger* a pass; each pass reads a fresh
snapshot with LIST calls (:mod:`kvgate_operator.reader`) and computes everything from scratch
(:mod:`kvgate_operator.desired`), then writes only what differs (:mod:`kvgate_operator.plan`,
written by :mod:`kvgate_operator.writer`). So a missed or duplicated event, a restart mid-pass
or a crash between two writes cannot leave anything wrong for longer than the next pass; bursts
of events are debounced into one pass; a periodic resync runs even without events.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError
from urllib3.exceptions import HTTPError

from kvgate_agent.contract.nodeadmission import NodeAdmissionSpec
from kvgate_operator.desired import compute, mark_write_failures
from kvgate_operator.metrics import OperatorMetrics
from kvgate_operator.plan import plan, stale_owners
from kvgate_operator.reader import ClusterReader
from kvgate_operator.settings import OperatorSettings
from kvgate_operator.writer import ClusterWriter, NotLeader, PassStats

log = logging.getLogger("kvgate.operator")
#: Longest pause before retrying a failed pass, seconds: after an outage the operator passes
#: again within this (plus the pass) of the network healing.
MAX_RETRY_SECONDS = 30.0


class PassIncomplete(Exception):
    """A pass whose writes did not all land (the next pass retries them)."""


def _normalized(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    """A stored NodeAdmission spec in the operator's own serialisation (defaults the API server
    filled in made explicit the same way), so comparing with the desired spec sees only real
    differences. A spec that does not parse is returned as is (it will be rewritten)."""
    if spec is None:
        return None
    try:
        return NodeAdmissionSpec.model_validate(spec).model_dump(
            by_alias=True, exclude_none=True, mode="json"
        )
    except ValidationError:
        return spec


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Reconciler:
    """The reconcile loop and its passes: :meth:`run` is the long-running loop; a pass reads
    with :attr:`reader`, computes and plans, and writes with :attr:`writer`.

    Holds the wake-up event (a pass was asked for), the pass bookkeeping (when the last one
    succeeded, monotonic seconds; how many passes and writes so far; what the last one did),
    when this replica last started leading, and whether a pass's worker thread runs.

    Args:
        api: a configured ``kubernetes.client.ApiClient``.
        settings: operator settings (debounce, resync).
        clock: monotonic seconds (injected for tests of the loop's bookkeeping).
        metrics: where the missed-injection counts go (a private instance when not given).
        may_write: whether this replica may write now (the leader election's
            :meth:`~kvgate_operator.leader.LeaderElector.is_leader`); asked before each pass and
            before each write. Default: always.
        identity: this replica's name (its pod name), the ``reportingInstance`` of its Events.
    """

    def __init__(
        self,
        api: client.ApiClient,
        settings: OperatorSettings,
        clock: Callable[[], float] = time.monotonic,
        metrics: OperatorMetrics | None = None,
        may_write: Callable[[], bool] = lambda: True,
        identity: str = "kvgate-operator",
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.may_write = may_write
        self.reader = ClusterReader(api, settings)
        self.writer = ClusterWriter(
            api, metrics if metrics is not None else OperatorMetrics(), may_write, identity
        )
        self._wake = asyncio.Event()
        self.last_pass_ok: float | None = None
        #: When this replica last started leading (None: it never took over; without an
        #: election it writes from the start, and the first pass counts).
        self.leading_since: float | None = None
        #: Clear while a pass's worker thread runs (cancelling the loop does not stop it).
        self._idle = threading.Event()
        self._idle.set()
        self.last_stats = PassStats()
        self.total_writes = 0
        self.passes = 0

    # ------------------------------------------------------------------ loop

    def trigger(self) -> None:
        """Ask for a pass soon (debounced)."""
        self._wake.set()

    async def run(self) -> None:
        """Reconcile on every trigger (debounced) and at least every ``resync_seconds``.
        A failed pass, whatever it raised, is logged (with its traceback when unexpected) and
        retried with backoff; it never stops the loop."""
        backoff = 1.0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.resync_seconds)
            await asyncio.sleep(self.settings.debounce_seconds)
            self._wake.clear()
            if not self.may_write():
                continue  # a follower: the election triggers a pass when this replica leads
            try:
                await self.reconcile_once()
                backoff = 1.0
            except NotLeader:
                log.warning("leadership lost during a pass: its remaining writes were dropped")
            except Exception as exc:  # never let the loop die: liveness would fail for good
                # (HTTPError: urllib3's timeouts and refused connections, which are not OSErrors)
                expected = (ApiException, OSError, ValueError, PassIncomplete, HTTPError)
                log.warning(
                    "reconcile pass failed, retrying in %.0fs: %s",
                    backoff,
                    exc,
                    exc_info=not isinstance(exc, expected),
                )
                await asyncio.sleep(backoff)
                backoff = min(MAX_RETRY_SECONDS, backoff * 2)
                self._wake.set()

    def started_leading(self) -> None:
        """This replica just took over: its liveness counts from now (a follower runs no
        pass, so its last one, if any, is old)."""
        self.leading_since = self.clock()

    def healthy(self) -> tuple[bool, str]:
        """Liveness: a pass succeeded, or this replica took over, recently (within
        ``liveness_stale_seconds``)."""
        stale = self.settings.liveness_stale_seconds
        if self.leading_since is not None and (
            self.last_pass_ok is None or self.last_pass_ok < self.leading_since
        ):
            age = self.clock() - self.leading_since
            if age > stale:
                return False, f"leading for {age:.0f}s without a successful reconcile pass"
            return True, f"leading for {age:.1f}s, no pass since"
        if self.last_pass_ok is None:
            return False, "no reconcile pass has completed yet"
        age = self.clock() - self.last_pass_ok
        if age > stale:
            return False, f"last successful reconcile pass was {age:.0f}s ago"
        return True, f"last pass {age:.1f}s ago, {self.total_writes} writes so far"

    async def wait_idle(self, within: float) -> bool:
        """Wait up to ``within`` seconds for a running pass's worker thread to end; whether
        none runs any more."""
        return await asyncio.to_thread(self._idle.wait, within)

    def _pass_in_thread(self) -> PassStats:
        try:
            return self._pass()
        finally:
            self._idle.set()

    async def reconcile_once(self) -> PassStats:
        """One pass: read, compute, plan, write. Returns what it wrote."""
        t0 = time.perf_counter()
        # Reading, computing and writing all run in a worker thread: the event loop (kopf's
        # watches) is never blocked by a pass, however large the cluster.
        self._idle.clear()
        stats = await asyncio.to_thread(self._pass_in_thread)
        stats.seconds = time.perf_counter() - t0
        self.last_stats = stats
        self.total_writes += stats.writes
        self.passes += 1
        self.last_pass_ok = self.clock()
        if stats.writes or stats.events or stats.missed_events:
            log.info(
                "reconciled: %d NodeAdmission writes, %d policy status writes, %d events, "
                "%d missed-injection events in %.2fs",
                stats.node_writes,
                stats.status_writes,
                stats.events,
                stats.missed_events,
                stats.seconds,
            )
        return stats

    def _pass(self) -> PassStats:
        self.writer.guard()
        observed = self.reader.read()
        desired = compute(observed.snapshot)
        # Stored specs are compared raw first; only those that differ are normalised (the API
        # server may have filled in defaults), so a steady pass validates nothing.
        specs = {
            node: spec if spec == desired.node_specs.get(node) else _normalized(spec)
            for node, spec in observed.node_specs.items()
        }
        # NodeAdmissions first; then statuses and events, which say if any of them failed.
        stats = PassStats()
        owners = stale_owners(observed.node_owners(), observed.snapshot.nodes)
        node_plan = plan(desired, specs, {}, _now(), statuses=False, owners=owners)
        stats.node_writes, failed = self.writer.write_nodes(node_plan.nodes, observed)
        if failed:
            mark_write_failures(desired, observed.snapshot, failed)
        rest = plan(
            desired,
            {n: desired.node_specs[n] for n in desired.node_specs},
            observed.policy_status,
            _now(),
        )
        more = self.writer.write(rest, observed)
        stats.status_writes, stats.events = more.status_writes, more.events
        stats.missed_events = self.writer.report_missed(observed.missed)
        if failed:
            # Counted as a failed pass: retried with backoff, and the liveness probe fails if
            # this persists (status and a Warning event already say why).
            raise PassIncomplete(
                f"{len(failed)} NodeAdmission write(s) failed: "
                + "; ".join(f"{n}: {e}" for n, e in sorted(failed.items()))
            )
        return stats
