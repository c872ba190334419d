"""A real Prometheus server for the tests, scraping what the chart's monitors would scrape.

:class:`PrometheusServer` runs the ``prometheus`` binary (Debian's package, installed by
scripts/install-prometheus; ``KVGATE_PROMETHEUS`` names it) on a free loopback port with its
storage in a temporary directory, and answers PromQL through the HTTP API
(https://prometheus.io/docs/prometheus/latest/querying/api/).

Without a kubelet or Kubernetes service discovery, the chart's Prometheus Operator monitors
(ServiceMonitor, PodMonitor) become static scrape configs: :func:`monitor_scrape_configs` takes
one monitor and the endpoints it would discover (:class:`Target`: an address and the
``__meta_kubernetes_*`` labels Kubernetes discovery would attach,
https://prometheus.io/docs/prometheus/latest/configuration/configuration/#kubernetes_sd_config)
and writes the relabelling the Prometheus Operator generates for it (target labels
``namespace``, ``service``, ``pod``, ``container``, ``endpoint``; ``job`` the Service's name for a
ServiceMonitor, ``<namespace>/<name>`` for a PodMonitor, per
https://prometheus-operator.dev/docs/api-reference/api/), followed by the monitor's own
``relabelings``, ``path`` and ``honorLabels``. :func:`service_targets` and :func:`pod_targets`
find those endpoints the way the endpoints controller and pod discovery would: selector, port
name, container port.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvgate_bench.kit.processes import stop
from kvgate_bench.kit.toolkit import free_port, wait_until

ENV = "KVGATE_PROMETHEUS"
_OPERATOR_LABELS = {  # target label <- discovery label, as the Prometheus Operator relabels
    "namespace": "__meta_kubernetes_namespace",
    "service": "__meta_kubernetes_service_name",
    "pod": "__meta_kubernetes_pod_name",
    "container": "__meta_kubernetes_pod_container_name",
}
_RELABEL_KEYS = {  # the monitors' camelCase RelabelConfig fields -> Prometheus's
    "sourceLabels": "source_labels",
    "targetLabel": "target_label",
    "separator": "separator",
    "regex": "regex",
    "replacement": "replacement",
    "modulus": "modulus",
    "action": "action",
}


class PromQLError(RuntimeError):
    """Prometheus refused a query (``status: error``): the message is its ``error``."""


def prometheus_binary() -> str | None:
    """``$KVGATE_PROMETHEUS``, else ``prometheus`` on PATH, else None.

    Raises:
        FileNotFoundError: ``KVGATE_PROMETHEUS`` is set but not an executable.
    """
    preset = os.environ.get(ENV)
    if preset:
        if not os.access(preset, os.X_OK):
            raise FileNotFoundError(f"{ENV}={preset} is not executable")
        return preset
    return shutil.which("prometheus")


@dataclass(frozen=True)
class Target:
    """One endpoint a monitor scrapes: ``host:port`` and its discovery labels."""

    address: str
    meta: dict[str, str]


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector's ``matchLabels`` (``matchExpressions`` are not supported: the chart
    uses none) against ``labels``; an empty selector matches everything."""
    if selector.get("matchExpressions"):
        raise ValueError(f"matchExpressions are not supported: {selector}")
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _in_namespaces(monitor: dict[str, Any], namespace: str) -> bool:
    """Whether a monitor's ``namespaceSelector`` (``any`` or ``matchNames``; by default its own
    namespace) covers ``namespace``."""
    sel = monitor["spec"].get("namespaceSelector") or {}
    if sel.get("any"):
        return True
    return namespace in (sel.get("matchNames") or [monitor["metadata"]["namespace"]])


def _container_ports(pod: dict[str, Any]) -> Iterable[tuple[dict[str, Any], dict[str, Any]]]:
    """(container, port) of every declared port, init containers (native sidecars) included."""
    spec = pod["spec"]
    for c in [*spec.get("initContainers", []), *spec.get("containers", [])]:
        for p in c.get("ports", []):
            yield c, p


def _pod_meta(pod: dict[str, Any], container: dict[str, Any], port_name: str) -> dict[str, str]:
    meta = pod["metadata"]
    return {
        "__meta_kubernetes_namespace": meta["namespace"],
        "__meta_kubernetes_pod_name": meta["name"],
        "__meta_kubernetes_pod_node_name": pod["spec"].get("nodeName", ""),
        "__meta_kubernetes_pod_container_name": container["name"],
        "__meta_kubernetes_pod_container_port_name": port_name,
    }


