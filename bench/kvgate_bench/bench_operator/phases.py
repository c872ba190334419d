"""The operator benchmark's phases: each a pair of counter readings around what it does
(:class:`Phase`, :func:`phase`): the objects created, the initial convergence, the no-op
resyncs, one policy changed, the agent heartbeats (:func:`heartbeats`) and the operator's
final figures, collected into :class:`RunState`.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, cast

from kvgate_agent.contract.api import GROUP, VERSION
from kvgate_bench.bench_operator.api import (
    Counters,
    Http,
    Writes,
    latencies,
    read_counters,
    write_diff,
)
from kvgate_bench.bench_operator.cluster import (
    Key,
    Layout,
    Specs,
    Statuses,
    build_objects,
    create_all,
    expected_state,
    node_admission_versions,
    node_name,
    wait_converged,
)
from kvgate_bench.bench_operator.inprocess import PassTiming, profile_pass, time_pass
from kvgate_bench.kit.controlplane import ControlPlane
from kvgate_bench.kit.operator_process import Operator
from kvgate_bench.kit.toolkit import cpu_seconds, memory_kib


@dataclass
class Phase:
    name: str
    seconds: float | None
    writes: Writes
    operator_cpu: float
    operator_loop_cpu: float
    apiserver_cpu: float
    etcd_cpu: float
    wall: float
    latency: list[tuple[str, int, float]]
    passes: int
    note: str = ""


def phase(
    name: str,
    a: Counters,
    b: Counters,
    seconds: float | None,
    own_lists: int = 0,
    pages: int = 1,
    **kw: Any,
) -> Phase:
    """A phase between readings ``a`` and ``b``. Every operator pass LISTs the policies once
    (``pages`` pages of 500): that count, less ``own_lists`` LISTs of them by others, is the
    pass count."""
    w = write_diff(a, b)
    kw.setdefault("passes", w.lists.get("ratelimitpolicies", 0) // pages - own_lists)
    return Phase(
        name,
        seconds,
        w,
        b.operator_cpu - a.operator_cpu,
        b.operator_loop_cpu - a.operator_loop_cpu,
        b.apiserver_cpu - a.apiserver_cpu,
        b.etcd_cpu - a.etcd_cpu,
        b.when - a.when,
        latencies(a, b),
        **kw,
    )


def settle(cp: ControlPlane, op: Operator, quiet: float, limit: float) -> Counters:
    """Wait until the operator has made no write for ``quiet`` seconds (it writes Events after
    the specs and statuses that convergence is judged on); return the counters then."""
    deadline = time.monotonic() + limit
    last = read_counters(cp, op.pid)
    since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(1.0)  # a scrape costs the API server ~40 ms of CPU (1.5 MB of text)
        now = read_counters(cp, op.pid)
        if write_diff(last, now).operator:
            since = time.monotonic()
        last = now
        if time.monotonic() - since >= quiet:
            break
    return last


def heartbeats(
    cp: ControlPlane, http: Http, op: Operator, lay: Layout, rate: float, seconds: float
) -> Phase:
    """What node agents' status heartbeats cost the operator: ``rate`` merge patches per second
    of ``status.heartbeatTime`` on the NodeAdmissions, round robin, for ``seconds``. The status
    is not an input of the desired state (only ``engineKvCapacityTokens`` would be): the target
    is no write, and ideally no pass either."""
    a = read_counters(cp, op.pid)
    t0 = time.monotonic()
    sent = 0
    while time.monotonic() - t0 < seconds:
        node = node_name(sent % lay.nodes)
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # always a change
        http.json(
            "PATCH",
            f"/apis/{GROUP}/{VERSION}/nodeadmissions/{node}/status",
            {"status": {"heartbeatTime": now}},
            content_type="application/merge-patch+json",
        )
        sent += 1
        time.sleep(max(0.0, t0 + sent / rate - time.monotonic()))
    time.sleep(2.0)  # let the pass in flight finish
    b = read_counters(cp, op.pid)
    return phase(
        "agent heartbeats",
        a,
        b,
        None,
        pages=lay.policy_pages,
        note=f"{sent} NodeAdmission status patches over {seconds:g} s ({rate:g}/s), then 2 s",
    )


def fmt_s(x: float | None) -> str:
    """A convergence time, seconds, or "not converged" (None)."""
    return "**not converged**" if x is None else f"{x:.2f} s"


@dataclass
class RunState:
    """What one run collects for its report (CPU seconds, KiB, seconds)."""

    lay: Layout
    args: argparse.Namespace
    failures: list[str] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    version: str = "?"
    created: int = 0
    create_s: float = 0.0
    log_before: int = 0
    log_after: int = 0
    cpu_total: float = 0.0
    hwm_kib: int = 0
    rss_kib: int = 0
    problems: list[str] = field(default_factory=list)
    cold: PassTiming | None = None
    warm: PassTiming | None = None
    prof: str = ""


def create_objects(http: Http, st: RunState) -> None:
    """Create the layout's nodes, namespaces, pods and policies."""
    base, policies = build_objects(st.lay)
    t0 = time.monotonic()
    create_all(http, base, st.args.workers)
    create_all(http, policies, st.args.workers)
    st.create_s = time.monotonic() - t0
    st.created = len(base) + len(policies)
    print(
        f"created {st.created} objects in {st.create_s:.1f} s "
        f"({st.created / st.create_s:.0f}/s, {st.args.workers} client threads)",
        flush=True,
    )


