"""kvgate's priority (higher = more important) translated into an engine's ``priority`` field."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from kvgate_agent.contract.policy import MAX_PRIORITY, MIN_PRIORITY, PriorityTarget
from kvgate_agent.sidecar.identity.tenants import engine_priority

PRIORITIES = [MIN_PRIORITY, -7, -1, 0, 1, 3, 250, MAX_PRIORITY]


def test_vllm_gets_the_negated_priority_and_sglang_the_priority_as_is() -> None:
    assert [engine_priority(p, PriorityTarget.VLLM) for p in (-5, 0, 5)] == [5, 0, -5]
    assert [engine_priority(p, PriorityTarget.SGLANG) for p in (-5, 0, 5)] == [-5, 0, 5]
    assert engine_priority(0, PriorityTarget.VLLM) == 0
    assert all(engine_priority(p, PriorityTarget.NONE) is None for p in PRIORITIES)


@pytest.mark.parametrize(
    ("target", "engine_serves_first"),
    [(PriorityTarget.VLLM, min), (PriorityTarget.SGLANG, max)],
)
def test_the_engine_serves_first_what_kvgate_ranks_higher(
    target: PriorityTarget, engine_serves_first: Callable[[int, int], int]
) -> None:
    """vLLM serves the lowest value first, SGLang the highest: either way the request kvgate
    ranks higher of any two is the one the engine picks, and equal stays equal."""
    for a, b in itertools.product(PRIORITIES, repeat=2):
        ea, eb = engine_priority(a, target), engine_priority(b, target)
        assert ea is not None and eb is not None
        if a == b:
            assert ea == eb
        else:
            first = engine_serves_first(ea, eb)
            assert (first == ea) == (a > b), (target, a, b)