def pod_targets(monitor: dict[str, Any], pods: Iterable[dict[str, Any]], host: str) -> list[Target]:
    """The endpoints a PodMonitor's first ``podMetricsEndpoints`` entry finds among ``pods``
    (Pod objects; each reached at ``host``): pods its selector matches with a container port of
    that name."""
    spec = monitor["spec"]
    port = spec["podMetricsEndpoints"][0]["port"]
    out = []
    for pod in pods:
        if not _in_namespaces(monitor, pod["metadata"]["namespace"]):
            continue
        if not _matches(spec.get("selector") or {}, pod["metadata"].get("labels") or {}):
            continue
        for c, p in _container_ports(pod):
            if p.get("name") == port:
                out.append(Target(f"{host}:{p['containerPort']}", _pod_meta(pod, c, port)))
    return out


def service_targets(
    monitor: dict[str, Any],
    services: Iterable[dict[str, Any]],
    pods: Iterable[dict[str, Any]],
    host: str,
) -> list[Target]:
    """The endpoints a ServiceMonitor's first ``endpoints`` entry finds: ``services`` its
    selector matches, their port of that name, and that port's ``targetPort`` (a name or a
    number) on the ``pods`` each Service selects (each reached at ``host``)."""
    spec = monitor["spec"]
    port = spec["endpoints"][0]["port"]
    pods = list(pods)
    out = []
    for svc in services:
        if not _in_namespaces(monitor, svc["metadata"]["namespace"]):
            continue
        if not _matches(spec["selector"], svc["metadata"].get("labels") or {}):
            continue
        sport = next(p for p in svc["spec"]["ports"] if p.get("name") == port)
        target_port = sport.get("targetPort", sport["port"])
        selector = {"matchLabels": svc["spec"].get("selector") or {}}
        for pod in pods:
            same_ns = pod["metadata"]["namespace"] == svc["metadata"]["namespace"]
            if not same_ns or not _matches(selector, pod["metadata"].get("labels") or {}):
                continue
            for c, p in _container_ports(pod):
                if target_port in (p.get("name"), p["containerPort"]):
                    meta = _pod_meta(pod, c, port)
                    meta["__meta_kubernetes_service_name"] = svc["metadata"]["name"]
                    out.append(Target(f"{host}:{p['containerPort']}", meta))
    return out