def initial_convergence(
    cp: ControlPlane, http: Http, op: Operator, want: tuple[Specs, Statuses], st: RunState
) -> Counters:
    """Start the operator and time it to the from-scratch state; the counters once it settles."""
    args = st.args
    c0 = read_counters(cp, None)
    op.start()
    t_start = time.monotonic()
    c0.operator_cpu = 0.0
    t_conv, polls, diff = wait_converged(http, want, args.timeout, args.poll)
    conv_s = None if t_conv is None else t_conv - t_start
    if t_conv is None:
        st.failures.append(f"initial convergence: not within {args.timeout:g} s: {diff}")
    print(f"initial convergence: {fmt_s(conv_s)} ({polls} polls)", flush=True)
    c1 = settle(cp, op, quiet=2.0, limit=60.0)
    log_passes = op.passes()
    first_write_pass = log_passes[0] if log_passes else None
    st.phases.append(
        phase(
            "initial convergence",
            c0,
            c1,
            conv_s,
            own_lists=polls + 1,  # the polls and kopf's initial LIST of the policies
            pages=st.lay.policy_pages,
            note=(
                f"first writing pass ended {first_write_pass.when - op.started_epoch:.2f} s "
                f"after start, took {first_write_pass.seconds:.2f} s"
                if first_write_pass
                else "no writing pass logged"
            ),
        )
    )
    st.log_before = sum(p.nodes + p.statuses + p.events for p in log_passes)
    return c1


def noop_resyncs(cp: ControlPlane, op: Operator, c1: Counters, st: RunState) -> None:
    """Idle for ``--noop-periods`` resyncs: the operator must not write."""
    args = st.args
    window = args.noop_periods * args.resync + args.debounce + 1.0
    time.sleep(window)
    c2 = read_counters(cp, op.pid)
    noop = phase(
        "no-op resyncs", c1, c2, None, pages=st.lay.policy_pages, note=f"{window:.1f} s idle"
    )
    st.phases.append(noop)
    if noop.writes.operator:
        st.failures.append(f"no-op resyncs wrote {noop.writes.operator} times (target 0)")
    if not noop.passes:
        st.failures.append("no pass ran in the no-op window")


def _change_target(desired: Any, snap: Any) -> Key:
    """The first policy (by namespace and name) that is accepted, matches pods, has no
    conflicts and a Global limit.

    Raises:
        SystemExit: there is none.
    """
    target = next(
        (
            k
            for k, o in sorted(desired.policies.items())
            if o.accepted
            and o.matched
            and not o.conflicts
            and any(rl.per == "Global" for rl in snap.policies[k].spec.rate_limits)
        ),
        None,
    )
    if target is None:
        raise SystemExit("no policy with a Global limit and matched pods to change")
    return cast(Key, target)


