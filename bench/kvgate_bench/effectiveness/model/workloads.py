"""Seeded, generated request schedules for the admission-effectiveness benchmark (no download).

The workloads, each a list of :class:`Request` sorted by arrival time (seconds from 0):

``conversation``
    Eight chat tenants of equal weight, all ``interactive``; Poisson arrivals. Prompt tokens
    lognormal mu 6.63 sigma 0.99 (median e^6.63 = 757), true output tokens lognormal mu 5.02
    sigma 0.86 (median 151): the lognormal fits of the conversation trace of the Azure LLM
    inference dataset 2023
    (https://github.com/Azure/AzurePublicDataset/blob/master/AzureLLMInferenceDataset2023.md).
``code``
    Four coding-assistant tenants, ``interactive``; each alternates ON periods (exponential,
    mean :data:`CODE_ON_MEAN_S`) with Poisson arrivals and silent OFF periods (mean
    :data:`CODE_OFF_MEAN_S`): bursts at 3x the mean rate. Prompt lognormal mu 7.00 sigma 1.36
    (median 1097), output mu 2.79 sigma 0.85 (median 16): the code trace's fits (same source).
``multi-tenant``
    Three ``interactive`` chat tenants (TTFT SLO), one ``batch`` tenant (completion SLO) and one
    misbehaving ``interactive`` tenant ``noisy`` that sends 5x its share, every request with
    max_tokens 4096. Every tenant's weight (its entitled share) is 1; inter-arrival times are
    Gamma with a coefficient of variation of 2 (shape 1/4). Lengths from the conversation fits.
``isolation``
    Eight well-behaved ``interactive`` chat tenants ``chat-0`` .. ``chat-7`` offering
    :data:`ISOLATION_WELL_BEHAVED_LOAD` (0.6) x the server's capacity together (each under its
    fair share of 1/9), and one ``interactive`` tenant ``noisy`` offering ``noisy_load`` x
    capacity (default :data:`DEFAULT_NOISY_LOAD`), every request of it with max_tokens 4096.
    All weights 1, Poisson arrivals, the conversation fits. Its load is the total offered,
    ``0.6 + noisy_load`` (:func:`isolation_load`); the rate given to :func:`generate` is split
    in proportion to the tenants' demands (0.6 / 8 each and ``noisy_load``), so at the rate of
    load ``0.6 + K`` each chat tenant sends 0.075 x and ``noisy`` K x the load-1 request rate.
    Its capacity is the ``conversation`` workload's (:func:`calibration_workload`): the same
    lengths on the same server.
``multi-turn``
    Eight ``interactive`` chat tenants whose sessions resend the growing conversation each
    turn, in a closed loop (the next turn after the answer plus a think time): see
    :mod:`kvgate_bench.effectiveness.model.sessions`. Its ``requests`` are the sessions' first
    turns;
    the later ones are made as the run goes (``Schedule.sessions``).
``tiers``
    Two tenant classes (:attr:`Tenant.class_name`): ``premium``, four ``interactive`` chat
    tenants ``premium-0`` .. ``premium-3`` of weight :data:`PREMIUM_WEIGHT` (4), and
    ``regular``, four ``regular-0`` .. ``regular-3`` of weight 1, so the classes' entitled
    shares are 4:1 (0.8 and 0.2 of the server) whether a policy weighs tenants or classes.
    Every tenant offers the same (demand 1): each class half the load, so at load 2 premium
    offers 1.0x the capacity (1.25x its share) and regular 1.0x (5x its share); both are
    over their share at any load above 1.6. Poisson arrivals, the conversation fits; measured
    against ``conversation`` (:func:`calibration_workload`). Not run by default (name it in
    ``--workloads``): it is the class-shares workload of the pool benchmark (issue 34).
``shared-prefix``
    Four ``interactive`` application tenants ``app-0`` .. ``app-3`` of equal weight, each
    prompt its application's system prompt and tools (:data:`SHARED_PREFIX_TOKENS`, the same
    tokens for every request of that tenant: the prefix the engine's prefix cache shares
    between running requests) followed by the user's part (the conversation prompt fit);
    outputs from the conversation fit; Poisson arrivals. Its capacity is its own ``none``'s (a
    prefix-caching engine prefills the shared part once). Not run by default: it is where
    prefix-aware reservations matter (issue 34, item 4), as the shared prefix is held by
    running requests, where a conversation's earlier turns are not.

The records a schedule is made of (:class:`Request`, :class:`Schedule`, ...) and the draws the
workloads share are :mod:`kvgate_bench.effectiveness.model.schedule`'s.

Clients' max_tokens are drawn uniformly from
:data:`~kvgate_bench.effectiveness.model.schedule.MAX_TOKENS_CHOICES` (``None``: unset, the
server's default applies). Lengths are clipped to the model's context: a prompt to at most
``max_model_len - 256`` tokens (1 % of conversation prompts, 7 % of code prompts), a max_tokens
that would overflow the context lowered to ``max_model_len - prompt`` (a client that respects
the context window), a true output to at most ``max_model_len - prompt``.

Everything here is pure and seeded: the same (workload, rate, duration, seed) gives the same
schedule. Times are seconds, lengths tokens.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from kvgate_bench.effectiveness.model.schedule import (
    BATCH,
    CONVERSATION_OUTPUT,
    CONVERSATION_PROMPT,
    INTERACTIVE,
    MAX_TOKENS_CHOICES,
    PROMPT_HEADROOM,
    Request,
    Schedule,
    Tenant,
    lognormal_tokens,
)
from kvgate_bench.effectiveness.model.sessions import generate_multi_turn

#: Workload names, in report order (the default set of a single-pod run).
WORKLOADS: tuple[str, ...] = ("conversation", "code", "multi-tenant", "isolation", "multi-turn")
#: Workloads run only when named (``--workloads``).
EXTRA_WORKLOADS: tuple[str, ...] = ("tiers", "shared-prefix")
#: Every workload name :func:`generate` knows.
ALL_WORKLOADS: tuple[str, ...] = WORKLOADS + EXTRA_WORKLOADS
#: The code trace's lognormal fits (mu, sigma of the natural log of tokens; the conversation's
#: are :data:`~kvgate_bench.effectiveness.model.schedule.CONVERSATION_PROMPT` / ``_OUTPUT``).
CODE_PROMPT = (7.00, 1.36)
CODE_OUTPUT = (2.79, 0.85)
#: ``code`` ON/OFF periods, seconds (means of exponentials): bursts at (on + off) / on = 3x.
CODE_ON_MEAN_S = 5.0
CODE_OFF_MEAN_S = 10.0
#: ``multi-tenant``: Gamma inter-arrival coefficient of variation, and the noisy tenant's excess.
MULTI_TENANT_CV = 2.0
NOISY_DEMAND = 5.0
NOISY_MAX_TOKENS = 4096
#: ``isolation``: what the eight well-behaved tenants offer together, and the noisy tenant's
#: default offer, both x the server's capacity.
ISOLATION_WELL_BEHAVED_LOAD = 0.6
ISOLATION_TENANTS = 8
DEFAULT_NOISY_LOAD = 3.0
#: ``tiers``: tenants per class, and the classes' weights (premium:regular = 4:1).
TIERS_TENANTS = 4
PREMIUM_WEIGHT = 4.0
REGULAR_WEIGHT = 1.0
#: ``shared-prefix``: applications, and each one's system prompt and tool definitions, tokens
#: (agentic prompts carry several thousand tokens of tool schemas before the user's turn:
#: SGLang's RadixAttention paper, https://arxiv.org/abs/2312.07104, measures such shared
#: prefixes in agent and few-shot workloads).
SHARED_PREFIX_APPS = 4
SHARED_PREFIX_TOKENS = 2048


def isolation_load(noisy_load: float) -> float:
    """The total load of ``isolation`` with the noisy tenant at ``noisy_load`` x capacity:
    ``0.6 + noisy_load`` (rounded to 1e-9, so that 0.6 + 3 reads 3.6)."""
    return round(ISOLATION_WELL_BEHAVED_LOAD + noisy_load, 9)


def calibration_workload(workload: str) -> str:
    """The workload whose ``none`` capacity defines ``workload``'s load: ``isolation`` and
    ``tiers`` are measured against ``conversation`` (same lengths), every other workload
    against itself."""
    return "conversation" if workload in ("isolation", "tiers") else workload


def tenants_of(workload: str, noisy_load: float = DEFAULT_NOISY_LOAD) -> list[Tenant]:
    """The tenants of ``workload`` (``noisy_load``: ``isolation``'s noisy offer, x capacity).
    Raises ``ValueError`` for an unknown name or a ``noisy_load`` <= 0."""
    if workload == "isolation":
        if noisy_load <= 0:
            raise ValueError("noisy_load must be > 0")
        each = ISOLATION_WELL_BEHAVED_LOAD / ISOLATION_TENANTS
        chats = [Tenant(f"chat-{i}", INTERACTIVE, demand=each) for i in range(ISOLATION_TENANTS)]
        return [*chats, Tenant("noisy", INTERACTIVE, demand=noisy_load)]
    if workload in ("conversation", "multi-turn"):
        return [Tenant(f"chat-{i}", INTERACTIVE) for i in range(8)]
    if workload == "code":
        return [Tenant(f"code-{i}", INTERACTIVE) for i in range(4)]
    if workload == "tiers":
        return [
            Tenant(f"{cls}-{i}", INTERACTIVE, weight=w, class_name=cls)
            for cls, w in (("premium", PREMIUM_WEIGHT), ("regular", REGULAR_WEIGHT))
            for i in range(TIERS_TENANTS)
        ]
    if workload == "shared-prefix":
        return [Tenant(f"app-{i}", INTERACTIVE) for i in range(SHARED_PREFIX_APPS)]
    if workload == "multi-tenant":
        return [
            Tenant("chat-a", INTERACTIVE),
            Tenant("chat-b", INTERACTIVE),
            Tenant("chat-c", INTERACTIVE),
            Tenant("batch", BATCH),
            Tenant("noisy", INTERACTIVE, demand=NOISY_DEMAND),
        ]
    raise ValueError(f"unknown workload {workload!r}; choose one of {', '.join(ALL_WORKLOADS)}")


def _poisson_times(rng: random.Random, rate: float, start: float, end: float) -> list[float]:
    out: list[float] = []
    t = start + rng.expovariate(rate)
    while t < end:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _gamma_times(rng: random.Random, rate: float, cv: float, end: float) -> list[float]:
    """Renewal arrivals with Gamma inter-arrival times of mean ``1/rate`` and CV ``cv``."""
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    out: list[float] = []
    t = rng.gammavariate(shape, scale) * rng.random()  # a stationary-ish start
    while t < end:
        out.append(t)
        t += rng.gammavariate(shape, scale)
    return out


def _on_off_times(rng: random.Random, mean_rate: float, end: float) -> list[float]:
    """A Markov-modulated Poisson process: ON periods at ``mean_rate x (on + off) / on``."""
    on_rate = mean_rate * (CODE_ON_MEAN_S + CODE_OFF_MEAN_S) / CODE_ON_MEAN_S
    # Start in the stationary state: ON with probability on / (on + off).
    on = rng.random() < CODE_ON_MEAN_S / (CODE_ON_MEAN_S + CODE_OFF_MEAN_S)
    t = 0.0
    out: list[float] = []
    while t < end:
        if on:
            period_end = min(end, t + rng.expovariate(1.0 / CODE_ON_MEAN_S))
            out.extend(_poisson_times(rng, on_rate, t, period_end))
        else:
            period_end = t + rng.expovariate(1.0 / CODE_OFF_MEAN_S)
        t, on = period_end, not on
    return out


def generate(
    workload: str,
    rate_rps: float,
    duration_s: float,
    seed: int,
    *,
    max_model_len: int = 8192,
    noisy_load: float = DEFAULT_NOISY_LOAD,
) -> Schedule:
    """The seeded schedule of ``workload`` at ``rate_rps`` requests/s (all tenants together)
    over ``duration_s`` seconds.

    Each tenant draws from its own ``random.Random`` derived from (seed, workload, tenant), so
    tenants do not perturb each other's draws. ``noisy_load`` shapes ``isolation`` only (its
    ``rate_rps`` is that of load ``isolation_load(noisy_load)``). Raises ``ValueError`` for an
    unknown workload or a rate, duration or ``noisy_load`` <= 0.
    """
    if rate_rps <= 0 or duration_s <= 0:
        raise ValueError("rate_rps and duration_s must be > 0")
    if workload == "multi-turn":
        return generate_multi_turn(rate_rps, duration_s, seed, max_model_len)
    tenants = tenants_of(workload, noisy_load)
    total_demand = sum(t.demand for t in tenants)
    if workload == "code":
        prompt_fit, output_fit = CODE_PROMPT, CODE_OUTPUT
    else:
        prompt_fit, output_fit = CONVERSATION_PROMPT, CONVERSATION_OUTPUT
    prompt_max = max(1, max_model_len - PROMPT_HEADROOM)
    shared = SHARED_PREFIX_TOKENS if workload == "shared-prefix" else 0
    drafts: list[tuple[float, str, str, int, int | None, int]] = []
    for tenant in tenants:
        rng = random.Random(f"{seed}/{workload}/{tenant.name}")
        rate = rate_rps * tenant.demand / total_demand
        times: list[float]
        if workload in ("conversation", "isolation", "tiers", "shared-prefix"):
            times = _poisson_times(rng, rate, 0.0, duration_s)
        elif workload == "code":
            times = _on_off_times(rng, rate, duration_s)
        else:
            times = _gamma_times(rng, rate, MULTI_TENANT_CV, duration_s)
        for t in times:
            prompt = min(prompt_max, shared + lognormal_tokens(rng, prompt_fit))
            room = max_model_len - prompt
            output = min(room, lognormal_tokens(rng, output_fit))
            max_tokens = rng.choice(MAX_TOKENS_CHOICES)
            if tenant.name == "noisy":
                max_tokens = NOISY_MAX_TOKENS
            if max_tokens is not None:
                max_tokens = min(max_tokens, room)
            drafts.append((t, tenant.name, tenant.tier, prompt, max_tokens, output))
    drafts.sort(key=lambda d: (d[0], d[1]))
    requests = [
        Request(f"{workload}-{seed}-{i}", t, name, tier, prompt, mt, out,
                prefix_group=name if shared else None, prefix_tokens=min(shared, prompt))
        for i, (t, name, tier, prompt, mt, out) in enumerate(drafts)
    ]  # fmt: skip
    return Schedule(workload, rate_rps, duration_s, seed, {t.name: t for t in tenants}, requests)


def served_output_tokens(req: Request, default_max_tokens: Callable[[Request], int]) -> int:
    """Output tokens ``req`` produces when served to the end: its true length capped by its
    max_tokens, or by ``default_max_tokens(req)`` when unset."""
    cap = req.max_tokens if req.max_tokens is not None else default_max_tokens(req)
    return min(req.output_tokens, cap)


def lognormal_median(mu_sigma: tuple[float, float]) -> float:
    """The median of a lognormal with these (mu, sigma): ``e^mu`` (tokens)."""
    return math.exp(mu_sigma[0])
