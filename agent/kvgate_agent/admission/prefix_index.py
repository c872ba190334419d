"""The expected cached prefix of a prompt: a bounded index of recently admitted prompts' KV
block hashes, discounted by how often the engine confirmed such hits.

An engine with automatic prefix caching (vLLM's, after
https://docs.vllm.ai/en/latest/design/prefix_caching.html; SGLang's radix cache; llama.cpp's
slot cache) names each *full* KV block of a prompt by a chained hash (the parent block's hash and
this block's tokens), so two prompts share a block's hash only when their whole prefixes match.
A request whose leading blocks are still cached is not prefilled there: the engine reuses those
blocks and reports them (``usage.prompt_tokens_details.cached_tokens``).

A caller that can name the prompt's leading full blocks the same way passes their hashes
(``AdmissionRequest.prefix_blocks``: block ``i`` covers tokens ``[i*B, (i+1)*B)``, ``B`` the
policy's ``model.blockSize``). :class:`PrefixIndex` keeps the hashes of the prompts it admitted
recently (an LRU, at most ``max_blocks`` hashes, refreshed at every admission) and answers, in
O(prompt blocks), the longest run of a new prompt's leading blocks it holds (the *run*, tokens),
at most the prompt less one block (an engine always computes at least the last token), times
``trust``: the engine's confirmation so far, an EWMA of reported cached tokens / run over the
settled requests that had a run (:data:`TRUST_ALPHA`), starting at :data:`TRUST_START`. The
expected cached prefix is that product rounded down to whole blocks.

Limits: the index cannot see the engine's evictions (hence the confirmation), nor the blocks of
an answer (only prompts' hashes are known here), and a caller's hashes only stand for the
engine's where both cut the same tokens into the same blocks. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

#: The trust in the index's runs before the engine confirmed any (the share of a run expected
#: cached). Chosen on the multi-turn workload's seed 1 (docs/benchmarks.md, issue 23 part 4).
TRUST_START: Final = 0.5
#: Weight of each settled request's confirmation (reported cached tokens / run) in ``trust``.
TRUST_ALPHA: Final = 0.05
#: Block hashes the index keeps by default (16-token blocks: about 1M tokens of prompts; about
#: 100 bytes each).
MAX_BLOCKS: Final = 65_536


class PrefixIndex:
    """The recently admitted prompts' block hashes (LRU) and the engine's confirmation.

    Args:
        max_blocks: hashes kept at most (the least recently admitted go first).

    Attributes:
        trust: the share of a run expected cached, in [0, 1] (module docstring).
    """

    __slots__ = ("_blocks", "max_blocks", "trust")

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.max_blocks = max(1, max_blocks)
        self.trust = TRUST_START

    def __len__(self) -> int:
        return len(self._blocks)

    def run(self, hashes: Sequence[int], prompt_tokens: int, block_size: int) -> int:
        """Tokens of the longest run of ``hashes`` (a prompt of ``prompt_tokens`` tokens' leading
        full blocks of ``block_size`` tokens) held here, at most the prompt less one block."""
        blocks = self._blocks
        limit = max(0, prompt_tokens - block_size) // block_size
        n = 0
        for h in hashes:
            if n >= limit or h not in blocks:
                break
            n += 1
        return n * block_size

    def expect(self, run: int, block_size: int) -> int:
        """The cached tokens expected of a ``run``-token run: ``run x trust`` rounded down to
        whole blocks of ``block_size`` tokens."""
        return int(run * self.trust) // block_size * block_size

    def remember(self, hashes: Sequence[int]) -> None:
        """An admitted prompt's block hashes are the most recent now; the least recent past
        ``max_blocks`` are forgotten. O(len(hashes))."""
        blocks = self._blocks
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def confirm(self, run: int, cached_tokens: int) -> None:
        """A settled request whose prompt had a ``run``-token run here was reported
        ``cached_tokens`` cached by the engine: ``trust`` moves toward their ratio (at most 1).
        A no-op when ``run`` is 0."""
        if run <= 0:
            return
        ratio = min(1.0, max(0, cached_tokens) / run)
        self.trust += TRUST_ALPHA * (ratio - self.trust)
