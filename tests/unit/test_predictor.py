"""The output-length predictor: a decaying histogram quantile per (tenant, model, band)."""

from __future__ import annotations

import math
import random

import pytest

from kvgate_agent.admission.predictor import (
    _EDGES,
    BIN_RATIO,
    BINS,
    DECAY,
    MIN_SAMPLES,
    LengthPredictor,
    _bin,
    band,
)


def feed(p: LengthPredictor, values: list[int], tenant: str = "a", max_tokens: int = 4096) -> None:
    for v in values:
        p.observe(tenant, "m", max_tokens, v)


def weighted_quantile(values: list[int], q: float) -> int:
    """The exact ``q`` quantile of ``values`` weighted by DECAY^(age): the smallest value whose
    cumulative weight (values sorted ascending) reaches ``q`` of the total."""
    n = len(values)
    weighted = sorted((v, DECAY ** (n - 1 - i)) for i, v in enumerate(values))
    total = sum(w for _, w in weighted)
    acc = 0.0
    for v, w in weighted:
        acc += w
        if acc >= q * total - 1e-9:
            return v
    return weighted[-1][0]


def test_band_is_ceil_log2() -> None:
    assert band(256) == 8
    assert band(257) == 9
    assert band(512) == 9
    assert band(4096) == 12
    assert band(1) == 0


@pytest.mark.parametrize("q", [0.5, 0.9, 0.99])
def test_quantile_of_known_distribution_within_bin_error(q: float) -> None:
    rng = random.Random(7)
    values = [rng.randint(50, 2000) for _ in range(3000)]
    p = LengthPredictor(quantile=q)
    feed(p, values)
    pred = p.predict("a", "m", 4096)
    assert pred is not None
    # Against the exact decayed quantile of the same samples: the upper edge of its bin.
    exact_w = weighted_quantile(values, q)
    assert exact_w <= pred < BIN_RATIO * exact_w
    # Against the distribution's own quantile: within the bin error plus the sampling noise of
    # an effective window of ~200 samples (a few percent at these quantiles).
    exact = 50 + q * (2000 - 50)
    assert abs(pred - exact) <= (BIN_RATIO - 1 + 0.05) * exact


def test_none_before_min_samples() -> None:
    p = LengthPredictor()
    feed(p, [100] * (MIN_SAMPLES - 1))
    assert p.predict("a", "m", 4096) is None
    feed(p, [100])
    pred = p.predict("a", "m", 4096)
    assert pred is not None and 100 <= pred < 100 * BIN_RATIO


def test_unknown_model_or_band_is_none() -> None:
    p = LengthPredictor()
    feed(p, [100] * 50)
    assert p.predict("a", "other-model", 4096) is None
    assert p.predict("a", None, 4096) is None


def test_pooled_fallback_serves_a_new_tenant() -> None:
    p = LengthPredictor()
    feed(p, [300] * 40, tenant="a")
    a = p.predict("a", "m", 4096)
    assert a is not None
    assert p.predict("new", "m", 4096) == a  # pooled key: only a's samples so far
    # A tenant with a few samples of its own (under MIN_SAMPLES) still reads the pooled key.
    feed(p, [10] * 5, tenant="b")
    assert p.predict("b", "m", 4096) == p.predict("new", "m", 4096)
    # Once it has enough, its own key answers.
    feed(p, [10] * MIN_SAMPLES, tenant="b")
    b = p.predict("b", "m", 4096)
    assert b is not None and 10 <= b < 10 * BIN_RATIO + 1


def test_bands_are_separate() -> None:
    p = LengthPredictor()
    feed(p, [100] * 30, max_tokens=256)
    assert p.predict("a", "m", 4096) is None  # another band
    assert p.predict("a", "m", 200) == p.predict("a", "m", 256)  # same band (8)
    feed(p, [3000] * 30, max_tokens=4096)
    small, large = p.predict("a", "m", 256), p.predict("a", "m", 4096)
    assert small is not None and large is not None
    assert 100 <= small < 100 * BIN_RATIO
    assert 3000 <= large < 3000 * BIN_RATIO


