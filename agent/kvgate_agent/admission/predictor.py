"""Output-length prediction: a decaying high quantile of the outputs the engine reported.

kvgate reserves ``prompt + n x min(max_tokens, L)`` KV tokens for a request instead of the worst
case ``prompt + n x max_tokens``: real outputs are far shorter than what clients send as
max_tokens (the Azure LLM inference trace 2023, conversation: output median 129 tokens, p99 601,
https://github.com/Azure/AzurePublicDataset/blob/master/AzureLLMInferenceDataset2023.md), and
predicting the length instead of reserving the maximum is what S3 (Jin et al., 2023,
https://arxiv.org/abs/2306.06000) measured 6.49x higher throughput from.

``L`` is learned online, per (tenant, model, max_tokens band), from the completion tokens of
settled requests: a histogram over geometric bins whose weights decay by :data:`DECAY` per
sample (an exponentially weighted quantile: recent traffic counts most), read at the policy's
quantile. A key with fewer than :data:`MIN_SAMPLES` samples falls back to the pooled key of
every tenant for that model and band, and that to max_tokens.

Invariant: pure, no clock; :meth:`LengthPredictor.predict` is O(1) (a cached value per key),
:meth:`LengthPredictor.observe` O(1) amortised and runs at release, off the admission path.
Memory is bounded: at most ``max_keys`` keys, the least recently updated evicted first.
"""

from __future__ import annotations

import math
from typing import Final

#: Geometric bin ratio: a prediction is at most 12.5 % above the true quantile (bin upper edge).
BIN_RATIO: Final = 1.125
#: Bins: lengths up to 1.125^BINS (about 1.9 million tokens) are told apart.
BINS: Final = 124
#: Weight kept by older samples on each new one: an effective window of about 1 / (1 - DECAY) =
#: 100 samples.
DECAY: Final = 0.99
#: Samples (undecayed count) a key needs before its quantile is trusted.
MIN_SAMPLES: Final = 20
#: The cached quantile is re-read every this many samples.
REFRESH: Final = 8
#: Weights are rescaled to 1 once a new sample's weight passes this.
_RESCALE_AT: Final = 1e100
#: Upper edge of each bin, tokens (bin 0 holds lengths <= 1).
_EDGES: Final = tuple(math.floor(BIN_RATIO**i) for i in range(BINS))


def band(max_tokens: int) -> int:
    """The max_tokens band: ``ceil(log2(max_tokens))`` (256 -> 8, 257..512 -> 9, ...).

    Requests in one band have similar caps, so censored samples (outputs that hit max_tokens)
    stay comparable."""
    return (max_tokens - 1).bit_length()


def _bin(tokens: int) -> int:
    """The bin of ``tokens``: the first whose upper edge (:data:`_EDGES`) holds it, the last
    for longer outputs. A binary search over the edges in integers (no ``math.log``, which
    mypyc calls as a Python function; tests/unit/test_predictor.py checks it against
    ``ceil(log(tokens) / log(BIN_RATIO))`` for every length up to past the last edge)."""
    if tokens <= 1:
        return 0
    lo, hi = 0, BINS - 1
    while lo < hi:
        mid = (lo + hi) >> 1
        if _EDGES[mid] < tokens:
            lo = mid + 1
        else:
            hi = mid
    return lo


class _Histogram:
    """Decaying weights over the geometric bins of one key, and its cached quantile.

    Decay by :data:`DECAY` per sample is done by growing the new sample's weight by 1 / DECAY
    instead of shrinking all the others (the same ratios, O(1) per sample); the weights are
    rescaled before they could overflow. The quantile is re-read every :data:`REFRESH`
    samples (O(:data:`BINS`), so O(1) amortised)."""

    __slots__ = ("count", "quantile", "step", "total", "weights")

    def __init__(self) -> None:
        self.weights = [0.0] * BINS
        self.total = 0.0
        self.step = 1.0
        self.count = 0
        self.quantile = 0

    def add(self, tokens: int, q: float) -> None:
        self.weights[_bin(tokens)] += self.step
        self.total += self.step
        self.step /= DECAY
        self.count += 1
        if self.step > _RESCALE_AT:
            w = self.weights
            for i in range(BINS):
                w[i] /= self.step
            self.total /= self.step
            self.step = 1.0
        if self.count % REFRESH == 0 or self.count == MIN_SAMPLES:
            self.read(q)

    def read(self, q: float) -> None:
        """Refresh the cached ``q`` quantile: the upper edge of the bin where the cumulative
        weight reaches ``q`` of the total, tokens."""
        w = self.weights
        target = q * self.total * (1 - 1e-12)
        acc = 0.0
        for i in range(BINS):
            acc += w[i]
            if acc >= target:
                self.quantile = _EDGES[i]
                return
        self.quantile = _EDGES[BINS - 1]


class LengthPredictor:
    """Predicted output tokens per choice, by (tenant, model, max_tokens band).

    Args:
        quantile: the quantile read, in [0.5, 1) (the policy's ``reservationQuantile``).
        max_keys: bound on the keys kept (tenant keys; the pooled keys count too).

    Raises:
        ValueError: ``quantile`` outside [0.5, 1) or ``max_keys`` < 1.
    """

    __slots__ = ("_keys", "max_keys", "quantile")

    def __init__(self, quantile: float = 0.9, max_keys: int = 10_000) -> None:
        if not 0.5 <= quantile < 1.0:
            raise ValueError(f"quantile must be in [0.5, 1), got {quantile}")
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.quantile = quantile
        self.max_keys = max_keys
        self._keys: dict[tuple[str | None, str | None, int], _Histogram] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def predict(self, tenant: str, model: str | None, max_tokens: int) -> int | None:
        """Predicted output tokens per choice for a request with ``max_tokens`` (not capped by
        it: the caller takes the min); None while neither the tenant's key nor the pooled key
        has :data:`MIN_SAMPLES` samples."""
        b = (max_tokens - 1).bit_length()
        h = self._keys.get((tenant, model, b))
        if h is not None and h.count >= MIN_SAMPLES:
            return h.quantile
        h = self._keys.get((None, model, b))
        if h is not None and h.count >= MIN_SAMPLES:
            return h.quantile
        return None

    def observe(self, tenant: str, model: str | None, max_tokens: int, output_tokens: int) -> None:
        """Learn one settled request: ``output_tokens`` per choice (>= 0) produced under
        ``max_tokens``. Counted under the tenant's key and the pooled key."""
        b = band(max_tokens)
        tokens = max(1, output_tokens)
        self._sample((tenant, model, b), tokens)
        self._sample((None, model, b), tokens)

    def _sample(self, key: tuple[str | None, str | None, int], tokens: int) -> None:
        """Count ``tokens`` under ``key``, which becomes the most recently updated."""
        keys = self._keys
        h = keys.get(key)
        if h is None:
            h = _Histogram()
            if len(keys) >= self.max_keys:
                del keys[next(iter(keys))]
        else:
            del keys[key]  # (a dict's get and del: mypyc calls pop as a Python method)
        keys[key] = h  # most recently updated last
        h.add(tokens, self.quantile)

    def reset_quantile(self, quantile: float) -> None:
        """Read ``quantile`` from now on (a changed policy); the samples stay. O(keys x
        :data:`BINS`). Raises ``ValueError`` as the constructor."""
        if not 0.5 <= quantile < 1.0:
            raise ValueError(f"quantile must be in [0.5, 1), got {quantile}")
        if quantile != self.quantile:
            self.quantile = quantile
            for h in self._keys.values():
                h.read(quantile)
