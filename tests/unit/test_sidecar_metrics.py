"""The sidecar's metrics exist before the first event they count (a dashboard panel over them
shows 0, not "No data")."""

from __future__ import annotations

import re

from prometheus_client import generate_latest

from kvgate_agent.admission import AdmissionConfig, AdmissionController, AsyncAdmission
from kvgate_agent.contract.policy import parse_policy
from kvgate_agent.sidecar.metrics import SidecarMetrics
from kvgate_agent.sidecar.upstream import UPSTREAM_ERROR_KINDS
from kvgate_bench.kit.toolkit import FakeClock, parse_samples, sample_value
from tests.conftest import REPO, policy_doc


def test_every_upstream_error_kind_is_exported_at_zero_from_the_start() -> None:
    spec = parse_policy(policy_doc({"tenants": {"defaultMaxTokens": 16}})).spec
    m = SidecarMetrics(
        AsyncAdmission(AdmissionController(AdmissionConfig.from_policy(spec), FakeClock(1000.0)))
    )
    samples = parse_samples(generate_latest(m.registry).decode())
    for kind in UPSTREAM_ERROR_KINDS:
        assert sample_value(samples, "kvgate_upstream_errors_total", kind=kind) == 0.0
    # Every kind the sidecar counts is one of them.
    used = set()
    for path in (REPO / "agent" / "kvgate_agent" / "sidecar").rglob("*.py"):
        calls = re.findall(r"upstream\.errors\.labels\(([^)]*)\)", path.read_text())
        used |= {k for c in calls for k in re.findall(r'"([a-z0-9_]+)"', c)}
    assert used and used <= set(UPSTREAM_ERROR_KINDS), used
