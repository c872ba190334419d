"""The limit bookkeeping of one pod: the concurrency count, the KV reservation, and the
rate limits' buckets (built and rebuilt by :mod:`.rate_limits`).

Invariant: a reservation is taken only right after
:func:`~kvgate_agent.admission.fairqueue.what_blocks` found that it fits, in the same call
(only live correction, :meth:`Limits.grow`, extends one unconditionally: its sequence runs
already), and given back exactly once by :meth:`Limits.release`; so ``in_flight`` and
``kv_reserved_tokens`` are always the sums over the live tickets, and no bucket goes below 0.

KV reservation = the prompt's full blocks once, plus n sequences of the rest of the prompt and
min(max_tokens, L) output tokens each, every sequence rounded up to whole blocks (:func:`kv_for`;
vLLM allocates KV in blocks per sequence: PagedAttention, Kwon et al., SOSP 2023,
https://arxiv.org/abs/2309.06180; so ``vllm:kv_cache_usage_perc`` counts blocks, not tokens,
https://github.com/vllm-project/vllm/issues/57336, and the reservations are in the same unit,
token slots of whole blocks), where L is
the predicted output length (:mod:`.predictor`; max_tokens under ``reservation: MaxTokens`` or
before enough samples). A reservation below the worst case grows block by block as its tokens
stream (:meth:`Limits.grow`); admission keeps :attr:`Limits.headroom` free for that growth, and
where the engine reports more KV in use than is reserved, the engine's figure counts.

A request whose prompt's leading blocks the engine is expected to hold in its prefix cache
(``AdmissionRequest.cached_prefix_tokens``, from :mod:`.prefix_index`) reserves only the rest:
prompt − cached prefix + the output. vLLM's automatic prefix caching
(https://docs.vllm.ai/en/latest/design/prefix_caching.html) gives a hit the cached blocks
themselves (their reference count goes up) rather than new ones, and does not prefill them.
The limit of that reasoning: a cached block no running request references sits in vLLM's free
block queue (it counts as free in ``kv_cache_usage_perc``), and a hit takes it out of that queue,
so it is not newly allocated but it does leave the free pool while the request runs; the saving
is exact for a prefix that running requests share, and otherwise it stands on the engine's
reported KV use (which counts here where it exceeds the reservations) and the live growth of
the reservation. At release the fair-share counter and the learned overrun settle against the
engine's reported cached tokens, which also confirm the index (:func:`settle_prefix`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Final

from kvgate_agent.admission.config import AdmissionConfig
from kvgate_agent.admission.decision import AdmissionRequest, BucketCharge, Ticket
from kvgate_agent.admission.fairqueue.share import FairShare
from kvgate_agent.admission.predictor import LengthPredictor
from kvgate_agent.admission.prefix_index import PrefixIndex
from kvgate_agent.admission.rate_limits import RateLimits
from kvgate_agent.contract.policy import ReservationMode

#: Weight of each settled request in the mean overrun (tokens a reservation grew by).
OVERRUN_ALPHA: Final = 0.05
#: An engine KV report counts for this long, seconds (a stale one must not hold admission).
ENGINE_KV_TTL_S: Final = 3.0
#: Keys the length predictor keeps (tenant x model x band, and the pooled ones), about 1.5 KB
#: each.
PREDICTOR_KEYS: Final = 10_000
#: Headroom kept for the growth of predicted reservations never exceeds this share of the pool.
MAX_HEADROOM_SHARE: Final = 0.2


def round_up(tokens: int, block_size: int) -> int:
    """``tokens`` rounded up to a whole number of KV blocks of ``block_size`` tokens."""
    return -(-tokens // block_size) * block_size


def kv_for(prompt: int, output: int, n: int, block_size: int) -> int:
    """KV token slots ``n`` sequences of one ``prompt`` (tokens) and ``output`` tokens each
    hold in blocks of ``block_size``: the prompt's full blocks once (the sequences share them:
    vLLM V0 forked them copy-on-write, V1 finds them in its prefix cache), and each sequence's
    own blocks, its copy of the prompt's last partial block and its output, rounded up to whole
    blocks. ``n`` = 1: ``round_up(prompt + output)``. E.g. a 10-token prompt, 1 output token,
    n = 4, blocks of 16: 64 (four blocks, one per sequence), not ``round_up(10 + 4)`` = 16."""
    full = prompt // block_size * block_size
    return full + n * round_up(prompt - full + output, block_size)


class Limits:
    """Everything one pod's admission counts against: the rate limits' buckets, requests in
    flight (concurrency) and KV tokens reserved, with the live tickets. What stops a request
    is asked of :func:`~kvgate_agent.admission.fairqueue.what_blocks`.

    Args:
        config: resolved thresholds.
        started_at: the pod's start, clock seconds (the warm-up ramps begin there).
        max_tenants: bound on the tenant buckets kept per limit.

    Attributes:
        config: the thresholds enforced now.
        rates: the rate limits' buckets (:mod:`.rate_limits`).
        in_flight: admitted requests not yet released.
        admitted_at_sum: the sum of their admission times, clock seconds (their mean age:
            :meth:`mean_age`).
        kv_reserved_tokens: KV tokens reserved by them (block-rounded).
        tickets: the live tickets by ``id``.
        predictor: the output-length predictor (learned at release).
        concurrency_limit: the concurrency cap enforced now: the policy's, or the adaptive
            limit when lower (set by the controller); None = none.
        concurrency_cap: the hard cap under the adaptive limit: the policy's, lowered to the
            engine's slots (set by the controller); None = none.
        overrun_mean: mean tokens a predicted reservation grew by before release.
        predicted_in_flight: tickets in flight whose reservation is below their worst case.
        engine_kv_used: KV tokens the engine reports in use (None: not known).
        engine_kv_until: clock time after which that report is too old to count.
        fair: the tenants' fair-share counters, charged here at every reservation.
        prefixes: the recently admitted prompts' block hashes and the engine's confirmation
            (:mod:`.prefix_index`).
    """

    __slots__ = (
        "admitted_at_sum",
        "concurrency_cap",
        "concurrency_limit",
        "config",
        "engine_kv_until",
        "engine_kv_used",
        "fair",
        "in_flight",
        "kv_reserved_tokens",
        "overrun_mean",
        "predicted",
        "predicted_in_flight",
        "predictor",
        "prefixes",
        "rates",
        "tickets",
    )

    def __init__(self, config: AdmissionConfig, started_at: float, max_tenants: int) -> None:
        self.config = config
        self.rates = RateLimits(config.limits, started_at, max_tenants)
        self.in_flight = 0
        self.admitted_at_sum = 0.0
        self.kv_reserved_tokens = 0
        self.tickets: dict[int, Ticket] = {}
        self.predictor = LengthPredictor(
            config.reservation_quantile, min(max_tenants, PREDICTOR_KEYS)
        )
        self.predicted = config.reservation is ReservationMode.PREDICTED
        self.concurrency_limit = config.max_concurrency
        self.concurrency_cap = config.max_concurrency
        self.overrun_mean = 0.0
        self.predicted_in_flight = 0
        self.engine_kv_used: int | None = None
        self.engine_kv_until = 0.0
        self.fair = FairShare(config.fair_prompt_weight, config.fair_output_weight, max_tenants)
        self.prefixes = PrefixIndex()

    # ------------------------------------------------------------------ configuration

    def reconfigure(self, config: AdmissionConfig, now: float) -> None:
        """Count against ``config`` from now on: the rate limits' buckets are rebuilt in place
        (:meth:`RateLimits.reconfigure`); reservations and tickets stay."""
        self.rates.reconfigure(config.limits, now)
        self.config = config
        self.predictor.reset_quantile(config.reservation_quantile)
        self.predicted = config.reservation is ReservationMode.PREDICTED
        self.fair.retune(config.fair_prompt_weight, config.fair_output_weight)

    def set_kv_capacity(self, tokens: int | None) -> None:
        """Enforce a new KV capacity (tokens; None = not enforced); reservations held stay."""
        self.config = dataclasses.replace(self.config, kv_capacity_tokens=tokens)

    # ------------------------------------------------------------------ arithmetic

    def kv_tokens(self, prompt: int, max_tokens: int, n: int) -> int:
        """KV tokens a request may ever hold: its ``n`` sequences of prompt + max_tokens, each
        rounded up to whole blocks, the prompt's full blocks counted once (:func:`kv_for`)."""
        return kv_for(prompt, max_tokens, n, self.config.block_size)

    def reservation(self, req: AdmissionRequest, max_tokens: int) -> int:
        """KV tokens reserved for ``req`` admitted with ``max_tokens``: n sequences of prompt −
        its expected cached prefix (``req.cached_prefix_tokens``) and min(max_tokens, L) output
        tokens each, block-rounded per sequence (:func:`kv_for`), L the predicted output per
        choice (``req.predicted_output_tokens`` when set, else the
        predictor's; max_tokens when neither, or under ``MaxTokens``)."""
        out = max_tokens
        if self.predicted:
            p = req.predicted_output_tokens
            if p is None:
                p = self.predictor.predict(req.tenant, req.model, max_tokens)
            if p is not None and p < max_tokens:
                out = max(1, p)
        prompt = req.prompt_tokens - req.cached_prefix_tokens
        return kv_for(prompt, out, req.n, self.config.block_size)

    @property
    def headroom(self) -> int:
        """KV tokens kept free for the growth of predicted reservations in flight: their count x
        the mean overrun, at most :data:`MAX_HEADROOM_SHARE` of the pool."""
        cap = self.config.kv_capacity_tokens
        if cap is None or not self.predicted_in_flight:
            return 0
        return min(
            int(MAX_HEADROOM_SHARE * cap), math.ceil(self.predicted_in_flight * self.overrun_mean)
        )

    def kv_in_use(self, now: float) -> int:
        """KV tokens counted as taken: the reservations plus the headroom, or the engine's own
        figure when it reports more."""
        used = self.kv_reserved_tokens + self.headroom
        engine = self.engine_kv_used
        if engine is None or engine <= used or now > self.engine_kv_until:
            return used
        return engine

    def grow(self, ticket: Ticket, tokens: int) -> int:
        """Extend ``ticket``'s reservation to hold prompt + ``tokens`` output tokens (all
        choices: their share each, rounded up) and the next token, block by block, never past
        its worst case; returns the tokens added (0 if it already held them). Taken
        unconditionally: the sequence runs already (the headroom is what keeps this inside the
        pool)."""
        n = max(1, ticket.n)
        per_choice = -(-tokens // n) + 1
        need = min(
            ticket.kv_max,
            kv_for(ticket.uncached_prompt_tokens, per_choice, n, self.config.block_size),
        )
        extra = need - ticket.kv_tokens
        if extra <= 0:
            return 0
        ticket.kv_tokens = need
        self.kv_reserved_tokens += extra
        return extra

    def fits_ever(self, kv: int, cost: float) -> bool:
        """Whether a reservation of ``kv`` tokens and ``cost`` units fits the full capacities."""
        cfg = self.config
        cap = self.rates.min_cost_capacity
        return (cfg.kv_capacity_tokens is None or kv <= cfg.kv_capacity_tokens) and (
            cap is None or cost <= cap
        )

    def max_tokens_within(
        self, prompt: int, n: int, kv_room: int | None, cost_room: float | None
    ) -> int | None:
        """Largest max_tokens whose reservation (:func:`kv_for`) fits ``kv_room`` tokens and
        whose cost fits ``cost_room`` units; None = unbounded by both. Negative when not even
        the prompt fits."""
        cfg = self.config
        best: int | None = None
        if kv_room is not None:
            bs = cfg.block_size
            full = prompt // bs * bs  # the prompt's full blocks, once; then n sequences' own
            best = (kv_room - full) // n // bs * bs - (prompt - full)
        if cost_room is not None and cfg.output_token_weight > 0:
            by_cost = math.floor(
                (cost_room - cfg.cost_per_request - prompt * cfg.prompt_token_weight)
                / (n * cfg.output_token_weight)
                + 1e-9
            )
            best = by_cost if best is None else min(best, by_cost)
        elif cost_room is not None and cfg.cost(prompt, 0) > cost_room + 1e-9:
            best = -1
        return best

    def max_fit_ever(self, req: AdmissionRequest) -> int | None:
        """Largest max_tokens that could ever be admitted (full capacities); None = unbounded."""
        return self.max_tokens_within(
            req.prompt_tokens, req.n, self.config.kv_capacity_tokens, self.rates.cost_capacity()
        )

    def max_fit_now(self, req: AdmissionRequest, now: float) -> int | None:
        """Largest max_tokens that fits the KV room and every cost bucket's level now."""
        kv = self.config.kv_capacity_tokens
        kv_room = None if kv is None else kv - self.kv_in_use(now)
        cost_room = self.rates.cost_room(req.tenant, now)
        return self.max_tokens_within(req.prompt_tokens, req.n, kv_room, cost_room)

    def mean_age(self, now: float) -> float:
        """The mean seconds since admission of the requests in flight at clock time ``now``
        (0 with none). O(1)."""
        n = self.in_flight
        return max(0.0, now - self.admitted_at_sum / n) if n > 0 else 0.0

    # ------------------------------------------------------------------ reservations

    def reserve(
        self,
        req: AdmissionRequest,
        max_tokens: int,
        now: float,
        with_buckets: bool = True,
        found: list[BucketCharge] | None = None,
        kv: int | None = None,
    ) -> Ticket:
        """Take the reservations for ``req``; only after
        :func:`~kvgate_agent.admission.fairqueue.what_blocks` said it fits, in the same call
        (so every bucket holds at least what is taken). ``found`` and ``kv`` as that call left
        them, when the caller has them."""
        if kv is None:
            kv = self.reservation(req, max_tokens)
        if found is None:
            found = []
            if with_buckets:
                self.rates.blocker(req, max_tokens, now, self.config, found)
        for b, amount, _ in found:
            b.level -= amount
            b.pins += 1
        cached = req.cached_prefix_tokens
        kv_max = self.kv_tokens(req.prompt_tokens - cached, max_tokens, req.n)
        ticket = Ticket(
            req.tenant,
            req.prompt_tokens,
            max_tokens,
            req.n,
            kv,
            now,
            found,
            False,
            req.model,
            kv_max,
            kv,
        )
        ticket.weight = req.weight
        if req.prefix_blocks is not None:
            ticket.cached_tokens = cached
            ticket.prefix_run = req.prefix_run
            self.prefixes.remember(req.prefix_blocks)
        elif cached:
            ticket.cached_tokens = cached
        self.fair.admit(ticket)
        if kv < kv_max:
            self.predicted_in_flight += 1
        self.in_flight += 1
        self.admitted_at_sum += now
        self.kv_reserved_tokens += kv
        self.tickets[id(ticket)] = ticket
        return ticket

    def release(self, ticket: Ticket, now: float, cost: float, requests: float) -> None:
        """Give back what ``ticket`` holds, settling each bucket to real usage: ``cost`` units
        used of each cost bucket, ``requests`` (1 or 0) of each request bucket. A bucket is
        refunded what was reserved but not used, or charged the excess (never below 0). The
        caller makes sure this runs once per ticket."""
        for bucket, amount, is_cost in ticket.holds:
            used = cost if is_cost else requests
            if used < amount:
                bucket.put_back(amount - used, now)
            elif used > amount:
                bucket.charge(used - amount, now)
            bucket.pins -= 1
        self.in_flight -= 1
        # (back to exactly 0 when the pod is idle: no rounding carried from one busy spell on)
        self.admitted_at_sum = self.admitted_at_sum - ticket.admitted_at if self.in_flight else 0.0
        self.kv_reserved_tokens -= ticket.kv_tokens
        if ticket.kv_reserved_at_admission < ticket.kv_max:
            self.predicted_in_flight -= 1
        del self.tickets[id(ticket)]

    def learn(self, ticket: Ticket, completion_tokens: int, cached_tokens: int = 0) -> None:
        """Learn from a settled ticket whose request produced ``completion_tokens`` (all choices)
        with ``cached_tokens`` of its prompt found in the engine's prefix cache: the length
        predictor's sample, and how far a predicted reservation had to grow."""
        self.predictor.observe(
            ticket.tenant, ticket.model, ticket.max_tokens, completion_tokens // max(1, ticket.n)
        )
        base = ticket.kv_reserved_at_admission
        if base < ticket.kv_max:
            n = max(1, ticket.n)
            final = min(
                ticket.kv_max,
                kv_for(
                    ticket.prompt_tokens - cached_tokens,
                    -(-completion_tokens // n),
                    n,
                    self.config.block_size,
                ),
            )
            self.overrun_mean += OVERRUN_ALPHA * (max(0, final - base) - self.overrun_mean)


def expect_prefix(limits: Limits, req: AdmissionRequest) -> None:
    """Set ``req.prefix_run`` and ``req.cached_prefix_tokens`` from its ``prefix_blocks`` and
    ``limits``' prefix index (:class:`~kvgate_agent.admission.prefix_index.PrefixIndex`); a
    no-op without them."""
    blocks = req.prefix_blocks
    if blocks is None:
        return
    bs = limits.config.block_size
    run = limits.prefixes.run(blocks, req.prompt_tokens, bs)
    req.prefix_run = run
    req.cached_prefix_tokens = limits.prefixes.expect(run, bs)


def settle_prefix(limits: Limits, ticket: Ticket, cached_tokens: int | None) -> int:
    """The cached prompt tokens ``ticket`` settles with: the engine's report (``cached_tokens``,
    within the prompt; it confirms ``limits``' prefix index's run), else the expectation it was
    admitted on."""
    if cached_tokens is None:
        return ticket.cached_tokens
    cached = min(max(0, cached_tokens), ticket.prompt_tokens)
    limits.prefixes.confirm(ticket.prefix_run, cached)
    return cached
