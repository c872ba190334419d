"""The routers of the pool benchmark (:mod:`kvgate_bench.effectiveness.pool`) and Envoy's retries.

``random``
    kube-proxy's choice for a ClusterIP Service: a uniformly random endpoint per connection
    (iptables mode's ``statistic --mode random``; a connection per request here). It never
    retries: the client sees what the replica answered.
``least-request``
    Envoy's ``LEAST_REQUEST`` load balancer as Istio configures it by default: two distinct
    endpoints drawn at random, the one with fewer active requests (sent to it and not
    answered) wins (the power of two choices, ``choice_count`` 2,
    https://www.envoyproxy.io/docs/envoy/latest/intro/arch_overview/upstream/load_balancing/load_balancers).
    Retries with :class:`RetryPolicy`.
``epp``
    llm-d's endpoint picker with the scorers of its ``inference-scheduling`` guide: the queue
    scorer (weight 2: the fewest waiting requests score 1, the most 0, min-max across the
    endpoints), the KV-cache-utilization scorer (weight 2: ``1 - usage``) and the approximate
    prefix-cache scorer (weight 3: the share of the prompt's leading blocks the EPP routed to
    that endpoint before, from an LRU of block hashes per endpoint), with the max-score picker
    (ties broken at random) (https://github.com/llm-d/llm-d, ``guides/inference-scheduling``;
    scorers in https://github.com/llm-d/llm-d-inference-scheduler). The gauges are the last
    scrape's, every 50 ms: ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc``, or,
    with ``kvgate_gauges`` (an ``engineConfigs`` entry mapping them, ``docs/routers.md``),
    kvgate's ``kvgate_queue_depth`` and ``kvgate_kv_reserved_fraction`` from the replica's arm.
    Between scrapes nothing corrects them (the lag llm-d-router PR #2066 reports). A retry goes
    to the best-scored endpoint not tried yet (the EPP's fallback endpoints with
    ``override_host``).
``epp-affinity``
    ``epp`` where each tenant's requests share a prefix (its system prompt) that pins the
    tenant to a home replica, the first hash of the tenant name (SHA-256, mod N), while that
    replica's scraped queue gauge is below the EPP's queue threshold
    (:data:`AFFINITY_QUEUE_THRESHOLD`, 5 waiting: the Gateway API Inference Extension's
    ``queueThresholdCritical`` default, the same 5 as the saturation detector's); at or above
    it, or when the home was tried, the request takes ``epp``'s choice. This is the skewed
    ingress of Dynamo's DEP #15187 and of llm-d's prefix affinity: each replica's admission
    sees a different mix of tenants (with ``tiers`` on 4 replicas: one replica homes only
    premium tenants, one only a regular one). Run only when named (``--routers``).

Times in seconds.
"""

from __future__ import annotations

import hashlib
import math
import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvgate_bench.effectiveness.model.gate import Arm
from kvgate_bench.effectiveness.model.schedule import Request, content_keys
from kvgate_bench.sim.engine import SimEngine
from kvgate_bench.sim.prefix_cache import extend_chain

#: The routers run by default, in report order (their names are an interface: ``--routers``,
#: JSON ``router``).
ROUTER_NAMES: tuple[str, ...] = ("random", "least-request", "epp")
#: Routers run only when named (``--routers``).
EXTRA_ROUTERS: tuple[str, ...] = ("epp-affinity",)
#: Every router, in report order.
ALL_ROUTERS: tuple[str, ...] = ROUTER_NAMES + EXTRA_ROUTERS
#: The routers that are llm-d's EPP (flow control stands in front of them only).
EPP_ROUTERS: tuple[str, ...] = ("epp", "epp-affinity")
#: ``epp-affinity``: a tenant stays on its home replica while its queue gauge is below this.
AFFINITY_QUEUE_THRESHOLD = 5.0
#: The EPP's scrape period, seconds (llm-d's default metrics refresh interval).
SCRAPE_S = 0.05
#: The EPP's scorer weights (llm-d's inference-scheduling guide).
QUEUE_WEIGHT, KV_WEIGHT, PREFIX_WEIGHT = 2.0, 2.0, 3.0
#: Block hashes the prefix scorer keeps per endpoint (its ``lruCapacityPerServer`` default).
PREFIX_LRU_BLOCKS = 31_250


