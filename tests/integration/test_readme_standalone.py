"""README's standalone recipe, run as written (issue 36, item 9): its ``kvgate-sim`` stand-in
model server and its ``kvgate-agent sidecar`` command as real processes, then its ``curl``
example, which is answered by the model server through the sidecar; the same ``curl`` without
its ``Content-Type`` gets 415, as the README says. Only the ports are changed (free ones) and
``.venv/bin/`` is this interpreter's ``bin`` directory."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate_bench.kit.processes import Proc, start
from kvgate_bench.kit.toolkit import free_port
from tests.conftest import REPO

SECTION = "## Run the sidecar standalone"


def recipe_blocks() -> list[str]:
    """The ``sh`` code blocks of README's standalone section, in order."""
    text = (REPO / "README.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", section, flags=re.S)


def commands(block: str) -> list[str]:
    """The shell commands of a block: continuation lines joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    return [line.split("  #", 1)[0].strip() for line in joined.splitlines() if line.strip()]


def the(prefix: str) -> str:
    """The one command of the section's blocks that starts with ``prefix``."""
    found = [c for b in recipe_blocks() for c in commands(b) if c.startswith(prefix)]
    assert len(found) == 1, (prefix, found)
    return found[0]


@pytest.fixture
def ports() -> dict[str, str]:
    return {p: str(free_port()) for p in ("8000", "8080", "9090")}


def localised(command: str, ports: dict[str, str]) -> str:
    """``command`` on free ports, with ``.venv/bin/`` this interpreter's bin directory."""
    for old, new in ports.items():
        command = re.sub(rf"(?<=:){old}\b|(?<=--port ){old}\b", new, command)
    return command.replace(".venv/bin/", str(Path(sys.executable).parent) + "/")


@pytest.fixture
def servers(tmp_path: Path, ports: dict[str, str]) -> Iterator[dict[str, Proc]]:
    procs: dict[str, Proc] = {}
    try:
        sim = shlex.split(localised(the(".venv/bin/kvgate-sim").rstrip("&").strip(), ports))
        procs["sim"] = start(
            sim, tmp_path / "sim.log", url=f"http://127.0.0.1:{ports['8000']}", ready="/health"
        )
        sidecar = shlex.split(localised(the(".venv/bin/kvgate-agent sidecar"), ports))
        procs["sidecar"] = start(
            sidecar,
            tmp_path / "sidecar.log",
            url=f"http://127.0.0.1:{ports['8080']}",
            ready="/readyz",
            status=200,
        )
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def curl(command: str) -> subprocess.CompletedProcess[str]:
    argv = shlex.split(command)
    assert argv[0] == "curl", argv
    return subprocess.run(
        [*argv, "-w", "\n%{http_code}"], capture_output=True, text=True, timeout=60
    )


def test_the_readme_recipe_serves_its_curl_example(
    servers: dict[str, Proc], ports: dict[str, str]
) -> None:
    command = localised(the("curl "), ports)
    assert "-H 'Content-Type: application/json'" in command
    r = curl(command)
    body, _, status = r.stdout.rpartition("\n")
    assert status == "200", (r.stdout, r.stderr, servers["sidecar"].log.read_text()[-2000:])
    answer = json.loads(body)
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["usage"]["completion_tokens"] >= 1
    # Without its Content-Type, curl -d declares a form: refused, as the README says.
    r = curl(command.replace("-H 'Content-Type: application/json'", ""))
    body, _, status = r.stdout.rpartition("\n")
    assert status == "415", r.stdout
    assert json.loads(body)["error"]["code"] == "unsupported_media_type"
