"""The pure parts of kvgate_bench.kit.promserver: monitors to scrape configs, endpoint discovery,
Grafana's variable substitution and the operand of an alert's comparison. (The server itself
runs in tests/integration/test_journey.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from kvgate_bench.kit.promserver import (
    comparison_operand,
    grafana_value,
    monitor_scrape_configs,
    pod_targets,
    rate_interval,
    service_targets,
    substitute,
)

SM: dict[str, Any] = {
    "kind": "ServiceMonitor",
    "metadata": {"name": "kv-agent", "namespace": "sys"},
    "spec": {
        "namespaceSelector": {"matchNames": ["sys"]},
        "selector": {"matchLabels": {"component": "agent"}},
        "endpoints": [
            {
                "port": "http",
                "path": "/metrics",
                "honorLabels": True,
                "relabelings": [
                    {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}
                ],
            }
        ],
    },
}
SERVICE: dict[str, Any] = {
    "kind": "Service",
    "metadata": {"name": "kv-agent", "namespace": "sys", "labels": {"component": "agent"}},
    "spec": {
        "selector": {"app": "a"},
        "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
    },
}


def pod(
    name: str, ns: str, labels: dict[str, str], *ports: tuple[str, int], init: bool = False
) -> Any:
    c = {"name": "c", "ports": [{"name": n, "containerPort": p} for n, p in ports]}
    key = "initContainers" if init else "containers"
    return {"metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {"nodeName": "n1", key: [c]}}  # fmt: skip


def test_service_monitor_targets_follow_selector_and_target_port_name() -> None:
    pods = [
        pod("a-0", "sys", {"app": "a"}, ("http", 9470)),
        pod("b-0", "sys", {"app": "b"}, ("http", 1)),  # not selected by the Service
        pod("a-1", "other", {"app": "a"}, ("http", 2)),  # another namespace than the Service
    ]
    (t,) = service_targets(SM, [SERVICE], pods, "127.0.0.1")
    assert t.address == "127.0.0.1:9470"
    assert t.meta["__meta_kubernetes_service_name"] == "kv-agent"
    assert t.meta["__meta_kubernetes_pod_node_name"] == "n1"
    other_ns = {**SERVICE, "metadata": {**SERVICE["metadata"], "namespace": "x"}}
    assert service_targets(SM, [other_ns], pods, "127.0.0.1") == []


def test_service_monitor_scrape_config() -> None:
    (t,) = service_targets(SM, [SERVICE], [pod("a-0", "sys", {"app": "a"}, ("http", 9))], "h")
    (cfg,) = monitor_scrape_configs(SM, [t], "1s")
    assert cfg["job_name"] == "serviceMonitor/sys/kv-agent/0"
    assert cfg["metrics_path"] == "/metrics" and cfg["honor_labels"] is True
    assert cfg["static_configs"] == [{"targets": ["h:9"], "labels": t.meta}]
    relabel = cfg["relabel_configs"]
    assert {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job"} in relabel
    assert {"target_label": "endpoint", "replacement": "http"} in relabel
    # The monitor's own relabelling comes last, in Prometheus's spelling.
    assert relabel[-1] == {
        "source_labels": ["__meta_kubernetes_pod_node_name"],
        "target_label": "node",
    }


def test_pod_monitor_finds_the_named_port_in_any_namespace_and_init_containers() -> None:
    pm: dict[str, Any] = {
        "kind": "PodMonitor",
        "metadata": {"name": "sidecars", "namespace": "sys"},
        "spec": {
            "namespaceSelector": {"any": True},
            "selector": {},
            "podMetricsEndpoints": [{"port": "kvgate-http", "path": "/kvgate/metrics"}],
        },
    }
    pods = [
        pod("m-0", "models", {}, ("kvgate-http", 8001), ("x", 1), init=True),
        pod("plain", "models", {}, ("http", 8000)),
    ]
    (t,) = pod_targets(pm, pods, "127.0.0.1")
    assert t.address == "127.0.0.1:8001" and t.meta["__meta_kubernetes_pod_name"] == "m-0"
    (cfg,) = monitor_scrape_configs(pm, [t], "1s")
    assert cfg["metrics_path"] == "/kvgate/metrics" and cfg["honor_labels"] is False
    assert {"target_label": "job", "replacement": "sys/sidecars"} in cfg["relabel_configs"]
    assert all(r.get("target_label") != "service" for r in cfg["relabel_configs"])
    assert pod_targets({**pm, "spec": {**pm["spec"], "namespaceSelector": {}}}, pods, "h") == []


VAR = {"name": "namespace", "includeAll": True, "multi": True, "allValue": ".*"}


def test_grafana_values() -> None:
    assert grafana_value(VAR, None) == ".*"
    assert grafana_value(VAR, ["models"]) == "models"
    assert grafana_value(VAR, ["a.b", "c"]) == "(a\\\\.b|c)"
    assert grafana_value({"name": "x"}, ["a.b"]) == "a.b"  # single-value: as is
    with pytest.raises(ValueError, match="no All option"):
        grafana_value({"name": "x"}, None)
    with pytest.raises(ValueError, match="no value selected"):
        grafana_value(VAR, [])


def test_rate_interval_is_four_scrapes_at_least() -> None:
    assert rate_interval(1, 1) == "4s"
    assert rate_interval(15, 60) == "75s"


def test_substitute() -> None:
    expr = 'rate(x{namespace=~"$namespace", n=~"${node}"}[$__rate_interval])'
    got = substitute(expr, {"namespace": ".*", "node": "n1", "__rate_interval": "4s"})
    assert got == 'rate(x{namespace=~".*", n=~"n1"}[4s])'
    with pytest.raises(ValueError, match="namespace"):
        substitute(expr, {"node": "n1", "__rate_interval": "4s"})


@pytest.mark.parametrize(
    ("expr", "operand"),
    [
        ('up{job="a"} == 0', 'up{job="a"}'),
        ("sum (increase(m[15m])) > 0", "sum (increase(m[15m]))"),
        ("a\n  / ignoring (kind) b\n  > 0.95", "a\n  / ignoring (kind) b"),
        ('count by (mode) (m{mode=~"a|b"} == 1)', 'm{mode=~"a|b"}'),
        ('count by (pod) (m{ns=~"(x|y)"} == 0)', 'm{ns=~"(x|y)"}'),
        ('m{x="a > 1"} > 2', 'm{x="a > 1"}'),
        ("sum by (outcome) (rate(m[4s]))", None),
    ],
)
def test_comparison_operand(expr: str, operand: str | None) -> None:
    assert comparison_operand(expr) == operand
