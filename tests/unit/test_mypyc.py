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

import pytest

from kvgate_bench import compiled

AGENT_ROOT = compiled.AGENT.parent
#: Imports a compiled module may not have: the frameworks the import contracts keep out of
#: pure modules (mypyc compiles against their types, and the image's fallback must stay pure).
FRAMEWORKS = {"aiohttp", "fastapi", "uvicorn", "kubernetes", "kopf", "prometheus_client"}


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
        assert not imported & FRAMEWORKS, (rel, imported & FRAMEWORKS)
    # every admission module that AdmissionController.submit/release runs through is compiled,
    # its sub-packages' (fairqueue/) included (async_admission.py is the asyncio driver, the
    # __init__ faces re-export)
    admission = sorted(
        f"kvgate_agent/{p.relative_to(compiled.AGENT).as_posix()}"
        for p in (compiled.AGENT / "admission").rglob("*.py")
        if p.name not in ("__init__.py", "async_admission.py")
    )
    assert [p for p in paths if p.startswith("kvgate_agent/admission/")] == admission
    assert compiled.module_names()[0] == paths[0].removesuffix(".py").replace("/", ".")


def test_the_build_script_reads_the_list() -> None:
    script = compiled.BUILD_SCRIPT.read_text()
    assert "mypyc-modules.txt" in script and '"$mypyc" "${mods[@]}"' in script
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
