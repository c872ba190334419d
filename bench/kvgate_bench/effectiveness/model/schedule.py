"""What a schedule is made of: its tenants, requests and sessions (:class:`Schedule`), and the
draws every workload shares (the conversation lengths, the clients' max_tokens, the context
headroom).

The workloads that fill a schedule are :mod:`kvgate_bench.effectiveness.model.workloads` (open
arrivals) and :mod:`kvgate_bench.effectiveness.model.sessions` (``multi-turn``'s sessions).
Times are seconds, lengths tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvgate_bench.sim.prefix_cache import BlockKeys, GroupKeys, SessionKeys

#: Tenant tiers: ``interactive`` (TTFT and TPOT SLO) or ``batch`` (completion SLO).
INTERACTIVE = "interactive"
BATCH = "batch"
#: What clients send as max_tokens (None: unset, the policy's or the engine's default).
MAX_TOKENS_CHOICES: tuple[int | None, ...] = (None, 256, 512, 1024, 4096)
#: Lognormal fits (mu, sigma of the natural log of tokens) of the conversation trace of the Azure
#: LLM inference dataset 2023: prompt (median e^6.63 = 757) and true output (median 151).
CONVERSATION_PROMPT = (6.63, 0.99)
CONVERSATION_OUTPUT = (5.02, 0.86)
#: Room kept for output when clipping a prompt to the context, tokens.
PROMPT_HEADROOM = 256


def lognormal_tokens(rng: random.Random, mu_sigma: tuple[float, float]) -> int:
    """A token count drawn from the lognormal ``mu_sigma`` (of the natural log), at least 1."""
    return max(1, round(rng.lognormvariate(*mu_sigma)))


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant of a workload.

    Attributes:
        name: the tenant key (``x-kvgate-tenant``).
        tier: ``interactive`` (TTFT and TPOT SLO) or ``batch`` (completion SLO).
        weight: its entitled share of the server, relative to the others (fairness weight).
        demand: the share of the arrivals it sends, relative to the others.
        class_name: the tenant class it belongs to where the workload declares classes
            (``tiers``: ``premium``, ``regular``; the class's weight is its tenants'
            ``weight``), else None (the policies group tenants by tier and weight).
    """

    name: str
    tier: str
    weight: float = 1.0
    demand: float = 1.0
    class_name: str | None = None


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a schedule.

    Attributes:
        rid: unique id.
        arrival_s: arrival time, seconds from the schedule's start.
        tenant: tenant name.
        tier: ``interactive`` or ``batch``.
        prompt_tokens: prompt length, tokens (>= 1).
        max_tokens: the client's max_tokens, or None when unset.
        output_tokens: the model's true output length (EOS included), tokens (>= 1); the
            engine stops at ``min(output_tokens, max_tokens)``.
        session: the conversation whose turn this is (``multi-turn``), or None: a prompt of
            its own (never found in the prefix cache).
        turn: the turn's index in its session, from 0.
        prefix_group: the group whose shared prompt prefix (a system prompt) this prompt
            starts with (``shared-prefix``), or None.
        prefix_tokens: that shared prefix's length, tokens (0 without a group).
    """

    rid: str
    arrival_s: float
    tenant: str
    tier: str
    prompt_tokens: int
    max_tokens: int | None
    output_tokens: int
    session: str | None = None
    turn: int = 0
    prefix_group: str | None = None
    prefix_tokens: int = 0


def content_keys(req: Request, block_size: int) -> BlockKeys | None:
    """What ``req``'s prompt is made of, block by block of ``block_size`` tokens, as the
    engine's prefix cache names it:
    its session's blocks (:class:`~kvgate_bench.sim.prefix_cache.SessionKeys`) for a
    conversation's turn, the group's shared prefix
    (:class:`~kvgate_bench.sim.prefix_cache.GroupKeys`, then the request's own blocks) for a
    ``shared-prefix`` prompt, None (its own content, never a hit) otherwise. Every part that
    names the engine's blocks (the engine, kvgate's prefix-aware reservation, the EPP's prefix
    scorer, Dynamo's uncached-token quantum) reads it here."""
    if req.session is not None:
        return SessionKeys(req.session)
    if req.prefix_group is not None and req.prefix_tokens > 0:
        return GroupKeys(req.prefix_group, req.prefix_tokens // block_size)
    return None


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """One planned turn of a session (tokens, seconds).

    Attributes:
        message_tokens: the new user message (turn 0: the whole first prompt).
        output_tokens: the model's true answer length.
        max_tokens: the client's max_tokens, or None when unset.
        think_s: the user's think time after this turn's answer, before the next turn.
    """

    message_tokens: int
    output_tokens: int
    max_tokens: int | None
    think_s: float


@dataclass(frozen=True, slots=True)
class SessionPlan:
    """A session's tenant, tier and planned turns; ``session`` names it (and its first turn)."""

    session: str
    tenant: str
    tier: str
    turns: tuple[TurnPlan, ...]


@dataclass(frozen=True)
class Sessions:
    """A schedule's sessions: ``plans`` by session name; ``max_model_len`` (tokens) bounds a
    conversation."""

    plans: dict[str, SessionPlan]
    max_model_len: int


@dataclass(frozen=True)
class Schedule:
    """A workload's requests over ``duration_s`` seconds at ``rate_rps`` requests per second.

    ``requests`` are sorted by ``arrival_s``; ``tenants`` maps name -> :class:`Tenant`;
    ``sessions``: the sessions whose later turns the run makes (``multi-turn``), or None.
    """

    workload: str
    rate_rps: float
    duration_s: float
    seed: int
    tenants: dict[str, Tenant]
    requests: list[Request]
    sessions: Sessions | None = field(default=None)