@dataclass(frozen=True)
class RetryPolicy:
    """Envoy's retries with the recipe of ``docs/routers.md``: a refused attempt is retried on
    a host not tried yet (``previous_hosts``), at most ``replicas - 1`` times, after the
    refusal's Retry-After when it gives one of at most ``max_interval_s``
    (``rate_limited_retry_back_off``), else after Envoy's exponential back-off (25 ms base,
    250 ms cap; the mean of its full jitter is taken here: half the interval).

    Every per-pod refusal counts as retriable (kvgate's are 429s without
    ``x-envoy-ratelimited``; a concurrency cap's queue timeout, a 503, is retried too, which
    Envoy does with ``retry_on: 5xx``)."""

    max_interval_s: float = 0.5
    base_s: float = 0.025
    cap_s: float = 0.25

    def max_retries(self, replicas: int) -> int:
        """Retries allowed for a pool of ``replicas``."""
        return max(0, replicas - 1)

    def backoff_s(self, retry: int, retry_after_s: float | None) -> float:
        """The wait before retry number ``retry`` (from 1) after a refusal that suggested
        ``retry_after_s`` (None: none). The header carries whole seconds (RFC 9110 section
        10.2.3: the sidecar rounds up), so a suggestion is honoured as its ceiling, when that
        is at most ``max_interval_s``."""
        if retry_after_s is not None and retry_after_s >= 0:
            header = float(math.ceil(retry_after_s))
            if header <= self.max_interval_s:
                return header
        return float(min(self.cap_s, self.base_s * 2.0 ** (retry - 1)) / 2)


class Host(Protocol):
    """What a router reads of a replica (:class:`kvgate_bench.effectiveness.pool.driver.Replica`):
    its
    index in the pool, its attempts sent and not ended (Envoy's active requests), and its arm
    and engine (the gauges an EPP scrapes)."""

    @property
    def index(self) -> int: ...

    @property
    def outstanding(self) -> int: ...

    @property
    def arm(self) -> Arm: ...

    @property
    def engine(self) -> SimEngine: ...


class Router(ABC):
    """Picks the replica for each attempt; ``retries`` says whether its proxy retries."""

    name = "router"
    retries = True

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.replicas: Sequence[Host] = ()

    def start(self, replicas: Sequence[Host]) -> None:
        """Bind to the pool's replicas."""
        self.replicas = replicas

    @abstractmethod
    def pick(self, req: Request, now: float, tried: frozenset[int]) -> int | None:
        """The replica for ``req`` at ``now`` among those not in ``tried``; None if none."""

    def sent(self, replica: int, req: Request, now: float) -> None:  # noqa: B027
        """``req`` was sent to ``replica`` at ``now``."""

    def next_scrape(self, busy: bool) -> float | None:
        """When the router next reads the replicas' gauges (None: it reads none)."""
        return None

    def scrape(self, now: float) -> None:  # noqa: B027
        """Read the replicas' gauges at ``now``."""

    def _open(self, tried: frozenset[int]) -> list[int]:
        return [r.index for r in self.replicas if r.index not in tried]


class RandomRouter(Router):
    """kube-proxy: uniformly random, no retries."""

    name = "random"
    retries = False

    def pick(self, req: Request, now: float, tried: frozenset[int]) -> int | None:
        hosts = self._open(tried)
        return self.rng.choice(hosts) if hosts else None


class LeastRequestRouter(Router):
    """Envoy's least-request balancer (power of two choices on active requests)."""

    name = "least-request"

    def pick(self, req: Request, now: float, tried: frozenset[int]) -> int | None:
        hosts = self._open(tried)
        if len(hosts) <= 1:
            return hosts[0] if hosts else None
        a, b = self.rng.sample(hosts, 2)
        return b if self.replicas[b].outstanding < self.replicas[a].outstanding else a


