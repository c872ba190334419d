"""The mypyc-compiled modules (``scripts/mypyc-modules.txt``, built by ``scripts/build-mypyc``
into the agent image by default): the list names real, pure, strictly typed modules that cover
the admission decision; the decision trace that compares compiled and pure runs is
deterministic and reaches every kind of outcome; and, where a compiled build is cached
(``python -m kvgate_bench.compiled`` makes one in about a minute of CPU), the compiled core
decides exactly as the sources do. Compiling here would take longer than the unit suite allows.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvgate_bench import compiled, compiled_http

AGENT_ROOT = compiled.AGENT.parent
#: Imports a compiled module may not have: the frameworks the import contracts keep out of
#: pure modules (mypyc compiles against their types, and the image's fallback must stay pure).
FRAMEWORKS = {"aiohttp", "fastapi", "uvicorn", "kubernetes", "kopf", "prometheus_client"}
#: The per-request modules of the two HTTP legs (the server leg, the upstream leg) and the
#: pipeline (issue 37), compiled too: they are the sidecar's I/O, so they may name
#: prometheus_client's metric types and (the upstream leg) aiohttp's client errors, as plain
#: Python objects.
LEGS = (
    "kvgate_agent/sidecar/edge/client_body.py",
    "kvgate_agent/sidecar/edge/client_conn.py",
    "kvgate_agent/sidecar/edge/client_parse.py",
    "kvgate_agent/sidecar/edge/client_request.py",
    "kvgate_agent/sidecar/edge/client_transport.py",
    "kvgate_agent/sidecar/edge/hop_headers.py",
    "kvgate_agent/sidecar/edge/wire.py",
    "kvgate_agent/sidecar/pipeline.py",
    "kvgate_agent/sidecar/upstream/forward.py",
    "kvgate_agent/sidecar/upstream/relay.py",
    "kvgate_agent/sidecar/upstream/upstream.py",
    "kvgate_agent/sidecar/upstream/upstream_conn.py",
)
LEG_FRAMEWORKS = {"aiohttp", "prometheus_client"}
#: The server leg's modules and the pipeline name no aiohttp: the answer's holder is kvgate's
#: own ``Answer`` since aiohttp's server leg was retired (issue 35).
NO_AIOHTTP = tuple(m for m in LEGS if "/edge/" in m or m.endswith("/pipeline.py"))


def test_the_list_names_pure_agent_modules_covering_the_decision() -> None:
    paths = compiled.module_paths()
    assert paths == sorted(set(paths)), "sorted, no repeats"
    for rel in paths:
        path = AGENT_ROOT / rel
        assert path.is_file(), rel
        tree = ast.parse(path.read_text())
        imported: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
        allowed = LEG_FRAMEWORKS if rel in LEGS else set()
        if rel in NO_AIOHTTP:
            allowed = allowed - {"aiohttp"}
        assert not imported & (FRAMEWORKS - allowed), (rel, imported & FRAMEWORKS)
    # every admission module that AdmissionController.submit/release runs through is compiled,
    # its sub-packages' (fairqueue/) included (async_admission.py is the asyncio driver, the
    # __init__ faces re-export)
    admission = sorted(
        f"kvgate_agent/{p.relative_to(compiled.AGENT).as_posix()}"
        for p in (compiled.AGENT / "admission").rglob("*.py")
        if p.name not in ("__init__.py", "async_admission.py")
    )
    assert [p for p in paths if p.startswith("kvgate_agent/admission/")] == admission
    # and the per-request code of the own server leg, the upstream leg and the pipeline
    assert set(LEGS) <= set(paths), sorted(set(LEGS) - set(paths))
    assert compiled.module_names()[0] == paths[0].removesuffix(".py").replace("/", ".")


def test_the_build_script_reads_the_list() -> None:
    """The script compiles the listed modules, and mypy resolves their third-party imports from
    the target interpreter (``--python-executable``): Dockerfile.agent's mypyc lives in a venv
    of its own, without aiohttp, msgspec or pydantic, and failed on every such import before."""
    script = compiled.BUILD_SCRIPT.read_text()
    assert "mypyc-modules.txt" in script
    assert '"$mypyc" --python-executable "$(command -v "$py")" "${mods[@]}"' in script
    assert Path(compiled.BUILD_SCRIPT).stat().st_mode & 0o111, "executable"


def test_the_decision_trace_is_deterministic_and_reaches_every_outcome() -> None:
    rows = compiled.decision_trace(7, 1500)
    assert rows == compiled.decision_trace(7, 1500)
    outcomes = Counter(r[2] for r in rows if r[1] in ("submit", "resolved"))
    assert {"admitted", "queued", "rejected"} <= set(outcomes), outcomes
    assert rows != compiled.decision_trace(8, 1500)


def test_compiled_core_decides_as_the_sources() -> None:
    build = compiled.cached()
    if build is None:
        pytest.skip("no mypyc build cached for these sources: python -m kvgate_bench.compiled")
    assert compiled.compiled_trace(build, 7, 3000) == compiled.decision_trace(7, 3000)


def test_compiled_body_decoding_answers_as_the_sources() -> None:
    """Every refusal reason reached, each a 400 (a compiled exception check once turned
    ``1e400`` into a 500), and the compiled build gives the same rows."""
    rows = compiled.body_trace()
    assert {r[0] for r in rows} == {"ok", 400}
    assert sum(r[0] == 400 for r in rows) == len(compiled.BODIES) - 2
    build = compiled.cached()
    if build is None:
        pytest.skip("no mypyc build cached for these sources: python -m kvgate_bench.compiled")
    assert compiled.compiled_body_trace(build) == rows


def test_the_overlay_puts_a_builds_extension_modules_over_this_checkouts_sources(
    tmp_path: Path,
) -> None:
    """A build keeps the sources it was made from; the overlay takes every module from the
    checkout (so a module added since, e.g. the server leg's, is there) and only the compiled
    extension modules from the build."""
    build = tmp_path / "build"
    (build / "kvgate_agent" / "admission").mkdir(parents=True)
    (
        build / "kvgate_agent" / "admission" / "controller.cpython-311-x86_64-linux-gnu.so"
    ).write_bytes(b"so")
    (build / "kvgate_agent" / "admission" / "controller.py").write_text("# stale copy")
    (build / "abc__mypyc.cpython-311-x86_64-linux-gnu.so").write_bytes(b"runtime")
    dest = compiled.overlay(build, tmp_path / "overlay")
    pkg = dest / "kvgate_agent"
    assert (pkg / "admission" / "controller.cpython-311-x86_64-linux-gnu.so").read_bytes() == b"so"
    assert (dest / "abc__mypyc.cpython-311-x86_64-linux-gnu.so").read_bytes() == b"runtime"
    checkout = compiled.AGENT / "admission" / "controller.py"
    assert (pkg / "admission" / "controller.py").read_text() == checkout.read_text()
    assert (pkg / "sidecar" / "edge" / "client_conn.py").exists()
    assert not list(pkg.rglob("__pycache__"))


def test_the_sidecar_answers_http_the_same_every_time() -> None:
    """The HTTP trace the compiled build is compared on (:func:`compiled_http.http_trace`): every
    case answered, deterministic on the sources."""
    rows = compiled_http.http_trace()
    names = [c[0] for c in compiled_http.HTTP_CASES]
    assert [r[0] for r in rows] == names
    answers: dict[str, Any] = {str(r[0]): r[1] for r in rows}
    status = {name: [a[0] for a in got] for name, got in answers.items()}
    assert status["chat"] == status["stream"] == ["HTTP/1.1 200 OK"]
    assert status["pipelined"] == ["HTTP/1.1 200 OK"] * 2
    assert status["bad-json"] == status["malformed"] == ["HTTP/1.1 400 Bad Request"]
    stream = answers["stream"][0][2]
    assert "data: [DONE]" in stream and "tok" in stream
    assert rows == compiled_http.http_trace()


def test_compiled_legs_serve_http_as_the_sources(tmp_path: Path) -> None:
    """A sidecar whose server leg, upstream leg and pipeline are the compiled modules (every
    listed module imports compiled in that process) answers a chat request, a streamed one and
    the other cases of :data:`compiled_http.HTTP_CASES` with the same bytes as the sources."""
    build = compiled.cached()
    if build is None:
        pytest.skip("no mypyc build cached for these sources: python -m kvgate_bench.compiled")
    assert compiled.compiled_http_trace(build, tmp_path) == compiled_http.http_trace()
