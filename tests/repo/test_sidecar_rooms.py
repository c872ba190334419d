"""The sidecar's layout (issue 35): a thin top of at most 8 modules, and every sub-package a room
with a curated face: an ``__init__`` whose docstring says what the room does and whose
``__all__`` names what it re-exports, each name bound."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import kvgate_agent.sidecar

SIDECAR = Path(kvgate_agent.sidecar.__file__).parent
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
