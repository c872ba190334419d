"""True output lengths: the seeded lognormal draw and the x-sim-output-tokens header."""

from __future__ import annotations

import math
import statistics

import pytest

from kvgate_bench.sim.lengths import OutputLengths, parse_output_tokens


def test_max_mode_draws_nothing() -> None:
    src = OutputLengths()
    assert [src.draw() for _ in range(5)] == [None] * 5


def test_lognormal_draw_is_reproducible_and_fits_its_parameters() -> None:
    a = OutputLengths("lognormal", seed=42)
    b = OutputLengths("lognormal", seed=42)
    first = [a.draw() for _ in range(4000)]
    assert first == [b.draw() for _ in range(4000)]
    assert first[:50] != [OutputLengths("lognormal", seed=43).draw() for _ in range(50)]
    values = [v for v in first if v is not None]
    assert len(values) == 4000 and min(values) >= 1
    # Median e^5.02 ~ 151 tokens; log-sd 0.86 (rounding to integers barely moves either).
    assert statistics.median(values) == pytest.approx(math.exp(5.02), rel=0.08)
    assert statistics.stdev(math.log(v) for v in values) == pytest.approx(0.86, rel=0.08)


def test_invalid_modes_raise() -> None:
    with pytest.raises(ValueError, match="unknown output-lengths mode"):
        OutputLengths("uniform")
    with pytest.raises(ValueError):
        OutputLengths("lognormal", sigma=-1.0)


@pytest.mark.parametrize(("raw", "value"), [(None, None), ("7", 7), (" 12 ", 12), ("1", 1)])
def test_header_parses(raw: str | None, value: int | None) -> None:
    assert parse_output_tokens(raw) == value


@pytest.mark.parametrize("raw", ["0", "-3", "abc", "", "1.5", "²"])
def test_bad_header_raises(raw: str) -> None:
    with pytest.raises(ValueError, match="x-sim-output-tokens"):
        parse_output_tokens(raw)
