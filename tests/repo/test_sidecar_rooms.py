"""The sidecar's layout (issue 35): a thin top of at most 8 modules, every sub-package a room
with a curated face (an ``__init__`` whose docstring says what the room does and whose
``__all__`` names what it re-exports, each name bound), a request pipeline of at most 6
collaborators, and one admission object: nothing outside ``admission/`` reaches its controller
through ``AsyncAdmission.core``."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import kvgate_agent.sidecar
from kvgate_agent.sidecar.pipeline import RequestPipeline

SIDECAR = Path(kvgate_agent.sidecar.__file__).parent
AGENT = SIDECAR.parent
ROOMS = sorted(p.name for p in SIDECAR.iterdir() if (p / "__init__.py").is_file())


def test_the_top_is_thin() -> None:
    top = sorted(p.name for p in SIDECAR.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 8, top


def test_every_room_has_a_curated_face() -> None:
    assert {"edge", "reading", "identity", "upstream", "engine", "node_link", "store"} <= set(ROOMS)
    for room in ROOMS:
        tree = ast.parse((SIDECAR / room / "__init__.py").read_text())
        assert ast.get_docstring(tree), (
            f"sidecar/{room}/__init__.py: a docstring saying what it does"
        )
        module = importlib.import_module(f"kvgate_agent.sidecar.{room}")
        names = getattr(module, "__all__", None)
        assert names, f"sidecar/{room}/__init__.py: __all__ naming what other rooms use"
        assert all(hasattr(module, n) for n in names), room


def test_the_pipeline_takes_one_object_per_room() -> None:
    params = inspect.signature(RequestPipeline.__init__).parameters
    assert len(params) - 1 <= 6, list(params)


def test_nothing_outside_admission_reaches_its_core() -> None:
    reach = [
        f"{path.relative_to(AGENT).as_posix()}:{node.lineno}"
        for path in sorted(AGENT.rglob("*.py"))
        if "admission" not in path.relative_to(AGENT).parts[:1]
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "core"
    ]
    assert not reach, f"read admission through AsyncAdmission's own methods: {reach}"
