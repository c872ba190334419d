"""``python -m kvgate_bench.bench_node``: policy propagation and the node agent's cost.

On the local control plane (kube-apiserver + etcd, no kubelet) it runs, as local processes, the
operator, one node agent (fake GPU backend) and ``kvgate-sim`` behind real sidecars in agent mode
(:class:`kvgate_bench.nodestack.NodeStack`), with production timings: sidecars sync every
``--sync-interval`` seconds (1), the operator debounces 0.05 s.

1. **Propagation** (``--changes`` changes, 50): ``kubectl apply`` of a RateLimitPolicy whose
   ``tenants.maxTokensCap`` alternates between two values, then a probe request to each of two
   sidecars every ``--probe-interval`` seconds until both clamp ``max_tokens`` to the new cap
   (the ``x-kvgate-degraded: max_tokens=N`` header): the time from just before ``kubectl
   apply`` starts to the first probe that sees the new cap on a sidecar, per sidecar. The path
   is kubectl → API server → operator (watch, pass, NodeAdmission write) → agent (watch) →
   sidecar (next sync) → enforcement. ``kubectl apply`` alone (a no-op re-apply, same process
   start and round trip) is timed as the baseline.
2. **Agent cost with N sidecars** (``--sidecars``, 50): the agent's CPU (``/proc/<pid>/stat``
   utime + stime) and RSS over ``--window`` seconds, first with the 2 sidecars of phase 1
   (baseline), then with N syncing; plus sync handling time (the agent's own histogram) and
   the TokenReviews it sent (cached for 60 s, so about N per minute).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvgate_agent.contract.api import API_VERSION
from kvgate_bench.controlplane import ControlPlane
from kvgate_bench.nodestack import NodeStack, clamped_to, metric_value
from kvgate_bench.toolkit import cpu_seconds, find_k8s_bin, memory_kib, percentile, wait_until

NS = "bench"


def cap_policy(cap: int) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "RateLimitPolicy",
        "metadata": {"name": "cap", "namespace": NS},
        "spec": {
            "selector": {"matchLabels": {"app": "llm"}},
            "tenants": {"maxTokensCap": cap, "defaultMaxTokens": cap},
            "model": {"maxModelLen": 4096},
        },
    }


def rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of process ``pid`` in MiB."""
    return memory_kib(pid, "VmRSS") / 1024, memory_kib(pid, "VmHWM") / 1024


def pct(values: list[float], q: float) -> float:
    """:func:`~kvgate_bench.toolkit.percentile` of a list known not to be empty."""
    got = percentile(values, q)
    assert got is not None
    return got


def agent_metric(stack: NodeStack, name: str, **labels: str) -> float:
    return metric_value(stack.agent_url + "/metrics", name, **labels) or 0.0


def propagation(stack: NodeStack, changes: int, probe_interval: float) -> dict[str, Any]:
    urls = [p.url for p in stack.pods[:2]]
    caps = (8, 9)
    stack.apply(cap_policy(caps[1]))
    wait_until(lambda: all(clamped_to(u) == caps[1] for u in urls), 60, "the first policy")
    per_change: list[float] = []
    per_sidecar: list[float] = []
    apply_only: list[float] = []
    for i in range(changes):
        cap = caps[i % 2]
        t0 = time.perf_counter()
        stack.apply(cap_policy(cap))
        applied = time.perf_counter() - t0
        seen: dict[str, float] = {}
        deadline = time.monotonic() + 60
        while len(seen) < len(urls):
            for u in urls:
                if u not in seen and clamped_to(u) == cap:
                    seen[u] = time.perf_counter() - t0
            if time.monotonic() > deadline:
                raise TimeoutError(f"change {i} (cap {cap}) did not reach every sidecar")
            time.sleep(probe_interval)
        per_sidecar.extend(seen.values())
        per_change.append(max(seen.values()))
        # Baseline: the same kubectl apply, changing nothing.
        t1 = time.perf_counter()
        stack.apply(cap_policy(cap))
        apply_only.append(time.perf_counter() - t1)
        del applied
    return {
        "changes": changes,
        "p50_all": pct(per_change, 50),
        "p99_all": pct(per_change, 99),
        "max_all": max(per_change),
        "p50_sidecar": pct(per_sidecar, 50),
        "p99_sidecar": pct(per_sidecar, 99),
        "kubectl_p50": pct(apply_only, 50),
        "kubectl_p99": pct(apply_only, 99),
    }


