"""The engine model's KV block pool with automatic prefix caching, after vLLM V1's
(https://docs.vllm.ai/en/latest/design/prefix_caching.html).

A sequence's tokens are cut into blocks of ``block_size`` tokens. A *full* block whose content is
known is identified by a chained hash, ``hash((parent block's hash, this block's content key))``
(:func:`chain_hash`), so that two blocks share a hash only when their whole prefixes match. What
a sequence's content is, the caller says with :data:`BlockKeys`: block index -> content key, or
``None`` for content that is the sequence's own (never shared; the chain stops there).

The pool of ``num_blocks`` blocks is always split three ways (``used + cached + empty ==
num_blocks``):

* **used**: referenced by at least one running sequence. A cached block shared by several
  sequences is counted once (reference-counted).
* **cached**: referenced by none, but holding the KV of a known prefix: a later sequence with
  the same prefix reuses it instead of prefilling it. Cached blocks count as *free* (vLLM's KV
  usage is ``1 - free / total``): a new allocation that finds no empty block evicts them, least
  recently used first (vLLM's free-block queue order: a sequence's blocks are released tail
  first, so a prefix's tail goes before its head).
* **empty**: holding nothing reusable.

Simplifications against vLLM: one pool counter of empty blocks rather than block ids (an
allocation takes an empty block before it evicts a cached one); a block whose hash is already
cached when it fills stays the sequence's own (vLLM keeps a duplicate too). Hashes are Python's
``hash`` of tuples: equal prefixes always collide, others practically never (64 bits).

Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

#: A sequence's content, block by block: block index (0-based) -> content key, or ``None`` for
#: content no other sequence shares (not cached, and the chain of hashes stops there).
BlockKeys = Callable[[int], Hashable | None]


def chain_hash(parent: int | None, key: Hashable) -> int:
    """The hash of a block with content ``key`` after a block hashed ``parent`` (None: the first
    block)."""
    return hash((parent, key))


def extend_chain(chain: list[int], keys: BlockKeys | None, blocks: int) -> list[int]:
    """Extend ``chain``, the hashes of a sequence's leading full blocks, in place to ``blocks``
    blocks, or fewer where ``keys`` stops knowing the content (a ``None`` key, or no keys);
    returns it."""
    if keys is None:
        return chain
    while len(chain) < blocks:
        key = keys(len(chain))
        if key is None:
            break
        chain.append(chain_hash(chain[-1] if chain else None, key))
    return chain


@dataclass(frozen=True, slots=True)
class SessionKeys:
    """The blocks of a conversation's tokens: block ``i`` is ``(session, i)`` whatever the turn,
    as each turn's prompt resends the conversation so far (prompts and answers) and appends to
    it. Covers the output tokens too, so that the next turn reuses the answer's blocks."""

    session: str

    def __call__(self, index: int) -> Hashable | None:
        return (self.session, index)


@dataclass(frozen=True, slots=True)
class GroupKeys:
    """The blocks of a prompt that starts with a prefix a group of requests shares (an
    application's system prompt and tools): block ``i`` is ``(group, i)`` for the first
    ``blocks`` blocks (the prefix's full blocks: the engine hashes full blocks only), and the
    request's own content after (no key: the chain stops there)."""

    group: str
    blocks: int

    def __call__(self, index: int) -> Hashable | None:
        return (self.group, index) if index < self.blocks else None


@dataclass(frozen=True, slots=True)
class ListedKeys:
    """Explicit content keys for the first ``len(keys)`` blocks (e.g. the prompt's full blocks
    of tokens); every later block is the sequence's own."""

    keys: tuple[Hashable, ...]

    def __call__(self, index: int) -> Hashable | None:
        return self.keys[index] if index < len(self.keys) else None


def token_block_keys(tokens: Seq[Hashable], block_size: int) -> ListedKeys:
    """The keys of the full blocks of ``tokens``: block ``i`` is the tuple of its
    ``block_size`` tokens (a partial tail block gets none)."""
    full = len(tokens) // block_size
    return ListedKeys(
        tuple(tuple(tokens[i * block_size : (i + 1) * block_size]) for i in range(full))
    )


