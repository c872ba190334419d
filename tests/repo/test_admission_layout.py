"""Admission's layout (issue 35): the fair queue is a sub-package whose modules are named by role
(``share``, ``order``, ``reserve``, ``waitqueue``), and every sub-package of admission has a
curated face: an ``__init__`` whose docstring says what it does and whose ``__all__`` names what
the rest of admission imports from it, each name bound. Who may import what is the import
contracts' (``pyproject.toml``)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import kvgate_agent.admission

ADMISSION = Path(kvgate_agent.admission.__file__).parent
PACKAGES = sorted(p.name for p in ADMISSION.iterdir() if (p / "__init__.py").is_file())


def test_the_fair_queue_is_a_package_of_roles() -> None:
    assert "fairqueue" in PACKAGES
    roles = {p.stem for p in (ADMISSION / "fairqueue").glob("*.py")}
    assert {"share", "order", "reserve", "waitqueue"} <= roles, roles


def test_every_sub_package_has_a_curated_face() -> None:
    for name in PACKAGES:
        tree = ast.parse((ADMISSION / name / "__init__.py").read_text())
        assert ast.get_docstring(tree), f"admission/{name}/__init__.py: a docstring"
        module = importlib.import_module(f"kvgate_agent.admission.{name}")
        names = getattr(module, "__all__", None)
        assert names, f"admission/{name}/__init__.py: __all__ naming what admission uses"
        assert all(hasattr(module, n) for n in names), name
