"""The API server as the operator benchmark reads it: its binaries (:func:`k8s_bin_dir`), an HTTP
client with keep-alive connections (:class:`Http`), and its counters and the operator's CPU
(:class:`Counters`, :func:`read_counters`), diffed into a phase's writes (:func:`write_diff`:
``apiserver_request_total`` over the write verbs) and request latencies (:func:`latencies`).
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate_agent.contract.api import GROUP
from kvgate_bench.kit.controlplane import ControlPlane
from kvgate_bench.kit.toolkit import (
    cpu_seconds,
    fetch_text,
    find_k8s_bin,
    parse_samples,
    sample_sum,
    samples_by_labels,
)

WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "APPLY", "DELETE", "DELETECOLLECTION"})


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
