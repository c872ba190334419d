"""The bench distribution stays readable too: no module of ``bench/kvgate_bench`` over 450 lines
and no class there over 300 lines (the shipped packages' own limits are in
``test_module_sizes.py``). A module past the limit is split by job, not by line count."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = sorted((REPO / "bench" / "kvgate_bench").rglob("*.py"))
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 300


def test_the_bench_modules_are_found() -> None:
    names = {p.relative_to(REPO).as_posix() for p in BENCH}
    assert "bench/kvgate_bench/effectiveness/model/driver.py" in names
    assert "bench/kvgate_bench/kit/controlplane.py" in names


@pytest.mark.parametrize("path", BENCH, ids=lambda p: p.relative_to(REPO).as_posix())
def test_module_and_class_sizes(path: Path) -> None:
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_MODULE_LINES, f"split {path.name} by job"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.ClassDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    ]
    assert not long, f"{path.name}: split these classes by job: {', '.join(long)}"