def monitor_scrape_configs(
    monitor: dict[str, Any], targets: list[Target], interval: str
) -> list[dict[str, Any]]:
    """Prometheus ``scrape_configs`` for each endpoint of a ServiceMonitor or PodMonitor,
    scraping the static ``targets`` every ``interval`` (a Prometheus duration: the test's, not
    the monitor's)."""
    kind, meta, spec = monitor["kind"], monitor["metadata"], monitor["spec"]
    endpoints = spec["endpoints"] if kind == "ServiceMonitor" else spec["podMetricsEndpoints"]
    out = []
    for i, ep in enumerate(endpoints):
        relabel: list[dict[str, Any]] = [
            {"source_labels": [src], "target_label": dst}
            for dst, src in _OPERATOR_LABELS.items()
            if kind == "ServiceMonitor" or dst != "service"
        ]
        if kind == "ServiceMonitor":
            relabel.append(
                {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job"}
            )
        else:
            relabel.append(
                {"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"}
            )
        relabel.append({"target_label": "endpoint", "replacement": ep["port"]})
        for r in ep.get("relabelings") or []:
            conv = {_RELABEL_KEYS[k]: v for k, v in r.items()}
            if "action" in conv:
                conv["action"] = str(conv["action"]).lower()
            relabel.append(conv)
        out.append(
            {
                "job_name": f"{kind[0].lower()}{kind[1:]}/{meta['namespace']}/{meta['name']}/{i}",
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "metrics_path": ep.get("path", "/metrics"),
                "honor_labels": bool(ep.get("honorLabels", False)),
                "static_configs": [{"targets": [t.address], "labels": t.meta} for t in targets],
                "relabel_configs": relabel,
            }
        )
    return out


class PrometheusServer:
    """A ``prometheus`` process on 127.0.0.1 scraping ``scrape_configs``, storage and log in
    ``work``; a context manager (stopped on exit).

    Raises:
        RuntimeError: from :meth:`start`, the process exited before it was ready (its log in the
            message).
    """

    def __init__(
        self,
        binary: str,
        work: Path,
        scrape_configs: list[dict[str, Any]],
        *,
        interval: str = "1s",
        ready_timeout: float = 60.0,
    ) -> None:
        self.binary, self.work = binary, work
        self.config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": scrape_configs,
        }
        self.ready_timeout = ready_timeout
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.work / "prometheus.log"

    def start(self) -> PrometheusServer:
        self.work.mkdir(parents=True, exist_ok=True)
        config = self.work / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config, sort_keys=False))
        argv = [
            self.binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={self.work / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=warn",
        ]
        with self.log.open("ab") as fh:
            self.proc = subprocess.Popen(
                argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    return int(r.status) == 200
            except OSError:
                return False

        wait_until(ready, self.ready_timeout, "prometheus to be ready\n" + self.tail())
        return self

    def tail(self, lines: int = 30) -> str:
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        stop(self.proc, 15)
        self.proc = None

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def api(self, path: str, **params: str) -> Any:
        """``data`` of a GET of ``/api/v1/<path>``.

        Raises:
            PromQLError: Prometheus answered ``status: error`` (bad query: HTTP 400/422).
        """
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise PromQLError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as one element) ``expr`` evaluates to at ``at`` (Unix
        seconds; None: now).

        Raises:
            PromQLError: the expression does not parse or evaluate.
        """
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        data = self.api("query", **params)
        result = data["result"]
        return result if data["resultType"] in ("vector", "matrix") else [{"value": result}]

    def label_values(self, label: str, match: str) -> list[str]:
        """Values of ``label`` on series ``match`` selects (what Grafana's
        ``label_values(match, label)`` lists)."""
        return list(self.api(f"label/{label}/values", **{"match[]": match}))

    def targets_up(self) -> dict[str, int]:
        """``job`` -> how many of its active targets' last scrape succeeded."""
        up: dict[str, int] = {}
        for t in self.api("targets", state="active")["activeTargets"]:
            job = t["labels"]["job"]
            up[job] = up.get(job, 0) + (t["health"] == "up")
        return up


# ----------------------------------------------------------------------------- Grafana, alerts

_REGEX_SPECIAL = set("\\^$.|?*+()[]{}")


def _regex_escape(value: str) -> str:
    """``value`` as a literal inside a PromQL regex string: what Grafana's Prometheus data
    source does to each selected value of a multi-value or include-all variable
    (``prometheusSpecialRegexEscape``: a backslash before each regex special character, doubled
    for the PromQL string)."""
    return "".join("\\\\" + ch if ch in _REGEX_SPECIAL else ch for ch in value)


def grafana_value(variable: dict[str, Any], selected: list[str] | None) -> str:
    """What Grafana writes for dashboard ``variable`` (an entry of ``templating.list``) in a
    Prometheus query: ``selected`` None means "All" (the variable's ``allValue``, as is);
    otherwise the values regex-escaped, one bare, several as ``(a|b)`` (multi-value and
    include-all variables; https://grafana.com/docs/grafana/latest/datasources/prometheus/template-variables/).

    Raises:
        ValueError: "All" for a variable without ``includeAll``, or nothing selected.
    """
    if selected is None:
        if not variable.get("includeAll"):
            raise ValueError(f"variable {variable['name']} has no All option")
        return str(variable.get("allValue") or ".*")
    if not selected:
        raise ValueError(f"no value selected for {variable['name']}")
    if not (variable.get("multi") or variable.get("includeAll")):
        return selected[0]
    escaped = [_regex_escape(v) for v in selected]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def rate_interval(scrape_interval_s: float, interval_s: float) -> str:
    """Grafana's ``$__rate_interval``: max(``$__interval`` + scrape interval, 4 × scrape
    interval), the scrape interval being the data source's setting
    (https://grafana.com/docs/grafana/latest/datasources/prometheus/template-variables/#use-__rate_interval)."""
    return f"{max(interval_s + scrape_interval_s, 4 * scrape_interval_s):g}s"


def substitute(expr: str, values: dict[str, str]) -> str:
    """``expr`` with ``$name`` and ``${name}`` replaced from ``values`` (longest names first).

    Raises:
        ValueError: a ``$`` variable is left that ``values`` does not name.
    """
    out = expr
    for name in sorted(values, key=len, reverse=True):
        out = out.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    left = re.findall(r"\$\{?\w+", out)
    if left:
        raise ValueError(f"unsubstituted variables {left} in {expr!r}")
    return out


_COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)\s*(bool\s+)?[-+]?[0-9][0-9.eE+-]*\s*(?=\)|$)")


def comparison_operand(expr: str) -> str | None:
    """The left operand of the last comparison with a number in ``expr`` (``A > 0.2``,
    ``count (A == 0)``: ``A``), within the parentheses around that comparison; None if there
    is none. Where the comparison filters everything out (an alert that does not fire), this
    operand is what should still return series."""
    matches = [m for m in _COMPARISON.finditer(expr) if not _in_string(expr, m.start())]
    if not matches:
        return None
    end = matches[-1].start()
    depth, start, quote = 0, 0, ""
    for i in range(end - 1, -1, -1):
        ch = expr[i]
        if quote:
            quote = "" if ch == quote and expr[i - 1 : i] != "\\" else quote
        elif ch in "\"'":
            quote = ch
        elif ch == ")":
            depth += 1
        elif ch == "(":
            if depth == 0:
                start = i + 1
                break
            depth -= 1
    return expr[start:end].strip()


def _in_string(expr: str, pos: int) -> bool:
    quote = ""
    for i, ch in enumerate(expr[:pos]):
        if quote:
            quote = "" if ch == quote and expr[i - 1 : i] != "\\" else quote
        elif ch in "\"'":
            quote = ch
    return bool(quote)
