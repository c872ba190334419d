"""The operator benchmark's printed report: the phases' table (seconds, writes, CPU seconds, API
latencies) and the notes under it.
"""

from __future__ import annotations

import time

from kvgate_bench.bench_operator.phases import RunState, fmt_s
from kvgate_bench.kit.toolkit import machine


def report_table(st: RunState) -> None:
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


def report_notes(st: RunState, t_all: float) -> None:
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
