"""The synthetic cluster of the operator benchmark: its layout (:class:`Layout`: nodes, pods,
policies, namespaces), the objects created (:func:`build_objects`, :func:`create_all`), what the
cluster holds now (policy statuses, NodeAdmission specs and versions) and the check against the
from-scratch desired state (:func:`expected_state`, :func:`wait_converged`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgate_agent.contract.api import GROUP, VERSION
from kvgate_bench.bench_operator.api import Http
from kvgate_bench.kit.controlplane import ControlPlane
from kvgate_bench.kit.kubeaccess import strip_status

REPO = Path(__file__).resolve().parents[3]


PER_NAMESPACE = 10  # policies per namespace


Key = tuple[str, str]


Specs = dict[str, Any]


Statuses = dict[Key, Any]


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
