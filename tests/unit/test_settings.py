"""One spelling per setting: every ``kvgate-agent sidecar`` flag comes from a field of the sidecar's
settings dataclasses (:mod:`kvgate_agent.sidecar.settings`), which holds its default once; the
flag's name, its ``KVGATE_*`` variable and its default are derived from that field, and the
README's flag tables say the same."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import pytest

from kvgate_agent.args import Flag, default_text, field_default, flag_fields, from_args
from kvgate_agent.cli import build_parser
from kvgate_agent.contract.policy import FailureMode
from kvgate_agent.node.settings import NodeSettings
from kvgate_agent.sidecar.cli import agent_settings, store_settings
from kvgate_agent.sidecar.settings import AgentSettings, SidecarSettings, StoreSettings
from kvgate_operator.settings import OperatorSettings
from tests.conftest import REPO

SIDECAR_CLASSES: tuple[type[Any], ...] = (SidecarSettings, AgentSettings, StoreSettings)
#: Each role's settings dataclasses.
ROLES: dict[str, tuple[type[Any], ...]] = {"sidecar": SIDECAR_CLASSES, "node": (NodeSettings,)}
#: Flags of both roles that are no settings field: the shared ``--log-level``.
SHARED = {"--log-level"}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``KVGATE_*`` variable of the machine running the tests moves a default."""
    import os

    for name in [n for n in os.environ if n.startswith("KVGATE_")]:
        monkeypatch.delenv(name)


def role_parser(role: str) -> argparse.ArgumentParser:
    """The ``kvgate-agent <role>`` subparser, built now (it reads the environment)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[role]
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


def actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's flags by their (one) option string, ``--help`` left out."""
    out = {}
    for a in parser._actions:
        if a.option_strings and a.dest != "help":
            assert len(a.option_strings) == 1, a.option_strings
            out[a.option_strings[0]] = a
    return out


def flags_of(*classes: type[Any]) -> Iterator[tuple[dataclasses.Field[Any], Flag]]:
    for cls in classes:
        yield from flag_fields(cls)


def words(text: str) -> list[str]:
    """A command line's arguments, split at spaces."""
    return text.split()


def parsed(action: argparse.Action, text: str) -> Any:
    return action.type(text) if action.type is not None else text  # type: ignore[operator]


@pytest.mark.parametrize("role", ROLES)
def test_every_flag_is_a_settings_field(role: str) -> None:
    acts = actions(role_parser(role))
    derived = [meta.flag_name(f) for f, meta in flags_of(*ROLES[role])]
    assert len(derived) == len(set(derived)), "two fields claim one flag"
    assert set(acts) == set(derived) | SHARED


@pytest.mark.parametrize(
    ("role", "field", "meta"),
    [(role, f, meta) for role, classes in ROLES.items() for f, meta in flags_of(*classes)],
    ids=lambda x: x.name if isinstance(x, dataclasses.Field) else x if isinstance(x, str) else "",
)
def test_flag_name_env_and_default_come_from_the_field(
    role: str, field: dataclasses.Field[Any], meta: Flag, monkeypatch: pytest.MonkeyPatch
) -> None:
    action = actions(role_parser(role))[meta.flag_name(field)]
    # the name: the field's, unless the field names its flag (an interface older than it)
    if meta.name is None:
        assert meta.flag_name(field) == "--" + field.name.replace("_", "-")
    env = meta.env_name(field)
    assert action.help is not None and action.help.endswith(f"[{env}]")
    # the default: the field's, through the flag's own type
    default = field_default(field)
    if meta.repeat:
        assert action.default == [] and default == ()
    elif default is dataclasses.MISSING or default is None:
        assert action.default is None
        assert action.required == meta.required
    else:
        text = (meta.text or default_text)(default)
        assert text is not None
        assert action.default == text
        value = parsed(action, text)
        assert (meta.to_field(value) if meta.to_field else value) == default
    # the variable: it replaces the default (and a required flag is then optional)
    value = meta.choices[-1] if meta.choices else "/from-env" if meta.repeat else "from-env"
    monkeypatch.setenv(env, value)
    again = actions(role_parser(role))[meta.flag_name(field)]
    assert again.default == ([value] if meta.repeat else value)
    assert again.required is False