def change_one_policy(
    cp: ControlPlane, http: Http, op: Operator, desired: Any, snap: Any, st: RunState
) -> None:
    """Double one policy's Global request rate; time convergence and count what was written
    (exactly the NodeAdmissions of the nodes its pods run on, and its status)."""
    args = st.args
    target = _change_target(desired, snap)
    ns, name = target
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/ratelimitpolicies/{name}"
    obj = http.json("GET", path)
    limits = copy.deepcopy(obj["spec"]["rateLimits"])
    for rl in limits:
        if rl.get("per") == "Global" and "requestsPerMinute" in rl:
            rl["requestsPerMinute"] = rl["requestsPerMinute"] * 2
    changed = copy.deepcopy(obj)
    changed["spec"]["rateLimits"] = limits
    changed["metadata"]["generation"] = int(obj["metadata"].get("generation", 1)) + 1

    def edit(s: Any) -> Any:
        from kvgate_operator.desired import Policy, Snapshot

        pols = dict(s.policies)
        pols[target] = Policy.from_object(changed)
        return Snapshot(pols, s.pods, s.nodes, s.engine_capacity)

    want2, (desired2, snap2) = expected_state(cp, edit)
    touched = {snap2.pods[k].node for k in desired2.policies[target].matched}
    rv0 = node_admission_versions(http)
    c3 = read_counters(cp, op.pid)
    tc = time.monotonic()
    http.json(
        "PATCH",
        path,
        {"spec": {"rateLimits": limits}},
        content_type="application/merge-patch+json",
    )
    t_conv2, polls2, diff2 = wait_converged(http, want2, args.timeout, args.poll)
    change_s = None if t_conv2 is None else t_conv2 - tc
    if t_conv2 is None:
        st.failures.append(f"change: not converged within {args.timeout:g} s: {diff2}")
    c4 = settle(cp, op, quiet=max(2.0, args.debounce * 4), limit=60.0)
    rv1 = node_admission_versions(http)
    moved = {n for n in rv1 if rv0.get(n) != rv1[n]}
    ch = phase(
        f"change {ns}/{name}",
        c3,
        c4,
        change_s,
        own_lists=polls2,
        pages=st.lay.policy_pages,
        note=(
            f"{len(desired2.policies[target].matched)} pods on {len(touched)} nodes; "
            f"NodeAdmissions changed: {len(moved)}"
            + ("" if moved == touched else f" (expected exactly the {len(touched)} nodes)")
        ),
    )
    st.phases.append(ch)
    if ch.writes.node_admissions != len(touched) or ch.writes.statuses != 1:
        st.failures.append(
            f"change wrote {ch.writes.node_admissions} NodeAdmissions and "
            f"{ch.writes.statuses} statuses (expected {len(touched)} and 1)"
        )


def finish(cp: ControlPlane, op: Operator, st: RunState) -> None:
    """Read the operator's totals, stop it, then time and profile a pass in this process."""
    args = st.args
    st.log_after = sum(p.nodes + p.statuses + p.events for p in op.passes())
    st.cpu_total = cpu_seconds(op.pid)
    st.hwm_kib = memory_kib(op.pid, "VmHWM")
    st.rss_kib = memory_kib(op.pid, "VmRSS")
    st.problems = op.problems()
    if not op.alive():
        st.failures.append("the operator exited")
    op.stop()
    st.warm = time_pass(cp, 2) if args.phase_timing else None
    if st.warm is not None and st.warm.planned_writes:
        st.failures.append(f"a pass after the run still plans {st.warm.planned_writes} writes")
    st.prof = profile_pass(cp) if args.profile else ""
    if args.operator_log:
        shutil.copy(op.log, args.operator_log)
