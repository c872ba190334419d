"""``python -m kvgate_bench.bench_operator``: the operator at scale against a real API server.

Starts a local control plane (:class:`kvgate_bench.controlplane.ControlPlane`: kube-apiserver +
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
import contextlib
import copy
import cProfile
import datetime as dt
import http.client
import io
import json
import os
import platform
import pstats
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from kvgate_agent.contract.api import GROUP, VERSION
from kvgate_bench.controlplane import ControlPlane
from kvgate_bench.toolkit import (
    cpu_seconds,
    fetch_text,
    find_k8s_bin,
    free_port,
    memory_kib,
    parse_samples,
    samples_by_labels,
)

REPO = Path(__file__).resolve().parents[2]
WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "APPLY", "DELETE", "DELETECOLLECTION"})
PER_NAMESPACE = 10  # policies per namespace

Key = tuple[str, str]
Specs = dict[str, Any]
Statuses = dict[Key, Any]


# ----------------------------------------------------------------------------------------------
# Binaries and HTTP


def k8s_bin_dir(explicit: str | None) -> Path:
    """kube-apiserver + etcd: ``--bin-dir``, else :func:`~kvgate_bench.toolkit.find_k8s_bin`.

    Raises:
        SystemExit: none found, or a named directory lacks them.
    """
    try:
        found = find_k8s_bin(explicit)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if found is None:
        raise SystemExit("kube-apiserver/etcd not found: run scripts/build-k8s or pass --bin-dir")
    return found


class Http:
    """Keep-alive HTTPS to the API server as the admin user, one connection per thread (the
    Python client's model (de)serialisation would cost more than the API server here)."""

    def __init__(self, cp: ControlPlane) -> None:
        self.host, self.port = cp.host, cp.port
        self.ctx: ssl.SSLContext = cp.ssl_context()
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPSConnection:
        conn: http.client.HTTPSConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=60)
            self._local.conn = conn
        return conn

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        accept: str = "application/json",
    ) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": accept}
        if data is not None:
            headers["Content-Type"] = content_type
        for attempt in (0, 1):
            conn = self._conn()
            try:
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                return resp.status, resp.read()
            except (http.client.HTTPException, OSError):
                conn.close()
                self._local.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def json(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        status, data = self.request(method, path, body, **kw)
        if not 200 <= status < 300:
            raise RuntimeError(f"{method} {path}: HTTP {status}: {data[:500]!r}")
        return json.loads(data)

    def list(self, path: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        cont = ""
        while True:
            sep = "&" if "?" in path else "?"
            body = self.json("GET", f"{path}{sep}limit=500" + (f"&continue={cont}" if cont else ""))
            items.extend(body.get("items") or [])
            cont = (body.get("metadata") or {}).get("continue") or ""
            if not cont:
                return items


# ----------------------------------------------------------------------------------------------
# Metrics and process accounting


def parse_prometheus(text: str, names: Iterable[str]) -> dict[tuple[str, tuple[Any, ...]], float]:
    """The samples of the metrics ``names``: {(name, sorted label pairs): value}."""
    return samples_by_labels(parse_samples(text, names))


@dataclass
class Counters:
    """One reading of the API server's request counters and the processes' CPU.

    ``durations``: ``apiserver_request_duration_seconds`` _sum and _count by (verb, resource,
    subresource). ``operator_loop_cpu``: the operator's main thread (kopf and the asyncio loop,
    where compute and plan run); the rest of its CPU is worker threads (a pass's LISTs and
    writes, ``asyncio.to_thread``)."""

    requests: dict[tuple[str, tuple[Any, ...]], float]
    durations: dict[tuple[str, str, str], tuple[float, float]]
    apiserver_cpu: float
    etcd_cpu: float
    operator_cpu: float
    operator_loop_cpu: float
    when: float


def read_counters(cp: ControlPlane, operator_pid: int | None) -> Counters:
    """``apiserver_request_total`` by labels, API server / etcd / operator CPU seconds."""
    api = parse_prometheus(
        fetch_text(cp.url + "/metrics", 30, cp.ssl_context()),
        (
            "apiserver_request_total",
            "process_cpu_seconds_total",
            "apiserver_request_duration_seconds_sum",
            "apiserver_request_duration_seconds_count",
        ),
    )
    durations: dict[tuple[str, str, str], tuple[float, float]] = {}
    for (name, labels), value in api.items():
        if name.startswith("apiserver_request_duration_seconds_"):
            lb = dict(labels)
            k = (lb.get("verb", ""), lb.get("resource", ""), lb.get("subresource", ""))
            total, count = durations.get(k, (0.0, 0.0))
            if name.endswith("_sum"):
                durations[k] = (total + value, count)
            else:
                durations[k] = (total, count + value)
    etcd = parse_prometheus(
        fetch_text(cp.etcd_url + "/metrics", 30), ("process_cpu_seconds_total",)
    )
    reqs = {k: v for k, v in api.items() if k[0] == "apiserver_request_total"}
    return Counters(
        reqs,
        durations,
        sum(v for k, v in api.items() if k[0] == "process_cpu_seconds_total"),
        sum(etcd.values()),
        cpu_seconds(operator_pid) if operator_pid else 0.0,
        cpu_seconds(operator_pid, operator_pid) if operator_pid else 0.0,
        time.monotonic(),
    )


@dataclass
class Writes:
    """Write requests between two :class:`Counters` readings."""

    node_admissions: int = 0
    statuses: int = 0
    events: int = 0
    errors: int = 0  # operator write requests answered with a non-2xx code
    other: dict[str, int] = field(default_factory=dict)
    lists: dict[str, int] = field(default_factory=dict)  # LIST requests by resource

    @property
    def operator(self) -> int:
        return self.node_admissions + self.statuses + self.events

    def other_text(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(self.other.items())) or "none"


def write_diff(a: Counters, b: Counters) -> Writes:
    """Classify the requests counted between readings ``a`` and ``b``."""
    w = Writes()
    for key, value in b.requests.items():
        n = round(value - a.requests.get(key, 0.0))
        if n <= 0:
            continue
        lb = dict(key[1])
        verb, res, sub = lb.get("verb", ""), lb.get("resource", ""), lb.get("subresource", "")
        if verb == "LIST":
            w.lists[res] = w.lists.get(res, 0) + n
            continue
        if verb not in WRITE_VERBS:
            continue
        group = lb.get("group", "")
        if group == GROUP and res == "nodeadmissions" and sub != "status":
            w.node_admissions += n
        elif group == GROUP and res == "ratelimitpolicies" and sub == "status":
            w.statuses += n
        elif group == "" and res == "events":
            w.events += n
        else:
            name = f"{verb} {res}{'/' + sub if sub else ''}"
            w.other[name] = w.other.get(name, 0) + n
            continue
        if not lb.get("code", "200").startswith("2"):
            w.errors += n
    return w


def latencies(a: Counters, b: Counters) -> list[tuple[str, int, float]]:
    """(verb resource[/subresource], requests, mean server-side seconds) of the write requests
    and LISTs of the operator's kinds between two readings, most total time first."""
    out = []
    for k, (total, count) in b.durations.items():
        verb, res, sub = k
        if verb not in WRITE_VERBS | {"LIST"} or res not in {
            "nodeadmissions",
            "ratelimitpolicies",
            "events",
            "pods",
            "nodes",
        }:
            continue
        t0, c0 = a.durations.get(k, (0.0, 0.0))
        n = round(count - c0)
        if n > 0:
            out.append((f"{verb} {res}{'/' + sub if sub else ''}", n, (total - t0) / n))
    return sorted(out, key=lambda x: -x[1] * x[2])


# ----------------------------------------------------------------------------------------------
# The cluster's objects


@dataclass(frozen=True)
class Layout:
    """What the benchmark creates."""

    nodes: int
    pods: int
    policies: int

    @property
    def namespaces(self) -> int:
        return max(1, -(-self.policies // PER_NAMESPACE))

    @property
    def policy_pages(self) -> int:
        """Pages of one LIST of the policies (the operator asks for 500 at a time)."""
        return -(-self.policies // 500)


def node_name(i: int) -> str:
    return f"bench-node-{i:04d}"


def ns_name(i: int) -> str:
    return f"bench-t{i:03d}"


def policy_spec(g: int, selector: dict[str, Any]) -> dict[str, Any]:
    """A realistic policy (the README example's shape). Even ``g``: a ``per: Global`` budget
    (requests and tokens, split across the matched pods) plus a per-tenant limit; odd ``g``:
    per-tenant limits only."""
    limits: list[dict[str, Any]] = [
        {
            "name": "per-tenant",
            "per": "Tenant",
            "requestsPerMinute": 600 + g,
            "tokensPerMinute": 60000,
            "burstTokens": 8192,
        }
    ]
    if g % 2 == 0:
        limits.insert(
            0,
            {
                "name": "global",
                "per": "Global",
                "requestsPerMinute": 6000,
                "tokensPerMinute": 6_000_000,
                "burstRequests": 1000,
                "burstTokens": 500_000,
            },
        )
    return {
        "selector": selector,
        "model": {
            "numLayers": 32,
            "numKVHeads": 8,
            "headDim": 128,
            "kvCacheDtype": "bf16",
            "blockSize": 16,
            "maxModelLen": 8192,
        },
        "capacity": {"kvCacheTokens": 16384 * (1 + g % 4)},
        "concurrency": {"maxRequests": 16 + g % 48},
        "tenants": {"defaultMaxTokens": 512, "maxTokensCap": 2048},
        "rateLimits": limits,
        "cost": {"perRequest": 16, "promptTokenWeight": 1, "outputTokenWeight": 1},
        "queue": {"maxLength": 64, "maxWaitSeconds": 10, "order": "ShortestFirst"},
        "overload": {"actions": ["Degrade", "Queue", "Reject"], "degrade": {"minMaxTokens": 128}},
    }


def build_objects(
    lay: Layout,
) -> tuple[list[tuple[str, dict[str, Any]]], list[tuple[str, dict[str, Any]]]]:
    """(POST path, body) for nodes, namespaces and pods; then for policies.

    Policy ``g`` (slot ``j`` in namespace ``g // 10``) selects ``app: a<j>``; its pods carry that
    label and ``shard: s0|s1``, spread round-robin over the nodes. In every fourth namespace the
    last slot instead selects ``shard: s0`` with ``app In [a<j>, a00]``: it overlaps slot 0's
    pods (conflicts; the older policy, else the first by name, governs them).
    """
    base: list[tuple[str, dict[str, Any]]] = []
    for i in range(lay.nodes):
        base.append(("/api/v1/nodes", {"metadata": {"name": node_name(i)}}))
    for i in range(lay.namespaces):
        base.append(("/api/v1/namespaces", {"metadata": {"name": ns_name(i)}}))
    policies: list[tuple[str, dict[str, Any]]] = []
    per_policy, extra = divmod(lay.pods, lay.policies)
    pod_index = 0
    for g in range(lay.policies):
        ns, j = ns_name(g // PER_NAMESPACE), g % PER_NAMESPACE
        app = f"a{j:02d}"
        overlap = (g // PER_NAMESPACE) % 4 == 0 and j == PER_NAMESPACE - 1
        selector: dict[str, Any] = (
            {
                "matchLabels": {"shard": "s0"},
                "matchExpressions": [{"key": "app", "operator": "In", "values": [app, "a00"]}],
            }
            if overlap
            else {"matchLabels": {"app": app}}
        )
        policies.append(
            (
                f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/ratelimitpolicies",
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": "RateLimitPolicy",
                    "metadata": {"name": f"pol-{j:02d}", "namespace": ns},
                    "spec": policy_spec(g, selector),
                },
            )
        )
        for k in range(per_policy + (1 if g < extra else 0)):
            base.append(
                (
                    f"/api/v1/namespaces/{ns}/pods",
                    {
                        "metadata": {
                            "name": f"p{j:02d}-{k:03d}",
                            "namespace": ns,
                            "labels": {"app": app, "shard": f"s{k % 2}"},
                        },
                        "spec": {
                            "nodeName": node_name(pod_index % lay.nodes),
                            "containers": [{"name": "vllm", "image": "vllm/vllm-openai"}],
                        },
                    },
                )
            )
            pod_index += 1
    return base, policies


def create_all(http: Http, items: Sequence[tuple[str, dict[str, Any]]], workers: int) -> None:
    """POST every item, ``workers`` at a time (namespaces and nodes come first in ``items`` and
    are created before the pods that need them)."""
    first = [it for it in items if not it[0].endswith("/pods")]
    rest = [it for it in items if it[0].endswith("/pods")]

    def post(item: tuple[str, dict[str, Any]]) -> None:
        status, data = http.request("POST", item[0], item[1])
        if status != 201:
            raise RuntimeError(f"POST {item[0]}: HTTP {status}: {data[:300]!r}")

    with ThreadPoolExecutor(workers) as pool:
        for batch in (first, rest):
            list(pool.map(post, batch))


# ----------------------------------------------------------------------------------------------
# Desired vs observed


def strip_status(st: Mapping[str, Any] | None) -> dict[str, Any]:
    """A policy status without condition timestamps (as the operator compares them)."""
    out = dict(st or {})
    out["conditions"] = [
        {k: v for k, v in c.items() if k != "lastTransitionTime"}
        for c in out.get("conditions") or []
    ]
    out.setdefault("conflicts", [])
    return out


def policy_statuses(http: Http) -> Statuses:
    """Every policy's status without condition times."""
    return {
        (p["metadata"]["namespace"], p["metadata"]["name"]): strip_status(p.get("status"))
        for p in http.list(f"/apis/{GROUP}/{VERSION}/ratelimitpolicies")
    }


def node_specs(http: Http) -> Specs:
    """Every NodeAdmission's spec by name."""
    return {
        n["metadata"]["name"]: n.get("spec")
        for n in http.list(f"/apis/{GROUP}/{VERSION}/nodeadmissions")
    }


def node_admission_versions(http: Http) -> dict[str, str]:
    return {
        n["metadata"]["name"]: n["metadata"]["resourceVersion"]
        for n in http.list(f"/apis/{GROUP}/{VERSION}/nodeadmissions")
    }


def differences(want: tuple[Specs, Statuses], got: tuple[Specs, Statuses]) -> str:
    specs = {n for n in want[0].keys() | got[0].keys() if want[0].get(n) != got[0].get(n)}
    stats = {k for k in want[1].keys() | got[1].keys() if want[1].get(k) != got[1].get(k)}
    return (
        f"{len(specs)} NodeAdmission spec(s) differ (e.g. {sorted(specs)[:3]}), "
        f"{len(stats)} policy status(es) differ (e.g. {sorted(stats)[:3]})"
    )


def wait_converged(
    http: Http, want: tuple[Specs, Statuses], timeout: float, poll: float
) -> tuple[float | None, int, str]:
    """Poll until the cluster equals ``want``. Returns (monotonic time of the first equal
    reading, or None on timeout; policy LISTs made; what differed last).

    To load the API server less, each poll LISTs the policies first and the NodeAdmissions
    (~25 KB each at 20 pods per node) only once every status is right: a pass writes the specs
    before the statuses."""
    deadline = time.monotonic() + timeout
    polls = 0
    got: tuple[Specs, Statuses] = ({}, {})
    while time.monotonic() < deadline:
        t = time.monotonic()
        got = (got[0], policy_statuses(http))
        polls += 1
        if got[1] == want[1]:
            got = (node_specs(http), got[1])
            if got[0] == want[0]:
                return time.monotonic(), polls, ""
        time.sleep(max(0.0, poll - (time.monotonic() - t)))
    if not got[0]:
        got = (node_specs(http), got[1])
    return None, polls, differences(want, got)


# ----------------------------------------------------------------------------------------------
# The operator


_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_RECONCILED = re.compile(
    r"reconciled: (\d+) NodeAdmission writes, (\d+) policy status writes, (\d+) events in "
    r"([\d.]+)s"
)


@dataclass
class LogPass:
    """A pass that wrote something, from the operator's log."""

    when: float  # epoch seconds (the log line's time: the pass's end)
    nodes: int
    statuses: int
    events: int
    seconds: float


class Operator:
    """``python -m kvgate_operator`` as a child process (as tests/integration/test_operator.py
    runs it)."""

    def __init__(self, cp: ControlPlane, log: Path, debounce: float, resync: float) -> None:
        self.cp, self.log = cp, log
        self.env = {
            **cp.env,
            "KVGATE_OPERATOR_LIVENESS_PORT": str(free_port()),
            "KVGATE_OPERATOR_DEBOUNCE_SECONDS": str(debounce),
            "KVGATE_OPERATOR_RESYNC_SECONDS": str(resync),
            "KVGATE_OPERATOR_WEBHOOK_ENABLED": "false",
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_epoch = 0.0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        with self.log.open("ab") as fh:
            self.started_epoch = time.time()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvgate_operator"],
                env=self.env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def passes(self) -> list[LogPass]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            m, t = _RECONCILED.search(line), _LOG_TIME.match(line)
            if m and t:
                when = dt.datetime.strptime(t.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                nodes, statuses, events = (int(m.group(i)) for i in (1, 2, 3))
                out.append(LogPass(when, nodes, statuses, events, float(m.group(4))))
        return out

    def problems(self) -> list[str]:
        return [
            line
            for line in self.log.read_text(errors="replace").splitlines()
            if " WARNING " in line or " ERROR " in line or "Traceback" in line
        ]


# ----------------------------------------------------------------------------------------------
# In-process pass (phase timing and profile)


@dataclass
class PassTiming:
    read: float
    compute: float
    plan: float
    planned_writes: int


def time_pass(cp: ControlPlane, repeat: int) -> PassTiming:
    """Read, compute and plan as the operator's pass does (no writes), best of ``repeat``."""
    from kvgate_operator.desired import compute
    from kvgate_operator.plan import plan
    from kvgate_operator.reconciler import Reconciler, _now
    from kvgate_operator.settings import OperatorSettings

    best: PassTiming | None = None
    with cp.api_client() as api:
        rec = Reconciler(api, OperatorSettings())
        for _ in range(repeat):
            t0 = time.perf_counter()
            observed = rec.read()
            t1 = time.perf_counter()
            desired = compute(observed.snapshot)
            t2 = time.perf_counter()
            todo = plan(desired, observed.node_specs, observed.policy_status, _now())
            t3 = time.perf_counter()
            pt = PassTiming(t1 - t0, t2 - t1, t3 - t2, len(todo))
            if (
                best is None
                or pt.read + pt.compute + pt.plan < best.read + best.compute + best.plan
            ):
                best = pt
    assert best is not None
    return best


def profile_pass(cp: ControlPlane, top: int = 18) -> str:
    """cProfile of one read + compute + plan, by own time."""
    from kvgate_operator.desired import compute
    from kvgate_operator.plan import plan
    from kvgate_operator.reconciler import Reconciler, _now
    from kvgate_operator.settings import OperatorSettings

    with cp.api_client() as api:
        rec = Reconciler(api, OperatorSettings())
        prof = cProfile.Profile()
        prof.enable()
        observed = rec.read()
        desired = compute(observed.snapshot)
        plan(desired, observed.node_specs, observed.policy_status, _now())
        prof.disable()
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def expected_state(
    cp: ControlPlane, change: Callable[[Any], Any] | None = None
) -> tuple[tuple[Specs, Statuses], Any]:
    """From scratch: read the cluster, optionally edit the snapshot, compute. Returns
    ((node specs, statuses), the Desired)."""
    from kvgate_operator.desired import compute
    from kvgate_operator.reconciler import Reconciler
    from kvgate_operator.settings import OperatorSettings

    with cp.api_client() as api:
        snap = Reconciler(api, OperatorSettings()).read().snapshot
    if change is not None:
        snap = change(snap)
    desired = compute(snap)
    statuses = {k: strip_status(v.status()) for k, v in desired.policies.items()}
    return (desired.node_specs, statuses), (desired, snap)


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


def machine() -> list[tuple[str, str]]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = int(Path("/proc/meminfo").read_text().split()[1]) // 1024 // 1024
    return [
        ("CPU", f"{cpu}, {os.cpu_count()} vCPUs"),
        ("memory", f"{mem} GiB"),
        ("kernel", platform.release()),
        ("Python", platform.python_version()),
    ]


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
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--pods", type=int, default=2000)
    p.add_argument("--policies", type=int, default=200)
    p.add_argument("--bin-dir", help="directory with kube-apiserver and etcd")
    p.add_argument("--debounce", type=float, default=0.1, help="operator debounce (s)")
    p.add_argument("--resync", type=float, default=5.0, help="operator resync period (s)")
    p.add_argument("--noop-periods", type=int, default=3, help="resync periods watched idle")
    p.add_argument("--timeout", type=float, default=180.0, help="convergence timeout (s)")
    p.add_argument("--poll", type=float, default=0.5, help="convergence poll interval (s)")
    p.add_argument("--workers", type=int, default=8, help="client threads creating objects")
    p.add_argument(
        "--heartbeat-rate",
        type=float,
        default=10.0,
        help="NodeAdmission status patches per second in the heartbeat phase",
    )
    p.add_argument(
        "--heartbeat-seconds", type=float, default=15.0, help="heartbeat phase length (0: skip)"
    )
    p.add_argument(
        "--no-phase-timing",
        dest="phase_timing",
        action="store_false",
        help="skip timing read/compute/plan in this process",
    )
    p.add_argument("--profile", action="store_true", help="cProfile one pass at the end")
    p.add_argument("--operator-log", help="keep the operator's log here")
    p.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = p.parse_args(argv)
    if min(args.nodes, args.pods, args.policies) < 1:
        p.error("--nodes, --pods and --policies must be positive")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
