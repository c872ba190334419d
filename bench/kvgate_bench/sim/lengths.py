"""True output lengths (where the model emits EOS) for requests that do not say theirs.

A real model stops when it emits EOS, usually long before ``max_tokens``. The
load generator tells kvgate-sim each request's true length in the
simulator-only header ``x-sim-output-tokens`` (the kvgate sidecar forwards
unknown headers untouched and never reads this one). Without the header the
simulator asks an :class:`OutputLengths`:

* ``max`` (the default): no true length; the request runs to ``max_tokens``
  (finish_reason ``length``), kvgate-sim's behaviour before true lengths.
* ``lognormal``: a seeded draw, ``max(1, round(exp(N(mu, sigma))))`` tokens,
  by default mu 5.02, sigma 0.86 (median e^5.02 = 151 tokens): the issue's
  lognormal fit of the conversation outputs of the Azure LLM inference trace
  2023 (https://github.com/Azure/AzurePublicDataset/blob/master/AzureLLMInferenceDataset2023.md).

The engine caps a true length at ``max_tokens``. Pure: the only state is the
seeded ``random.Random``; no clock, no I/O.
"""

from __future__ import annotations

import random

#: Simulator-only request header carrying the true output length, tokens (EOS included).
OUTPUT_TOKENS_HEADER = "x-sim-output-tokens"
#: ``kvgate-sim --output-lengths`` choices, the default first.
OUTPUT_LENGTH_MODES: tuple[str, ...] = ("max", "lognormal")
#: Lognormal fit of the Azure 2023 conversation trace's output lengths (tokens).
AZURE_CONVERSATION_OUTPUT_MU = 5.02
AZURE_CONVERSATION_OUTPUT_SIGMA = 0.86


class OutputLengths:
    """Source of true output lengths for requests without ``x-sim-output-tokens``.

    Args:
        mode: ``"max"`` (:meth:`draw` returns ``None``: run to ``max_tokens``)
            or ``"lognormal"`` (seeded draws).
        seed: seed of the draws; the same seed gives the same sequence.
        mu, sigma: parameters of the log of the length (natural log of tokens).

    Raises ``ValueError`` for an unknown mode or ``sigma < 0``.
    """

    def __init__(
        self,
        mode: str = "max",
        seed: int = 0,
        mu: float = AZURE_CONVERSATION_OUTPUT_MU,
        sigma: float = AZURE_CONVERSATION_OUTPUT_SIGMA,
    ) -> None:
        if mode not in OUTPUT_LENGTH_MODES:
            raise ValueError(
                f"unknown output-lengths mode {mode!r}; choose one of "
                + ", ".join(OUTPUT_LENGTH_MODES)
            )
        if sigma < 0:
            raise ValueError("sigma must be >= 0")
        self.mode, self.mu, self.sigma = mode, mu, sigma
        self._rng = random.Random(seed)

    def draw(self) -> int | None:
        """The next true length in tokens (>= 1), or ``None`` in ``max`` mode."""
        if self.mode == "max":
            return None
        return max(1, round(self._rng.lognormvariate(self.mu, self.sigma)))


def parse_output_tokens(value: str | None) -> int | None:
    """The ``x-sim-output-tokens`` header as a length in tokens; ``None`` if absent.

    Raises ``ValueError`` unless the value is a decimal integer >= 1.
    """
    if value is None:
        return None
    text = value.strip()
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise ValueError(f"{OUTPUT_TOKENS_HEADER} must be an integer >= 1, got {value!r}")
    return int(text)