def agent_window(stack: NodeStack, window: float) -> dict[str, float]:
    assert stack.agent is not None
    pid = stack.agent.pid
    syncs0 = sum(
        agent_metric(stack, "kvgate_node_sync_requests_total", result=r)
        for r in ("ok", "not_modified")
    )
    count0 = agent_metric(stack, "kvgate_node_sync_duration_seconds_count")
    sum0 = agent_metric(stack, "kvgate_node_sync_duration_seconds_sum")
    reviews0 = agent_metric(stack, "kvgate_node_token_reviews_total", result="sent")
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(window)
    c1, t1 = cpu_seconds(pid), time.monotonic()
    syncs1 = sum(
        agent_metric(stack, "kvgate_node_sync_requests_total", result=r)
        for r in ("ok", "not_modified")
    )
    count1 = agent_metric(stack, "kvgate_node_sync_duration_seconds_count")
    sum1 = agent_metric(stack, "kvgate_node_sync_duration_seconds_sum")
    rss, hwm = rss_mib(pid)
    return {
        "cpu_pct": 100 * (c1 - c0) / (t1 - t0),
        "rss_mib": rss,
        "hwm_mib": hwm,
        "syncs_per_s": (syncs1 - syncs0) / (t1 - t0),
        "sync_mean_ms": 1000 * (sum1 - sum0) / max(1.0, count1 - count0),
        "token_reviews": agent_metric(stack, "kvgate_node_token_reviews_total", result="sent")
        - reviews0,
        "connected": agent_metric(stack, "kvgate_node_sidecars_connected"),
    }


def report_propagation(stack: NodeStack, args: argparse.Namespace) -> None:
    """Phase 1: policy propagation to the first two sidecars."""
    print(f"\n1. propagation, {args.changes} changes, 2 sidecars, sync every {args.sync_interval}s")
    prop = propagation(stack, args.changes, args.probe_interval)
    print(
        f"   kubectl apply -> enforced on both sidecars: p50 {prop['p50_all']:.3f}s  "
        f"p99 {prop['p99_all']:.3f}s  max {prop['max_all']:.3f}s"
    )
    print(
        f"   per sidecar:                                p50 {prop['p50_sidecar']:.3f}s  "
        f"p99 {prop['p99_sidecar']:.3f}s"
    )
    print(
        f"   baseline, kubectl apply alone (no-op):      p50 {prop['kubectl_p50']:.3f}s  "
        f"p99 {prop['kubectl_p99']:.3f}s"
    )
    ratio = prop["p50_all"] / prop["kubectl_p50"]
    print(f"   ratio p50 propagation / kubectl alone: {ratio:.1f}x")


def report_agent_cost(stack: NodeStack, sim: str, args: argparse.Namespace) -> None:
    """Phase 2: the agent's CPU and memory with 2, then ``--sidecars`` sidecars syncing."""
    print(f"\n2. agent cost, {args.window:.0f}s windows")
    base = agent_window(stack, args.window)
    extra = args.sidecars - 2
    t0 = time.monotonic()
    pods = [stack.add_model_pod(f"llm-{i:02d}", sim, start=False) for i in range(2, 2 + extra)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(stack.start_sidecar, pods))
    wait_until(
        lambda: agent_metric(stack, "kvgate_node_sidecars_connected") >= args.sidecars,
        120,
        f"{args.sidecars} sidecars connected",
    )
    print(f"   started {extra} more sidecars in {time.monotonic() - t0:.0f}s")
    time.sleep(args.sync_interval * 3)
    loaded = agent_window(stack, args.window)
    for label, r in (("2 sidecars", base), (f"{args.sidecars} sidecars", loaded)):
        print(
            f"   {label:>12}: CPU {r['cpu_pct']:5.2f}%  RSS {r['rss_mib']:6.1f} MiB "
            f"(peak {r['hwm_mib']:.1f})  syncs {r['syncs_per_s']:5.1f}/s  "
            f"mean sync {r['sync_mean_ms']:.2f} ms  TokenReviews {r['token_reviews']:.0f}  "
            f"connected {r['connected']:.0f}"
        )
    per = (loaded["cpu_pct"] - base["cpu_pct"]) / extra
    ratio = loaded["cpu_pct"] / max(base["cpu_pct"], 1e-9)
    grown = loaded["rss_mib"] - base["rss_mib"]
    print(
        f"   ratio CPU {args.sidecars}/2: {ratio:.1f}x; {per:.3f}% of one CPU per extra "
        f"sidecar; RSS +{grown:.1f} MiB"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--changes", type=int, default=50)
    ap.add_argument("--sidecars", type=int, default=50)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--sync-interval", type=float, default=1.0)
    ap.add_argument("--probe-interval", type=float, default=0.02)
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = ap.parse_args(argv)
    try:
        bin_dir = find_k8s_bin()
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    if bin_dir is None:
        print("kube-apiserver/etcd not built: run scripts/build-k8s", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="kvgate-bench-node-"))
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"work dir {work}"
    )
    with ControlPlane(bin_dir) as cp:
        stack = NodeStack(cp, work, NS, node_name="bench-node", sync_interval=args.sync_interval)
        try:
            stack.setup_cluster()
            stack.start_operator()
            stack.start_agent()
            sim = stack.start_sim(**{"decode-ms": 1})
            for i in range(2):
                stack.add_model_pod(f"llm-{i:02d}", sim)
            report_propagation(stack, args)
            report_agent_cost(stack, sim, args)
        finally:
            stack.stop()
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
