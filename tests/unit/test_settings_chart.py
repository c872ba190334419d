"""The chart and the operator's injected sidecar speak the sidecar's settings: every variable the
webhook's template sets is a sidecar flag's variable, with a value that flag accepts; every
``injector`` key of ``values.yaml`` and of the chart's ``kvgate.injection`` helper is an
:class:`InjectionConfig` field; and where the chart states a default for a sidecar setting it is
the settings dataclass's default. The node agent's DaemonSet likewise sets only node flags'
variables, its ``values.yaml`` defaults being the flags' own. (No helm needed: the chart's files
are read as text and YAML.)"""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any

import pytest
import yaml
from pydantic.alias_generators import to_camel

from kvgate_agent.admission import POOL_STALE_S
from kvgate_agent.cli import build_parser
from kvgate_agent.sidecar.settings import AgentSettings, StoreSettings
from kvgate_operator.inject_store import SHARE_SYNC_MAX, StoreInjection
from kvgate_operator.template import TOKEN_FILE, InjectionConfig, sidecar_container
from tests.conftest import REPO

CHART = REPO / "charts" / "kvgate"
#: Set by the template for Kubernetes' own ``$(KVGATE_HOST_IP)`` expansion in
#: ``KVGATE_AGENT_URL``: no sidecar flag reads it.
TEMPLATE_ONLY = {"KVGATE_HOST_IP"}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("KVGATE_")]:
        monkeypatch.delenv(name)


def flags_by_env(role: str) -> dict[str, argparse.Action]:
    """The role's flags by the variable each reads (the ``[KVGATE_*]`` its help ends with)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for a in sub.choices[role]._actions:
        if a.option_strings and a.dest != "help":
            m = re.search(r"\[(KVGATE_[A-Z_]+)\]$", a.help or "")
            assert m, f"{a.option_strings} names no variable"
            out[m.group(1)] = a
    return out


def parse(action: argparse.Action, text: str) -> Any:
    return action.type(text) if action.type is not None else text  # type: ignore[operator]


def values() -> dict[str, Any]:
    doc = yaml.safe_load((CHART / "values.yaml").read_text())
    assert isinstance(doc, dict)
    return doc


def chart_injection() -> InjectionConfig:
    """The injection settings the chart's default values give the operator."""
    return InjectionConfig.model_validate({**values()["injector"], "sidecarImage": "img"})


def literal_env(config: InjectionConfig, **kw: Any) -> dict[str, str]:
    container = sidecar_container(config, model_port=8000, sidecar_port=8001, policy="p", **kw)
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_the_template_sets_only_sidecar_variables_with_values_they_accept() -> None:
    store = StoreInjection.model_validate(
        {
            "url": "rediss://r:6379/0",
            "existingSecret": "s",
            "passwordKey": "pw",
            "tls": {"caSecret": "ca", "caKey": "ca.crt"},
            "shareSync": 0.5,
        }
    )
    config = chart_injection().model_copy(
        update={
            "store": store,
            "passthrough_paths": ["/x"],
            "api_keys_secret": "keys",
            "jwks_secret": "jwks",
        }
    )
    container = sidecar_container(config, model_port=8000, sidecar_port=8001, policy="p")
    flags = flags_by_env("sidecar")
    names = {e["name"] for e in container["env"]}
    assert {"KVGATE_API_KEYS_FILE", "KVGATE_JWKS_FILE", "KVGATE_SHARE_SYNC"} <= names
    assert names - TEMPLATE_ONLY <= set(flags), names - TEMPLATE_ONLY - set(flags)
    for name, text in literal_env(config).items():
        if name in flags and "$(" not in text:
            for item in text.split(",") if flags[name].nargs is not None else [text]:
                parse(flags[name], item)  # raises when the sidecar would refuse it


def changed_by(field: str, value: Any) -> set[str]:
    """The variables the template writes from the InjectionConfig ``field``: those whose value
    moves when the field does."""
    base = chart_injection()
    before = literal_env(base)
    after = literal_env(base.model_copy(update={field: value}))
    return {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}


def test_the_charts_sidecar_defaults_are_the_settings_defaults() -> None:
    """Each ``injector`` value that the template passes to the sidecar as a variable is the
    default of the sidecar flag reading that variable (and so of its settings field:
    tests/unit/test_settings.py)."""
    flags = flags_by_env("sidecar")
    config = chart_injection()
    env = literal_env(config)
    checked = {}
    for name, info in InjectionConfig.model_fields.items():
        if info.annotation in (int, float):
            moved = changed_by(name, getattr(config, name) + 1)
        elif name == "log_level":
            moved = changed_by(name, "DEBUG")
        else:
            continue
        for var in moved:
            action = flags[var]
            if action.default is None:
                continue  # the sidecar has no default (e.g. KVGATE_AGENT_URL): nothing to agree
            assert parse(action, env[var]) == parse(action, action.default), (name, var)
            checked[to_camel(name)] = var
    assert checked == {
        "drainSeconds": "KVGATE_DRAIN_SECONDS",
        "headerTimeoutSeconds": "KVGATE_HEADER_TIMEOUT_SECONDS",
        "bodyTimeoutSeconds": "KVGATE_BODY_TIMEOUT_SECONDS",
        "upstreamTimeoutSeconds": "KVGATE_UPSTREAM_TIMEOUT",
        "logLevel": "KVGATE_LOG_LEVEL",
    }
    assert set(checked) <= set(values()["injector"]), "each is a values.yaml key"
    assert AgentSettings.__dataclass_fields__["token_file"].default == TOKEN_FILE