def test_derived_names_are_the_fields_except_the_older_ones() -> None:
    """Where a flag is not named after its field, it is an interface older than the field
    (README, chart, operator): the exceptions are few and each says its name."""
    named = {
        (cls.__name__, f.name): meta.flag_name(f)
        for cls in SIDECAR_CLASSES
        for f, meta in flag_fields(cls)
        if meta.name is not None
    }
    assert named == {
        ("SidecarSettings", "tokenizer_file"): "--tokenizer",
        ("SidecarSettings", "passthrough_paths"): "--passthrough-path",
        ("AgentSettings", "url"): "--agent-url",
        ("AgentSettings", "ttl_override"): "--thresholds-ttl",
        ("StoreSettings", "url"): "--store",
        ("StoreSettings", "password_file"): "--store-password-file",
        ("StoreSettings", "ca_file"): "--store-ca-file",
        ("StoreSettings", "timeout"): "--store-timeout",
    }


def test_the_cli_builds_the_dataclass_defaults() -> None:
    """No flag given: the settings the CLI builds are the dataclasses' own defaults."""
    parser = build_parser()
    args = parser.parse_args(
        words(
            "sidecar --upstream http://m:8000 --agent-url http://a:9470 --pod-namespace ns "
            "--pod-name p --store redis://r:6379/0"
        )
    )
    agent = agent_settings(args)
    assert agent == dataclasses.replace(
        AgentSettings(url="http://a:9470", pod_namespace="ns", pod_name="p"),
        gpu_uuids=agent.gpu_uuids,
    )
    store = store_settings(args)
    assert store is not None
    assert store == StoreSettings(url="redis://r:6379/0", member=store.member)
    sidecar = from_args(SidecarSettings, args, agent=agent, store=store)
    assert sidecar == SidecarSettings(upstream="http://m:8000", agent=agent, store=store)


def test_flags_reach_their_fields() -> None:
    args = build_parser().parse_args(
        words(
            "sidecar --upstream http://m:8000 --upstream-timeout 7 --header-timeout-seconds "
            "0 --passthrough-path /v1/x --agent-url http://a:1 --pod-namespace n --pod-name "
            "p --failure-mode FailClosed --thresholds-ttl 4 --listen 0.0.0.0:9"
        )
    )
    s = from_args(SidecarSettings, args)
    assert (s.upstream_timeout, s.header_timeout_seconds) == (7.0, 0.0)
    assert (s.passthrough_paths, s.listen) == (("/v1/x",), ("0.0.0.0", 9))
    a = agent_settings(args)
    assert (a.failure_mode, a.ttl_override) == (FailureMode.FAIL_CLOSED, 4.0)
    assert a.metrics_url is None  # no --pod-ip


# ----------------------------------------------------------------------------------------------
# The README's flag tables