def test_decay_follows_a_downward_shift_within_300_samples() -> None:
    p = LengthPredictor(quantile=0.9)
    feed(p, [1000] * 500)
    before = p.predict("a", "m", 4096)
    assert before is not None and 1000 <= before < 1000 * BIN_RATIO
    feed(p, [100] * 100)
    # After 100 samples the old ones still weigh 0.99^100 = 37 % > 10 %: the 0.9 quantile stays.
    assert p.predict("a", "m", 4096) == before
    feed(p, [100] * 200)
    # After 300 they weigh 0.99^300 = 5 % < 10 %: it follows the new distribution.
    after = p.predict("a", "m", 4096)
    assert after is not None and 100 <= after < 100 * BIN_RATIO


def test_decay_follows_an_upward_shift() -> None:
    p = LengthPredictor(quantile=0.9)
    feed(p, [100] * 500)
    feed(p, [1000] * 300)
    after = p.predict("a", "m", 4096)
    assert after is not None and 1000 <= after < 1000 * BIN_RATIO


def test_max_keys_bound_evicts_least_recently_updated() -> None:
    p = LengthPredictor(max_keys=3)
    feed(p, [1000] * 30, tenant="t0")
    feed(p, [10] * 400, tenant="t1")
    assert len(p) == 3  # t0, t1 and the pooled key
    assert p.predict("t0", "m", 4096) is not None
    t0 = p.predict("t0", "m", 4096)
    assert t0 is not None and t0 >= 1000
    feed(p, [10], tenant="t2")  # a fourth key: t0 (least recently updated) goes
    assert len(p) == 3
    pooled = p.predict("t0", "m", 4096)
    assert pooled is not None and pooled < 1000 < t0  # now the pooled key answers for t0
    for i in range(50):
        feed(p, [10], tenant=f"x{i}")
        assert len(p) <= 3


@pytest.mark.parametrize("q", [0.0, 0.49, 1.0, 1.5, -1.0, math.nan])
def test_bad_quantile_raises(q: float) -> None:
    with pytest.raises(ValueError, match="quantile"):
        LengthPredictor(quantile=q)
    p = LengthPredictor()
    with pytest.raises(ValueError, match="quantile"):
        p.reset_quantile(q)
    assert p.quantile == 0.9


def test_bad_max_keys_raises() -> None:
    with pytest.raises(ValueError, match="max_keys"):
        LengthPredictor(max_keys=0)


def test_reset_quantile_changes_predictions() -> None:
    p = LengthPredictor(quantile=0.9)
    pattern = [10, 1000, 10, 10, 1000, 10, 10, 1000, 10, 10]  # 70 % short, 30 % long
    feed(p, pattern * 40)
    high = p.predict("a", "m", 4096)
    assert high is not None and 1000 <= high < 1000 * BIN_RATIO
    p.reset_quantile(0.5)
    low = p.predict("a", "m", 4096)
    assert low is not None and 10 <= low < 10 * BIN_RATIO + 1
    # The samples stayed: back to 0.9 gives the first answer again.
    p.reset_quantile(0.9)
    assert p.predict("a", "m", 4096) == high
    # The pooled key is re-read too.
    p.reset_quantile(0.5)
    assert p.predict("someone-else", "m", 4096) == low


def test_zero_output_counts_as_one_token() -> None:
    p = LengthPredictor()
    feed(p, [0] * MIN_SAMPLES)
    assert p.predict("a", "m", 4096) == 1


def test_bin_is_the_log_formula() -> None:
    """The binary search over the bin edges gives the bin the logarithm gave (the smallest
    ``i`` >= ``ceil(log(tokens) / log(BIN_RATIO))`` whose edge holds ``tokens``, at most the
    last): every length up to 20 000, every edge and its neighbours, and lengths past the last
    edge (checked for every length up to twice the last edge when the search replaced it)."""

    def by_log(tokens: int) -> int:
        if tokens <= 1:
            return 0
        i = math.ceil(math.log(tokens) / math.log(BIN_RATIO) - 1e-9)
        while i < BINS - 1 and _EDGES[i] < tokens:
            i += 1
        return min(i, BINS - 1)

    lengths = set(range(-2, 20_001))
    lengths |= {e + d for e in _EDGES for d in (-1, 0, 1)}
    lengths |= {_EDGES[-1] * k for k in (2, 10, 1000)}
    assert [t for t in sorted(lengths) if _bin(t) != by_log(t)] == []