def chart_store(**update: Any) -> dict[str, Any]:
    """values.yaml's ``store`` with ``url`` set and ``update`` applied, as the chart's
    ``kvgate.injection`` helper passes it: the empty Secret names (none) left out."""
    store = {**values()["store"], "url": "redis://r:6379/0", **update}
    store["tls"] = {k: v for k, v in store["tls"].items() if v != ""}
    return {k: v for k, v in store.items() if v != ""}


def changed_store_env(update: dict[str, Any]) -> set[str]:
    """The variables that move when the chart's ``store`` values (``url`` set) get ``update``."""
    base = chart_injection().model_copy(
        update={"store": StoreInjection.model_validate(chart_store())}
    )
    before = literal_env(base)
    new = StoreInjection.model_validate(chart_store(**update))
    after = literal_env(base.model_copy(update={"store": new}))
    return {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}


def test_the_charts_store_values_are_the_store_injection_and_share_sync_defaults_off() -> None:
    """``store`` of values.yaml has a key per :class:`StoreInjection` field; ``shareSync``'s
    default is the sidecar's ``--share-sync`` default (0: the exchange off, no variable), and the
    sidecar's flag reads what the template writes from it."""
    assert set(values()["store"]) == {to_camel(n) for n in StoreInjection.model_fields}
    injection = StoreInjection.model_validate(chart_store())
    default = StoreSettings.__dataclass_fields__["share_sync"].default
    assert values()["store"]["shareSync"] == injection.share_sync == default == 0
    assert changed_store_env({}) == set()
    assert changed_store_env({"shareSync": 0.5}) == {"KVGATE_SHARE_SYNC"}
    flag = flags_by_env("sidecar")["KVGATE_SHARE_SYNC"]
    assert flag.option_strings == ["--share-sync"]
    assert parse(flag, flag.default) == default
    on = StoreInjection.model_validate(chart_store(shareSync=0.5))
    config = chart_injection().model_copy(update={"store": on})
    assert parse(flag, literal_env(config)["KVGATE_SHARE_SYNC"]) == 0.5
    # One bound for the period: the chart's schema, the operator's and the sidecar's flag all
    # stop below the age at which the pod reads the pool's figures as stale.
    schema = json.loads((CHART / "values.schema.json").read_text())
    bound = schema["properties"]["store"]["properties"]["shareSync"]["exclusiveMaximum"]
    assert bound == SHARE_SYNC_MAX == POOL_STALE_S
    with pytest.raises(argparse.ArgumentTypeError, match="below 5"):
        parse(flag, str(POOL_STALE_S))


def test_the_injection_helper_passes_values_keys_as_injection_fields() -> None:
    """``kvgate.injection`` in _helpers.tpl: each ``$i.<key>`` is an ``injector`` key of
    values.yaml, written under an InjectionConfig field's camelCase name; each ``injector`` key
    is passed on (the others: the image, the agent's port, the namespace)."""
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    block = helpers[helpers.index('define "kvgate.injection"') :]
    block = block[: block.index("{{- end }}")]
    passed = dict(re.findall(r'"(\w+)" \$i\.(\w+)', block))
    # (a key merged with fixed entries goes through its own helper of the same name)
    passed |= {k: k for k in re.findall(r'"(\w+)" \(include "kvgate\.\1"', block)}
    aliases = {to_camel(n) for n in InjectionConfig.model_fields}
    assert set(passed) <= aliases
    assert set(passed.values()) == set(values()["injector"])
    assert all(k == v for k, v in passed.items()), "one spelling: the key is the field's"


def test_the_agent_daemonset_sets_node_variables_with_their_defaults() -> None:
    flags = flags_by_env("node")
    daemonset = (CHART / "templates" / "agent-daemonset.yaml").read_text()
    names = set(re.findall(r"name: (KVGATE_[A-Z_]+)", daemonset))
    assert names and names <= set(flags), names - set(flags)
    agent = values()["agent"]
    chart_defaults = {
        "KVGATE_LISTEN": f"0.0.0.0:{agent['port']}",
        "KVGATE_GPU_BACKEND": agent["gpuBackend"],
        "KVGATE_LOG_LEVEL": agent["logLevel"],
        "KVGATE_WATCH_SERVER_TIMEOUT": str(agent["apiServer"]["watchServerTimeout"]),
        "KVGATE_WATCH_READ_TIMEOUT": str(agent["apiServer"]["watchReadTimeout"]),
        "KVGATE_API_LIVENESS_SECONDS": str(agent["apiServer"]["livenessSeconds"]),
    }
    for var, text in chart_defaults.items():
        assert var in names
        assert parse(flags[var], text) == parse(flags[var], flags[var].default), var
