"""The house stays readable: no module of the shipped packages (``agent/``, ``operator/``) over
600 lines and no function there over 80 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p for top in ("agent", "operator") for p in (REPO / top).rglob("*.py"))
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def test_the_shipped_packages_are_found() -> None:
    names = {p.relative_to(REPO).as_posix() for p in SHIPPED}
    assert "agent/kvgate_agent/admission/controller.py" in names
    assert "operator/kvgate_operator/handlers.py" in names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.relative_to(REPO).as_posix())
def test_module_and_function_sizes(path: Path) -> None:
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_MODULE_LINES, f"split {path.name} by job"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.name}: {', '.join(long)}"
