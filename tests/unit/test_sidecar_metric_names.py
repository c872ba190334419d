"""Every metric the sidecar exposes keeps its name, type, labels and help text when a room
takes over its own metrics (issue 35: each room owns its metrics on one registry; the chart's
alert rules and dashboards read them). The pinned exposition is an agent-mode sidecar's,
composed as ``app.py`` does: the sidecar's metrics (with the upstream and engine rooms'), the
node link's sync metrics on the same registry, the engine tokenizer's tallies."""

from __future__ import annotations

import ast
import hashlib
import re

from prometheus_client import CollectorRegistry, generate_latest

from kvgate_agent.admission import AdmissionConfig, AdmissionController, AsyncAdmission
from kvgate_agent.contract.nodeadmission import PolicyRef
from kvgate_agent.contract.policy import parse_policy
from kvgate_agent.sidecar.engine import EngineMetrics
from kvgate_agent.sidecar.metrics import SidecarMetrics
from kvgate_agent.sidecar.node_link import Mode, SyncResult, SyncState
from kvgate_agent.sidecar.node_link.sync_metrics import SyncMetrics
from kvgate_agent.sidecar.upstream import UpstreamMetrics
from kvgate_bench.kit.toolkit import FakeClock
from tests.conftest import REPO, policy_doc

#: sha256 of the exposition's ``# HELP`` and ``# TYPE`` lines, in order, as they stood before
#: the node link took over its sync metrics.
META_SHA256 = "b8a4d9a904a4f18bb924b1e72e031d58e365e82d758ff78ca5b6ccea237fcb91"

#: Each exposed series name and its label names.
SERIES = {
    "kvgate_admission_decisions_total": ("outcome", "reason", "tenant"),
    "kvgate_queue_wait_seconds_bucket": ("le",),
    "kvgate_queue_wait_seconds_count": (),
    "kvgate_queue_wait_seconds_sum": (),
    "kvgate_upstream_errors_total": ("kind",),
    "kvgate_upstream_resends_total": (),
    "kvgate_client_disconnects_total": (),
    "kvgate_prefix_cached_tokens_total": ("source",),
    "kvgate_time_to_first_token_seconds_bucket": ("le",),
    "kvgate_time_to_first_token_seconds_count": (),
    "kvgate_time_to_first_token_seconds_sum": (),
    "kvgate_in_flight_requests": (),
    "kvgate_queue_length": (),
    "kvgate_kv_reserved_tokens": (),
    "kvgate_concurrency_limit": (),
    "kvgate_tenants_tracked": (),
    "kvgate_seconds_per_output_token": (),
    "kvgate_upstream_up": (),
    "kvgate_policy_mismatch": (),
    "kvgate_engine_capacity_unknown": (),
    "kvgate_agent_sync_total": ("result",),
    "kvgate_thresholds_mode": ("mode",),
    "kvgate_thresholds_ttl_seconds": (),
    "kvgate_policy_generation": ("name", "namespace"),
    "kvgate_engine_prompt_counts_total": ("source",),
}


def _exposition() -> str:
    spec = parse_policy(policy_doc({"tenants": {"defaultMaxTokens": 16}})).spec
    m = SidecarMetrics(
        AsyncAdmission(AdmissionController(AdmissionConfig.from_policy(spec), FakeClock(1000.0)))
    )
    ref = PolicyRef(namespace="ns", name="p", generation=3)
    sync = SyncMetrics(m.registry, SyncState(FakeClock(5.0)), lambda: next(iter(Mode)), lambda: ref)
    sync.agent_sync.labels(next(iter(SyncResult)).value).inc()
    m.engine.attach_prompt_counts({"engine": 2})
    m.count_decision("admitted", "ok", "a")
    return generate_latest(m.registry).decode()


def test_the_exposed_metrics_keep_their_names_labels_and_help() -> None:
    text = _exposition()
    meta = "\n".join(line for line in text.splitlines() if line.startswith("# "))
    series: dict[str, set[tuple[str, ...]]] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = re.match(r"([a-z_]+)(?:\{(.*)\})? ", line)
        assert match, line
        labels = tuple(sorted(re.findall(r'([a-z_]+)="', match.group(2) or "")))
        series.setdefault(match.group(1), set()).add(labels)
    assert series == {name: {labels} for name, labels in SERIES.items()}
    assert hashlib.sha256(meta.encode()).hexdigest() == META_SHA256, meta


def test_the_sidecar_metrics_import_only_the_rooms_they_compose() -> None:
    """Not the node link (it builds its own), not identity (the tenant label bound is the
    metrics'); the upstream and engine rooms' metrics objects, through their faces."""
    path = REPO / "agent" / "kvgate_agent" / "sidecar" / "metrics.py"
    imported = {
        node.module or ""
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
    }
    rooms = {m for m in imported if m.startswith("kvgate_agent.sidecar.")}
    assert rooms == {"kvgate_agent.sidecar.upstream", "kvgate_agent.sidecar.engine"}, rooms


def test_each_room_registers_its_own_families() -> None:
    registry = CollectorRegistry(auto_describe=True)
    upstream = UpstreamMetrics(registry)
    upstream.export_up()
    EngineMetrics(registry).attach_prompt_counts({"engine": 1})
    assert {family.name for family in registry.collect()} == {
        "kvgate_upstream_errors",
        "kvgate_upstream_resends",
        "kvgate_upstream_up",
        "kvgate_engine_capacity_unknown",
        "kvgate_engine_prompt_counts",
    }