class EppRouter(Router):
    """llm-d's endpoint picker (see the module docstring)."""

    name = "epp"

    def __init__(self, seed: int, block_size: int, kvgate_gauges: bool = False) -> None:
        super().__init__(seed)
        self.block_size = block_size
        self.kvgate_gauges = kvgate_gauges
        self._queue: list[float] = []
        self._kv: list[float] = []
        self._prefix: list[OrderedDict[int, None]] = []
        self._next = 0.0

    def start(self, replicas: Sequence[Host]) -> None:
        super().start(replicas)
        self._prefix = [OrderedDict() for _ in replicas]
        self.scrape(0.0)

    def next_scrape(self, busy: bool) -> float | None:
        # An idle pool's gauges do not move: no scrape timer (a drained run ends); pick()
        # catches the scrapes up.
        return self._next if busy else None

    def scrape(self, now: float) -> None:
        queue, kv = [], []
        for rep in self.replicas:
            gauges = rep.arm.router_gauges() if self.kvgate_gauges else None
            if gauges is None:
                gauges = (float(rep.engine.num_waiting), rep.engine.kv_usage)
            queue.append(gauges[0])
            kv.append(gauges[1])
        self._queue, self._kv = queue, kv
        self._next = now + SCRAPE_S

    def _blocks(self, req: Request) -> list[int]:
        keys = content_keys(req, self.block_size)
        if keys is None:
            return []
        return extend_chain([], keys, req.prompt_tokens // self.block_size)

    def scores(self, req: Request, hosts: list[int]) -> dict[int, float]:
        """Each host's weighted score for ``req`` (higher is better)."""
        qs = [self._queue[h] for h in hosts]
        lo, hi = min(qs), max(qs)
        blocks = self._blocks(req)
        out = {}
        for h in hosts:
            q = 1.0 if hi == lo else (hi - self._queue[h]) / (hi - lo)
            kv = 1.0 - min(1.0, max(0.0, self._kv[h]))
            p = 0.0
            if blocks:
                held = self._prefix[h]
                n = 0
                for b in blocks:
                    if b not in held:
                        break
                    n += 1
                p = n / len(blocks)
            out[h] = QUEUE_WEIGHT * q + KV_WEIGHT * kv + PREFIX_WEIGHT * p
        return out

    def catch_up(self, now: float) -> None:
        """Scrape now if the pool was idle past a scrape (no scrape timer then): the idle
        gauges, read at the scrape time due."""
        if now >= self._next:
            self.scrape(now - (now - self._next) % SCRAPE_S)

    def pick(self, req: Request, now: float, tried: frozenset[int]) -> int | None:
        self.catch_up(now)
        hosts = self._open(tried)
        if not hosts:
            return None
        scores = self.scores(req, hosts)
        best = max(scores.values())
        top = [h for h in hosts if math.isclose(scores[h], best)]
        return top[0] if len(top) == 1 else self.rng.choice(top)

    def sent(self, replica: int, req: Request, now: float) -> None:
        held = self._prefix[replica]
        for b in self._blocks(req):
            held[b] = None
            held.move_to_end(b)
        while len(held) > PREFIX_LRU_BLOCKS:
            held.popitem(last=False)


class EppAffinityRouter(EppRouter):
    """``epp`` with each tenant pinned to a home replica while that replica's queue gauge is
    below ``queue_threshold`` (see the module docstring)."""

    name = "epp-affinity"

    def __init__(
        self,
        seed: int,
        block_size: int,
        kvgate_gauges: bool = False,
        queue_threshold: float = AFFINITY_QUEUE_THRESHOLD,
    ) -> None:
        super().__init__(seed, block_size, kvgate_gauges)
        self.queue_threshold = queue_threshold

    def home(self, tenant: str) -> int:
        """``tenant``'s home replica: SHA-256 of its name, mod the pool's size."""
        digest = hashlib.sha256(tenant.encode()).digest()
        return int.from_bytes(digest, "big") % len(self.replicas)

    def pick(self, req: Request, now: float, tried: frozenset[int]) -> int | None:
        self.catch_up(now)
        if self.replicas:
            home = self.home(req.tenant)
            if home not in tried and self._queue[home] < self.queue_threshold:
                return home
        return super().pick(req, now, tried)


def make_router(name: str, seed: int, block_size: int, kvgate_gauges: bool = False) -> Router:
    """A fresh router ``name`` (:data:`ALL_ROUTERS`). Raises ``ValueError`` for another name."""
    if name == "random":
        return RandomRouter(seed)
    if name == "least-request":
        return LeastRequestRouter(seed)
    if name == "epp":
        return EppRouter(seed, block_size, kvgate_gauges)
    if name == "epp-affinity":
        return EppAffinityRouter(seed, block_size, kvgate_gauges)
    raise ValueError(f"unknown router {name!r}; choose from {', '.join(ALL_ROUTERS)}")
