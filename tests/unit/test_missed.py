"""Missed injections: which pods asked for the sidecar but run without it (the same rules as
the webhook, through inject() as a dry run), and the once-per-pod bookkeeping."""

from __future__ import annotations

from typing import Any

from kvgate_operator.inject import ANNOTATION_INJECT, ANNOTATION_INJECTED, inject
from kvgate_operator.missed import MissedPod, ReportedPods, event_name, find_missed
from kvgate_operator.template import InjectionConfig

CONFIG = InjectionConfig(own_namespace="kvgate-system")
OPT_IN = {"kvgate.io/inject": "true"}


def pod(
    name: str,
    ns: str = "models",
    *,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    uid: str | None = None,
    **spec: Any,
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": uid or f"uid-{name}",
            "labels": labels or {},
            "annotations": annotations or {},
        },
        "spec": {
            "containers": [{"name": "vllm", "image": "vllm", "ports": [{"containerPort": 8000}]}],
            **spec,
        },
        "status": {"phase": "Pending"},
    }


def names(missed: list[MissedPod]) -> list[str]:
    return [m.name for m in missed]


def test_opted_in_by_pod_label_without_sidecar_is_missed() -> None:
    got = find_missed([pod("a", labels=OPT_IN), pod("b")], {}, CONFIG)
    assert got == [MissedPod("models", "a", "uid-a", "pod label")]
    assert "kvgate.io/inject=true" in got[0].message and "recreate" in got[0].message


def test_opted_in_by_namespace_label() -> None:
    ns_labels = {"models": dict(OPT_IN), "other": {}}
    got = find_missed([pod("a"), pod("b", "other")], ns_labels, CONFIG)
    assert got == [MissedPod("models", "a", "uid-a", "namespace label")]


def test_injected_pods_are_not_missed() -> None:
    injected = inject(
        pod("a", labels=OPT_IN), namespace="models", namespace_opt_in=False, config=CONFIG
    ).pod
    assert ANNOTATION_INJECTED in injected["metadata"]["annotations"]
    assert find_missed([injected], {"models": dict(OPT_IN)}, CONFIG) == []


def test_opt_out_excluded_namespaces_and_host_network_are_not_missed() -> None:
    pods = [
        pod("out", labels=OPT_IN, annotations={ANNOTATION_INJECT: "false"}),
        pod("sys", "kube-system", labels=OPT_IN),
        pod("own", "kvgate-system", labels=OPT_IN),
        pod("hostnet", labels=OPT_IN, hostNetwork=True),
    ]
    ns_labels = {n: dict(OPT_IN) for n in ("models", "kube-system", "kvgate-system")}
    assert find_missed(pods, ns_labels, CONFIG) == []


def test_pods_the_webhook_would_refuse_are_not_counted_as_missed() -> None:
    # The sidecar port equals the model port: the webhook would have refused it.
    clash = pod("clash", labels=OPT_IN)
    clash["spec"]["containers"][0]["ports"] = [{"containerPort": CONFIG.sidecar_port}]
    assert find_missed([clash], {}, CONFIG) == []


def test_finished_and_terminating_pods_are_ignored() -> None:
    done = pod("done", labels=OPT_IN)
    done["status"]["phase"] = "Succeeded"
    going = pod("going", labels=OPT_IN)
    going["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert find_missed([done, going], {}, CONFIG) == []


def test_unreadable_namespaces_leave_only_pod_labels() -> None:
    pods = [pod("by-pod", labels=OPT_IN), pod("by-ns")]
    assert names(find_missed(pods, None, CONFIG)) == ["by-pod"]


def test_reported_pods_are_remembered_once_and_bounded() -> None:
    r = ReportedPods(limit=3)
    missed = [MissedPod("ns", f"p{i}", f"u{i}", "pod label") for i in range(5)]
    assert r.new(missed) == missed
    for m in missed[:2]:
        r.add(m.uid)
    assert r.new(missed) == missed[2:]
    for m in missed[2:]:
        r.add(m.uid)
    assert len(r) == 3 and "u0" not in r and "u4" in r


def test_event_name_is_stable_per_uid_and_a_valid_name() -> None:
    m = MissedPod("ns", "x" * 253, "0123456789abcdef", "pod label")
    name = event_name(m)
    assert name == event_name(m) and len(name) <= 253
    assert name.endswith(".kvgate-injection-missed.01234567")