class BlockPool:
    """``num_blocks`` KV blocks: used, cached (evictable, LRU) and empty (module docstring).

    With ``enabled`` False nothing is ever cached: :meth:`lookup` finds nothing, :meth:`register`
    keeps nothing, and the pool is the plain used/free counter of an engine without a prefix
    cache. Every count is in blocks.
    """

    def __init__(self, num_blocks: int, enabled: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enabled = enabled
        #: Blocks referenced by running sequences, each counted once.
        self.used = 0
        #: Cached blocks' reference counts (> 0), by hash.
        self._refs: dict[int, int] = {}
        #: Cached blocks nobody references, least recently used first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        #: Cached blocks evicted so far.
        self.evictions = 0

    @property
    def cached(self) -> int:
        """Blocks holding a cached prefix that no sequence references (evictable)."""
        return len(self._lru)

    @property
    def empty(self) -> int:
        """Blocks holding nothing reusable."""
        return self.num_blocks - self.used - len(self._lru)

    @property
    def free(self) -> int:
        """Blocks an allocation may take: empty plus cached (evicted on demand)."""
        return self.num_blocks - self.used

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._refs or block_hash in self._lru

    def lookup(self, hashes: Seq[int]) -> int:
        """How many leading blocks of ``hashes`` are cached (0 when disabled)."""
        if not self.enabled:
            return 0
        n = 0
        for h in hashes:
            if h not in self:
                break
            n += 1
        return n

    def evictable(self, hashes: Seq[int]) -> int:
        """How many of ``hashes`` (all cached) nobody references: taking them costs free blocks."""
        return sum(1 for h in hashes if h in self._lru)

    def take(self, n: int) -> None:
        """Allocate ``n`` blocks for a sequence's own content: empty ones first, then evict
        cached ones, least recently used first. The caller checked ``n <= free``."""
        evict = n - min(n, self.empty)
        for _ in range(evict):
            self._lru.popitem(last=False)
        self.evictions += evict
        self.used += n

    def acquire(self, hashes: Seq[int]) -> None:
        """Reference the cached blocks ``hashes`` (a cache hit): one more sequence shares each;
        an unreferenced one leaves the LRU and counts as used again."""
        for h in hashes:
            if h in self._lru:
                del self._lru[h]
                self._refs[h] = 1
                self.used += 1
            else:
                self._refs[h] += 1

    def register(self, block_hash: int) -> bool:
        """A sequence's own, just-filled block holds the prefix ``block_hash``: cache it (True,
        referenced once), or False when disabled or that prefix is already cached (the block
        stays the sequence's own)."""
        if not self.enabled or block_hash in self:
            return False
        self._refs[block_hash] = 1
        return True

    def release(self, hashes: Seq[int], own: int) -> None:
        """A sequence lets go of its cached blocks ``hashes`` (in block order) and its ``own``
        blocks: its own become empty, each cached one nobody references any more joins the LRU's
        most recent end, the tail first (evicted before the head)."""
        self.used -= own
        for h in reversed(hashes):
            left = self._refs[h] - 1
            if left:
                self._refs[h] = left
            else:
                del self._refs[h]
                self._lru[h] = None
                self.used -= 1


class CachedSequence(Protocol):
    """What the cache reads and writes of an engine's sequence
    (:class:`kvgate_bench.sim.sequences.Sequence`): its content keys, the hashes of its leading
    full blocks so far (``chain``), those of the cached blocks it references (``held``), how
    many of its blocks were offered to the cache (``registered``), the blocks it holds in all
    (``blocks``) and its tokens with KV (``num_computed``) out of ``num_tokens``."""

    block_keys: BlockKeys | None
    chain: list[int]
    held: list[int]
    registered: int
    blocks: int
    num_computed: int

    @property
    def num_tokens(self) -> int: ...


class _Reserve(Protocol):
    """The engine configuration's block size and watermark, in tokens and blocks."""

    @property
    def block_size(self) -> int: ...

    @property
    def watermark_blocks(self) -> int: ...


def cache_hit(pool: BlockPool, seq: CachedSequence, block_size: int) -> list[int]:
    """The cached leading blocks of a waiting ``seq`` (at most ``num_tokens - 1`` tokens'
    worth: one is always computed), as hashes; empty without a cache or content keys."""
    if not pool.enabled or seq.block_keys is None:
        return []
    chain = extend_chain(seq.chain, seq.block_keys, (seq.num_tokens - 1) // block_size)
    return chain[: pool.lookup(chain)]


def admit_on_hit(
    pool: BlockPool, seq: CachedSequence, hit: list[int], num_new: int, config: _Reserve
) -> bool:
    """Admit a waiting ``seq`` on its cached blocks ``hit`` plus ``num_new`` tokens to compute,
    if the blocks it takes (new ones, and cached ones nobody referenced) fit above the
    ``config``'s watermark; False (nothing changed) otherwise. Its computed tokens start at the
    hit's."""
    hit_tokens = len(hit) * config.block_size
    need = -(-(hit_tokens + num_new) // config.block_size) - len(hit)
    if need + pool.evictable(hit) > pool.free - config.watermark_blocks:
        return False
    pool.acquire(hit)
    pool.take(need)
    seq.held = list(hit)
    seq.blocks = len(hit) + need
    seq.registered = len(hit)
    seq.num_computed = hit_tokens
    return True


def register_blocks(pool: BlockPool, seq: CachedSequence, block_size: int) -> None:
    """Offer ``seq``'s newly computed full blocks to the cache (those it keeps are ``held``)."""
    if not pool.enabled or seq.block_keys is None:
        return
    full = seq.num_computed // block_size
    # The chain may run ahead of the computed blocks (``cache_hit`` extends it over the whole
    # prompt): only blocks whose KV is computed are offered.
    known = min(full, len(extend_chain(seq.chain, seq.block_keys, full)))
    for j in range(seq.registered, known):
        if pool.register(seq.chain[j]):
            seq.held.append(seq.chain[j])
    seq.registered = max(seq.registered, known)
