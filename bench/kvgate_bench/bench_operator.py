"""``python -m kvgate_bench.bench_operator``: the operator at scale against a real API server.

Starts a local control plane (:class:`kvgate_bench.kit.controlplane.ControlPlane`: kube-apiserver +
etcd, no kubelet), applies the CRDs and creates ``--nodes`` Node objects, namespaces,
``--policies`` RateLimitPolicies and ``--pods`` Pods bound to the nodes (``spec.nodeName``).
Policies select ~``pods/policies`` pods each; half carry a ``per: Global`` limit (split across
their pods), half only ``per: Tenant`` limits; in every fourth namespace one policy overlaps an
older one (conflicts, Warning events). Then it starts ``python -m kvgate_operator`` as a child
process and measures:

1. **initial convergence**: from the operator's start until every NodeAdmission spec and every
   policy status equals the from-scratch computation (:func:`kvgate_operator.desired.compute` on
   a fresh read, done by the benchmark before the operator starts; the cluster's inputs do not
   change meanwhile), polled every ``--poll`` seconds;
2. **no-op resyncs**: the writes made during ``--noop-periods`` resync periods of a converged,
   unchanged cluster (target: 0) and how many passes ran;
3. **one policy changed** (a ``per: Global`` rate doubled): time to converge again and the writes
   (target: one NodeAdmission write per node that runs a pod of that policy, one status write,
   no event), and which NodeAdmissions actually changed (resourceVersion);
4. **agent heartbeats**: ``--heartbeat-rate`` status patches per second on the NodeAdmissions
   (what node agents reporting a heartbeat would do) for ``--heartbeat-seconds``: the status is
   no input of the desired state, so the target is no write; the passes and the CPU they cost
   are what this phase shows.

Every pass LISTs the policies once, so the pass count of a phase is the API server's count of
policy LISTs, less the benchmark's own polls (and kopf's initial LIST).

Plus the operator process's CPU time (``/proc/<pid>/stat`` utime + stime) and peak RSS
(``VmHWM``), the API server's and etcd's CPU (their ``process_cpu_seconds_total``) and, with the
operator stopped, one pass run in this process phase by phase (read / compute / plan).

**How writes are counted**: the API server's own counter ``apiserver_request_total`` (from
``/metrics``), diffed around each phase, over the write verbs (POST, PUT, PATCH, APPLY, DELETE,
DELETECOLLECTION). Every request counts, including one that changes nothing or fails (a
resourceVersion diff would miss both). The operator is the only client writing NodeAdmissions,
policy *status* and Events while a phase runs (the benchmark's own change is a PATCH of the
policy's main resource), so those series are the operator's writes; all other writes are shown
separately (the API server's own leases). The operator's log lines ``reconciled: ...`` are
summed as a cross-check.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from kvgate_agent.contract.api import GROUP, VERSION
from kvgate_bench.bench_operator_cluster import (
    REPO,
    Counters,
    Http,
    Key,
    Layout,
    PassTiming,
    Specs,
    Statuses,
    Writes,
    build_objects,
    create_all,
    expected_state,
    k8s_bin_dir,
    latencies,
    node_admission_versions,
    node_name,
    profile_pass,
    read_counters,
    time_pass,
    wait_converged,
    write_diff,
)
from kvgate_bench.kit.controlplane import ControlPlane
from kvgate_bench.kit.operator_process import Operator
from kvgate_bench.kit.toolkit import cpu_seconds, machine, memory_kib

# ----------------------------------------------------------------------------------------------
# The run


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


def run(args: argparse.Namespace) -> int:
    st = RunState(Layout(args.nodes, args.pods, args.policies), args)
    lay = st.lay
    bin_dir = k8s_bin_dir(args.bin_dir)
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-bench-operator-"))
    t_all = time.monotonic()
    print(
        f"kvgate operator benchmark: {lay.nodes} nodes, {lay.pods} pods, {lay.policies} policies "
        f"in {lay.namespaces} namespaces; debounce {args.debounce:g} s, resync {args.resync:g} s",
        flush=True,
    )
    with ControlPlane(bin_dir) as cp:
        st.version = cp.get_json("/version").get("gitVersion", "?")
        print(
            f"control plane {st.version} up in {cp.startup_seconds:.1f} s ({bin_dir})", flush=True
        )
        cp.apply_crds(REPO / "crds")
        http = Http(cp)
        _create_objects(http, st)
        # From scratch, before the operator runs (the inputs stay fixed until the change).
        t0 = time.monotonic()
        want, (desired, snap) = expected_state(cp)
        print(f"from-scratch desired state computed in {time.monotonic() - t0:.2f} s", flush=True)
        st.cold = time_pass(cp, 2) if args.phase_timing else None
        op = Operator(cp, workdir / "operator.log", args.debounce, args.resync)
        c1 = _initial_convergence(cp, http, op, want, st)
        _noop_resyncs(cp, op, c1, st)
        _change_one_policy(cp, http, op, desired, snap, st)
        if args.heartbeat_seconds > 0:
            hb = heartbeats(cp, http, op, lay, args.heartbeat_rate, args.heartbeat_seconds)
            st.phases.append(hb)
            if hb.writes.operator:
                st.failures.append(f"heartbeats made the operator write {hb.writes.operator} times")
        _finish(cp, op, st)
    shutil.rmtree(workdir, ignore_errors=True)
    _report_table(st)
    _report_notes(st, t_all)
    for f in st.failures:
        print(f"TARGET MISSED: {f}")
    return 1 if st.failures and args.check else 0


def _create_objects(http: Http, st: RunState) -> None:
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


def _initial_convergence(
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


def _noop_resyncs(cp: ControlPlane, op: Operator, c1: Counters, st: RunState) -> None:
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


def _change_one_policy(
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


def _finish(cp: ControlPlane, op: Operator, st: RunState) -> None:
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


def _report_table(st: RunState) -> None:
    """The phases as a Markdown table."""
    lay, args = st.lay, st.args
    print()
    print(
        f"### {lay.nodes} nodes, {lay.pods} pods, {lay.policies} policies "
        f"(debounce {args.debounce:g} s, resync {args.resync:g} s)"
    )
    print()
    print(
        "| phase | time to converge | NodeAdmission writes | status writes | events "
        "| passes | operator CPU (loop thread) | API server CPU | etcd CPU | notes |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for p in st.phases:
        w = p.writes
        err = f", {w.errors} failed" if w.errors else ""
        conv = fmt_s(p.seconds) if p.name.startswith(("initial", "change")) else "-"
        print(
            f"| {p.name} | {conv} | {w.node_admissions} | {w.statuses} | {w.events}{err} "
            f"| {p.passes} | {p.operator_cpu:.2f} s ({p.operator_loop_cpu:.2f} s) "
            f"| {p.apiserver_cpu:.2f} s | {p.etcd_cpu:.2f} s | {p.note} |"
        )
    print()


def _report_notes(st: RunState, t_all: float) -> None:
    """The totals, pass timings, latencies, machine and profile under the table."""
    phases, cold, warm = st.phases, st.cold, st.warm
    noop = phases[1]
    per_pass = noop.operator_cpu / noop.passes if noop.passes else float("nan")
    print(
        f"- operator process: {st.cpu_total:.2f} s CPU in total, "
        f"peak RSS (VmHWM) {st.hwm_kib / 1024:.0f} MiB "
        f"(RSS at the end {st.rss_kib / 1024:.0f} MiB); {per_pass:.2f} s CPU per no-op pass "
        f"({noop.passes} passes in {noop.wall:.1f} s)"
    )
    print(
        f"- writes counted by the API server (apiserver_request_total) vs the operator's log: "
        f"{sum(p.writes.operator for p in phases)} vs {st.log_after} "
        f"({st.log_before} by the end of the initial convergence)"
    )
    print(
        "- other writes during the phases (not the operator's): "
        + "; ".join(f"{p.name}: {p.writes.other_text()}" for p in phases)
    )
    if cold is not None and warm is not None:
        print(
            "- one pass in this process, operator stopped (best of 2): "
            f"before the run (no NodeAdmissions yet) read {cold.read:.2f} s, compute "
            f"{cold.compute:.2f} s, plan {cold.plan:.3f} s; converged cluster read "
            f"{warm.read:.2f} s, compute {warm.compute:.2f} s, plan {warm.plan:.3f} s, "
            f"{warm.planned_writes} writes planned"
        )
    for p in phases:
        lat = ", ".join(f"{k} {n} × {m * 1000:.1f} ms" for k, n, m in p.latency[:6])
        print(f"- server-side latency, {p.name}: {lat or 'none'}")
    print(f"- setup: {st.created} objects created in {st.create_s:.1f} s")
    print(f"- whole run {time.monotonic() - t_all:.0f} s")
    if st.problems:
        print(f"- operator log: {len(st.problems)} warning/error line(s), first: {st.problems[:3]}")
    print()
    for k, v in machine():
        print(f"{k}: {v}")
    print(f"Kubernetes: {st.version}")
    if st.prof:
        print()
        print("cProfile of one read + compute + plan (converged cluster):")
        print(st.prof)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(
        prog="python -m kvgate_bench.bench_operator",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("--nodes", type=int, default=100)
    add("--pods", type=int, default=2000)
    add("--policies", type=int, default=200)
    add("--bin-dir", help="directory with kube-apiserver and etcd")
    add("--debounce", type=float, default=0.1, help="operator debounce (s)")
    add("--resync", type=float, default=5.0, help="operator resync period (s)")
    add("--noop-periods", type=int, default=3, help="resync periods watched idle")
    add("--timeout", type=float, default=180.0, help="convergence timeout (s)")
    add("--poll", type=float, default=0.5, help="convergence poll interval (s)")
    add("--workers", type=int, default=8, help="client threads creating objects")
    add(
        "--heartbeat-rate",
        type=float,
        default=10.0,
        help="NodeAdmission status patches per second in the heartbeat phase",
    )
    add("--heartbeat-seconds", type=float, default=15.0, help="heartbeat phase length (0: skip)")
    add(
        "--no-phase-timing",
        dest="phase_timing",
        action="store_false",
        help="skip timing read/compute/plan in this process",
    )
    add("--profile", action="store_true", help="cProfile one pass at the end")
    add("--operator-log", help="keep the operator's log here")
    add("--check", action="store_true", help="exit 1 if a target is missed")
    args = p.parse_args(argv)
    if min(args.nodes, args.pods, args.policies) < 1:
        p.error("--nodes, --pods and --policies must be positive")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
