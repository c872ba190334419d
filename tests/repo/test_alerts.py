"""The chart's alerts (charts/kvgate/templates/prometheusrule.yaml) through Prometheus's own
promtool (https://prometheus.io/docs/prometheus/latest/configuration/unit_testing_rules/).

The chart is rendered by the real helm (scripts/build-k8s) with the ``monitoring`` scenario
(``metrics.prometheusRule.enabled``); the PrometheusRule's ``spec.groups`` become a Prometheus
rule file, which

- ``promtool check rules`` accepts (every expression parses, every template renders);
- ``promtool test rules`` runs tests/promtool/alerts.test.yaml against: for each alert a series
  that fires it (labels and annotations checked) and near misses that keep it silent (under the
  threshold, or over it for less than its ``for:``);
- every alert of the chart has such cases (a new alert without a test fails here), and the file
  holds no recording rules (if one is added, ``check rules`` covers it; a test should too);
- rendered with other thresholds, the same tests fail: they do check the thresholds.

promtool comes from Debian's ``prometheus`` package, which the test command installs
(scripts/install-prometheus); ``KVGATE_PROMTOOL`` points at it, else ``promtool`` on PATH. With
neither (outside the test command), these tests skip; a ``KVGATE_PROMTOOL`` that is not an
executable fails them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, k8s_bin_dir

CHART = REPO / "charts" / "kvgate"
TESTS = REPO / "tests" / "promtool" / "alerts.test.yaml"
RULE_FILE = "kvgate-rules.yaml"  # the name alerts.test.yaml's rule_files gives


@pytest.fixture(scope="module")
def promtool() -> str:
    """Path of promtool: $KVGATE_PROMTOOL (set by scripts/test), else on PATH."""
    preset = os.environ.get("KVGATE_PROMTOOL")
    if preset:
        if not os.access(preset, os.X_OK):
            pytest.fail(f"KVGATE_PROMTOOL={preset} is not executable")
        return preset
    found = shutil.which("promtool")
    if found is None:
        pytest.skip(
            "promtool not installed: scripts/install-prometheus (which scripts/test runs) "
            "installs Debian's prometheus package, or set KVGATE_PROMTOOL"
        )
    return found


def _helm() -> str:
    bin_dir = k8s_bin_dir()
    binary = bin_dir / "helm" if bin_dir is not None else None
    if binary is None or not os.access(binary, os.X_OK):
        if os.environ.get("KVGATE_ALLOW_SKIP_K8S") == "1":
            pytest.skip("helm not built (run scripts/build-k8s)")
        pytest.fail("helm not built: run scripts/build-k8s (or scripts/test)")
    return str(binary)


def _rule_groups(home: Path, *values: str) -> list[dict[str, Any]]:
    """``spec.groups`` of the PrometheusRule that ``helm template`` renders with the
    ``monitoring`` scenario and ``--set-json`` ``values``."""
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
        "KUBECONFIG": str(home / "no-kubeconfig"),
    }
    argv = [_helm(), "template", "kvgate", str(CHART), "--namespace", "kvgate-system"]
    argv += ["--values", str(CHART / "ci" / "monitoring-values.yaml")]
    argv += ["--show-only", "templates/prometheusrule.yaml"]
    for v in values:
        argv += ["--set-json", v]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, f"helm template failed:\n{r.stderr}"
    (rule,) = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert rule["kind"] == "PrometheusRule"
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def _write(dir_: Path, groups: list[dict[str, Any]]) -> Path:
    """The rule file and a copy of the tests beside it (promtool resolves rule_files from the
    test file's folder); returns the test file."""
    dir_.mkdir()
    (dir_ / RULE_FILE).write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return Path(shutil.copy(TESTS, dir_ / TESTS.name))


def _run(promtool: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], capture_output=True, text=True, cwd=cwd, timeout=60)


@pytest.fixture(scope="module")
def groups(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _rule_groups(tmp_path_factory.mktemp("helm"))


def test_check_rules(promtool: str, groups: list[dict[str, Any]], tmp_path: Path) -> None:
    _write(tmp_path / "rules", groups)
    r = _run(promtool, "check", "rules", RULE_FILE, cwd=tmp_path / "rules")
    assert r.returncode == 0, f"promtool check rules failed:\n{r.stdout}\n{r.stderr}"
    n = sum(len(g["rules"]) for g in groups)
    assert f"SUCCESS: {n} rules found" in r.stdout


def test_alerts_fire_and_stay_silent(
    promtool: str, groups: list[dict[str, Any]], tmp_path: Path
) -> None:
    tests = _write(tmp_path / "rules", groups)
    r = _run(promtool, "test", "rules", tests.name, cwd=tests.parent)
    assert r.returncode == 0, f"promtool test rules failed:\n{r.stdout}\n{r.stderr}"


def test_every_alert_has_cases(groups: list[dict[str, Any]]) -> None:
    """Each alert of the chart has, in alerts.test.yaml, an evaluation where it fires and one
    where it stays silent (``exp_alerts: []``); no recording rules to test."""
    rules = [rule for g in groups for rule in g["rules"]]
    assert [r_ for r_ in rules if "record" in r_] == [], "recording rules: add their tests"
    alerts = {r_["alert"] for r_ in rules}
    cases = [c for t in yaml.safe_load(TESTS.read_text())["tests"] for c in t["alert_rule_test"]]
    fired = {c["alertname"] for c in cases if c.get("exp_alerts")}
    silent = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    assert fired == alerts, f"alerts without a firing case: {alerts - fired}"
    assert silent == alerts, f"alerts without a silent case: {alerts - silent}"


def test_other_thresholds_fail_the_tests(promtool: str, tmp_path: Path) -> None:
    """The chart's thresholds raised: the alerts that depend on them no longer fire where the
    tests expect them, and promtool says so for each."""
    raised = _rule_groups(
        tmp_path / "helm",
        "metrics.prometheusRule.rejectedRatio=0.5",
        "metrics.prometheusRule.kvReservedRatio=0.97",
        "metrics.prometheusRule.gpuDataStaleSeconds=600",
    )
    tests = _write(tmp_path / "rules", raised)
    r = _run(promtool, "test", "rules", tests.name, cwd=tests.parent)
    assert r.returncode != 0, r.stdout
    for alert in (
        "KvgateHighRejectionRatio",
        "KvgateKvReservedNearCapacity",
        "KvgateAgentGpuDataStale",
    ):
        assert f"alertname: {alert}," in r.stdout + r.stderr, r.stdout