def readme_flags(start: str, end: str) -> dict[str, tuple[str, str]]:
    """``flag -> (variable, default column)`` from the README's tables between two headings."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(start) : text.index(end, text.index(start))]
    out: dict[str, tuple[str, str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`--"):
            continue
        flags = re.findall(r"`(--[a-z-]+)`", cells[0])
        envs = re.findall(r"`(KVGATE_[A-Z_]+)`", cells[1])
        assert len(flags) == len(envs), line
        for f, e in zip(flags, envs, strict=True):
            out[f] = (e, cells[2].strip("`"))
    return out


def check_readme(role: str, table: dict[str, tuple[str, str]]) -> None:
    acts = actions(role_parser(role))
    assert set(table) == set(acts), "the README's flag table and the flags differ"
    for name, (env, default) in table.items():
        action = acts[name]
        assert action.help is not None and action.help.endswith(f"[{env}]"), name
        try:
            number = float(default)
        except ValueError:
            continue
        assert parsed(action, action.default) == number, name


def test_the_readme_tells_the_sidecar_flags() -> None:
    check_readme("sidecar", readme_flags("## Run the sidecar standalone", "## The policy"))


def test_the_readme_tells_the_node_flags() -> None:
    check_readme("node", readme_flags("## The node agent", "## Security"))


# ----------------------------------------------------------------------------------------------
# The operator's README table


def readme_operator_rows() -> list[tuple[list[str], str]]:
    """``(variables, default column)`` of each row of the README's operator table (under "High
    availability"), abbreviations (``..._X``, ``_X``) expanded to the one variable ending so."""
    text = (REPO / "README.md").read_text()
    start = text.index("### High availability")
    section = text[start : text.index("\n## ", start)]
    every = [f"KVGATE_OPERATOR_{name.upper()}" for name in OperatorSettings.model_fields]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`KVGATE_OPERATOR_"):
            continue
        names = []
        for name in re.findall(r"`([A-Z_.]+)`", cells[0]):
            if name.startswith("KVGATE_"):
                names.append(name)
                continue
            (full,) = [v for v in every if v.endswith("_" + name.lstrip("._"))]
            names.append(full)
        rows.append((names, cells[1]))
    return rows


def readme_default(text: str, days: bool) -> Any:
    """A default column's entry as a value: a number (days in seconds), a bool, a string in
    backticks; None for a description such as ``(unset)``."""
    text = text.strip()
    if text in ("true", "false"):
        return text == "true"
    if text.startswith("`"):
        return text.strip("`")
    try:
        return float(text) * (86400 if days else 1)
    except ValueError:
        return None


def test_the_readme_tells_every_operator_variable_and_its_default() -> None:
    os_defaults = {
        f"KVGATE_OPERATOR_{name.upper()}": field.get_default(call_default_factory=False)
        for name, field in OperatorSettings.model_fields.items()
    }
    rows = readme_operator_rows()
    listed = [v for names, _ in rows for v in names]
    assert len(listed) == len(set(listed)), "a variable is in two rows"
    assert set(listed) == set(os_defaults), "the README's operator table and the settings differ"
    for names, column in rows:
        days = column.endswith(" days")
        parts = column.removesuffix(" days").split(", ")
        if len(parts) != len(names):
            continue
        for name, part in zip(names, parts, strict=True):
            want = readme_default(part, days)
            if want is not None:
                assert os_defaults[name] == want, (name, part)


@pytest.mark.parametrize("variable", ["KVGATE_FAILURE_MODE"])
def test_a_variable_outside_a_flags_choices_exits_2_naming_them(
    variable: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse checks a flag's value against its choices, not a default: the variable's
    value is checked when the flags are made (a typo never runs something else silently)."""
    monkeypatch.setenv(variable, "aiohtttp")
    with pytest.raises(SystemExit) as exc:
        role_parser("sidecar")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert variable in err and "'aiohtttp'" in err and "expected one of" in err


@pytest.mark.parametrize("given", ["flag", "env"])
def test_the_retired_aiohttp_server_leg_exits_2_saying_so(
    given: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--server-leg aiohttp`` (kvgate 0.x's leg, retired) is refused, by flag or variable,
    with a message saying it was retired; ``kvgate``, the only leg, is still accepted."""
    line = "sidecar --upstream http://m:8000"
    if given == "env":
        monkeypatch.setenv("KVGATE_SERVER_LEG", "aiohttp")
    else:
        line += " --server-leg aiohttp"
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(words(line))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--server-leg" in err and "aiohttp server leg was retired" in err
    monkeypatch.delenv("KVGATE_SERVER_LEG", raising=False)
    args = build_parser().parse_args(words("sidecar --upstream http://m:8000 --server-leg kvgate"))
    assert from_args(SidecarSettings, args).server_leg == "kvgate"
