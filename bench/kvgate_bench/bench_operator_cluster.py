"""The synthetic cluster for ``bench_operator``: the API client, the API server's and the operator's
counters, the objects (nodes, pods, namespaces, policies) the benchmark creates, the check of the
cluster against the from-scratch desired state, and one pass run in this process, timed and
profiled."""

from __future__ import annotations

import cProfile
import http.client
import io
import json
import pstats
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate_agent.contract.api import GROUP, VERSION
from kvgate_bench.kit.controlplane import ControlPlane
from kvgate_bench.kit.kubeaccess import strip_status
from kvgate_bench.kit.toolkit import (
    cpu_seconds,
    fetch_text,
    find_k8s_bin,
    parse_samples,
    sample_sum,
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
    """kube-apiserver + etcd: ``--bin-dir``, else :func:`~kvgate_bench.kit.toolkit.find_k8s_bin`.

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
    api = samples_by_labels(
        parse_samples(
            fetch_text(cp.url + "/metrics", 30, cp.ssl_context()),
            (
                "apiserver_request_total",
                "process_cpu_seconds_total",
                "apiserver_request_duration_seconds_sum",
                "apiserver_request_duration_seconds_count",
            ),
        )
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
    etcd = parse_samples(fetch_text(cp.etcd_url + "/metrics", 30), ("process_cpu_seconds_total",))
    reqs = {k: v for k, v in api.items() if k[0] == "apiserver_request_total"}
    return Counters(
        reqs,
        durations,
        sum(v for k, v in api.items() if k[0] == "process_cpu_seconds_total"),
        sample_sum(etcd, "process_cpu_seconds_total"),
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


def expected_state(
    cp: ControlPlane, change: Callable[[Any], Any] | None = None
) -> tuple[tuple[Specs, Statuses], Any]:
    """From scratch: read the cluster, optionally edit the snapshot, compute. Returns
    ((node specs, statuses), the Desired)."""
    from kvgate_operator.desired import compute
    from kvgate_operator.reader import ClusterReader
    from kvgate_operator.settings import OperatorSettings

    with cp.api_client() as api:
        snap = ClusterReader(api, OperatorSettings()).read().snapshot
    if change is not None:
        snap = change(snap)
    desired = compute(snap)
    statuses = {k: strip_status(v.status()) for k, v in desired.policies.items()}
    return (desired.node_specs, statuses), (desired, snap)


# ----------------------------------------------------------------------------------------------
# One pass in this process (phase timing and profile)


@dataclass
class PassTiming:
    """One pass's read, compute and plan, seconds; the writes it plans."""

    read: float
    compute: float
    plan: float
    planned_writes: int


def time_pass(cp: ControlPlane, repeat: int, prof: cProfile.Profile | None = None) -> PassTiming:
    """Read, compute and plan as the operator's pass does (no writes), best of ``repeat``;
    under ``prof`` when given."""
    from kvgate_operator.desired import compute
    from kvgate_operator.plan import plan
    from kvgate_operator.reader import ClusterReader
    from kvgate_operator.reconciler import _now
    from kvgate_operator.settings import OperatorSettings

    timings = []
    with cp.api_client() as api:
        rec = ClusterReader(api, OperatorSettings())
        for _ in range(repeat):
            if prof is not None:
                prof.enable()
            t0 = time.perf_counter()
            observed = rec.read()
            t1 = time.perf_counter()
            desired = compute(observed.snapshot)
            t2 = time.perf_counter()
            todo = plan(desired, observed.node_specs, observed.policy_status, _now())
            t3 = time.perf_counter()
            if prof is not None:
                prof.disable()
            timings.append(PassTiming(t1 - t0, t2 - t1, t3 - t2, len(todo)))
    return min(timings, key=lambda p: p.read + p.compute + p.plan)


def profile_pass(cp: ControlPlane, top: int = 18) -> str:
    """cProfile of one read + compute + plan, by own time, then cumulative."""
    prof = cProfile.Profile()
    time_pass(cp, 1, prof)
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return out.getvalue()
