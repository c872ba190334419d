"""``python -m kvgate_bench.bench_operator``'s options (:func:`main`) and one run, phase by phase
(:func:`run`); see :mod:`kvgate_bench.bench_operator`.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from kvgate_bench import bench_operator
from kvgate_bench.bench_operator.api import (
    Http,
    k8s_bin_dir,
)
from kvgate_bench.bench_operator.cluster import (
    REPO,
    Layout,
    expected_state,
)
from kvgate_bench.bench_operator.inprocess import time_pass
from kvgate_bench.bench_operator.phases import (
    RunState,
    change_one_policy,
    create_objects,
    finish,
    heartbeats,
    initial_convergence,
    noop_resyncs,
)
from kvgate_bench.bench_operator.report import report_notes, report_table
from kvgate_bench.kit.controlplane import ControlPlane
from kvgate_bench.kit.operator_process import Operator


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
        create_objects(http, st)
        # From scratch, before the operator runs (the inputs stay fixed until the change).
        t0 = time.monotonic()
        want, (desired, snap) = expected_state(cp)
        print(f"from-scratch desired state computed in {time.monotonic() - t0:.2f} s", flush=True)
        st.cold = time_pass(cp, 2) if args.phase_timing else None
        op = Operator(cp, workdir / "operator.log", args.debounce, args.resync)
        c1 = initial_convergence(cp, http, op, want, st)
        noop_resyncs(cp, op, c1, st)
        change_one_policy(cp, http, op, desired, snap, st)
        if args.heartbeat_seconds > 0:
            hb = heartbeats(cp, http, op, lay, args.heartbeat_rate, args.heartbeat_seconds)
            st.phases.append(hb)
            if hb.writes.operator:
                st.failures.append(f"heartbeats made the operator write {hb.writes.operator} times")
        finish(cp, op, st)
    shutil.rmtree(workdir, ignore_errors=True)
    report_table(st)
    report_notes(st, t_all)
    for f in st.failures:
        print(f"TARGET MISSED: {f}")
    return 1 if st.failures and args.check else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(
        prog="python -m kvgate_bench.bench_operator",
        description=bench_operator.__doc__,
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
