"""The ``multi-turn`` workload: chat sessions whose turns resend the growing conversation.

Eight ``interactive`` chat tenants ``chat-0`` .. ``chat-7`` of equal weight each start sessions
(one chat conversation each) at Poisson times. A session's turn ``t`` sends the whole
conversation so far (every earlier message and answer, as a chat client does) and then the new
user message, so its prompt is ``prompt(t-1) + answer(t-1) + message(t)`` tokens and its leading
blocks are those of the previous turn's prompt and answer: with the engine's prefix cache
(:mod:`kvgate_bench.sim.prefix_cache`) they are not prefilled again while they stay cached.

* **Closed loop.** Turn ``t + 1`` is sent when turn ``t``'s answer has ended plus a think time
  (exponential, mean :data:`THINK_MEAN_S`), with the answer the engine really produced (a turn
  degraded by the arm carries its shorter answer into the conversation). A refused turn (429,
  503 or the engine's 400) ends the session: its user gives up, so a refusal also removes the
  session's later turns (its record counts as refused, the turns never sent count nothing). A
  turn due at or after the schedule's end is not sent.
* **Context.** The session ends when the next turn's prompt would leave under
  :data:`~kvgate_bench.effectiveness.model.schedule.PROMPT_HEADROOM` (256) tokens of the model's
  context for the answer; a turn's max_tokens is lowered to what the context leaves, as the
  other workloads do.
* **Lengths** (tokens). Turns per session: geometric, mean :data:`MEAN_TURNS` = 2.0, the mean
  turns per conversation of LMSYS-Chat-1M (Zheng et al. 2023, https://arxiv.org/abs/2309.11998,
  Table 1: 2.0 turns, 69.5 tokens per user prompt, 214.5 per response). The first turn's prompt
  (system prompt, pasted context and the first message) is the Azure conversation trace's
  prompt fit (:data:`~kvgate_bench.effectiveness.model.schedule.CONVERSATION_PROMPT`, median 757);
  a later message is lognormal with mean 69.5 (sigma 1.0, :data:`FOLLOWUP_MESSAGE`); answers
  are the Azure conversation output fit (median 151, mean 219: LMSYS-Chat-1M's 214.5); the
  client's max_tokens as in the other workloads.
* **Rate.** ``rate_rps`` counts turns: sessions start at ``rate_rps / MEAN_TURNS`` per second
  (the context cut and the closed loop make the turns sent a little fewer).

With every answer served whole and nothing evicted, this conversation structure makes 55-57 %
of the prompt tokens reusable (:func:`planned_reuse_share`; whole blocks only); Mooncake
reports 40 % for its chat traffic (Qin et al. 2024, https://arxiv.org/abs/2407.00079,
Table 2). What the engine actually reuses (evictions, refusals) is measured per run as
``prefix_reuse_share`` (:mod:`kvgate_bench.effectiveness.model.metrics`).

Pure and seeded: each tenant draws its sessions from its own ``random.Random``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import replace

from kvgate_bench.effectiveness.model.schedule import (
    CONVERSATION_OUTPUT,
    CONVERSATION_PROMPT,
    INTERACTIVE,
    MAX_TOKENS_CHOICES,
    PROMPT_HEADROOM,
    Request,
    Schedule,
    SessionPlan,
    Sessions,
    Tenant,
    TurnPlan,
    lognormal_tokens,
)

MULTI_TURN = "multi-turn"
#: Mean turns per session (LMSYS-Chat-1M); sessions have a geometric number of turns.
MEAN_TURNS = 2.0
#: Turns a session never exceeds (a guard; the context ends sessions long before).
MAX_TURNS = 64
#: A follow-up user message: lognormal (mu, sigma) of tokens with mean 69.5 (LMSYS-Chat-1M).
FOLLOWUP_MESSAGE = (math.log(69.5) - 0.5, 1.0)
#: Mean think time between an answer's end and the next turn, seconds (exponential).
THINK_MEAN_S = 20.0
#: Tenants of the workload.
MULTI_TURN_TENANTS = 8


def multi_turn_tenants() -> list[Tenant]:
    """The workload's tenants: ``chat-0`` .. ``chat-7``, interactive, weight 1 (as
    ``tenants_of("multi-turn")``)."""
    return [Tenant(f"chat-{i}", INTERACTIVE) for i in range(MULTI_TURN_TENANTS)]


def _plan(rng: random.Random, session: str, tenant: Tenant) -> SessionPlan:
    turns: list[TurnPlan] = []
    go_on = 1.0 - 1.0 / MEAN_TURNS
    while True:
        fit = CONVERSATION_PROMPT if not turns else FOLLOWUP_MESSAGE
        turns.append(
            TurnPlan(
                lognormal_tokens(rng, fit),
                lognormal_tokens(rng, CONVERSATION_OUTPUT),
                rng.choice(MAX_TOKENS_CHOICES),
                rng.expovariate(1.0 / THINK_MEAN_S),
            )
        )
        if len(turns) >= MAX_TURNS or rng.random() >= go_on:
            return SessionPlan(session, tenant.name, tenant.tier, tuple(turns))


def turn_rid(plan: SessionPlan, turn: int) -> str:
    """The request id of ``plan``'s turn ``turn`` (0-based): the session's name for the first,
    ``<session>.<turn>`` after."""
    return plan.session if turn == 0 else f"{plan.session}.{turn}"


def turn_request(
    plan: SessionPlan, turn: int, prompt: int, arrival_s: float, max_model_len: int
) -> Request | None:
    """Turn ``turn`` of ``plan`` with a ``prompt``-token conversation, sent at ``arrival_s``;
    None when the prompt leaves under ``PROMPT_HEADROOM`` tokens of the context (turn 0: its
    prompt is clipped to fit instead)."""
    limit = max(1, max_model_len - PROMPT_HEADROOM)
    if prompt > limit:
        if turn > 0:
            return None
        prompt = limit
    t = plan.turns[turn]
    room = max_model_len - prompt
    mt = None if t.max_tokens is None else min(t.max_tokens, room)
    return Request(
        turn_rid(plan, turn),
        arrival_s,
        plan.tenant,
        plan.tier,
        prompt,
        mt,
        min(room, t.output_tokens),
        session=plan.session,
        turn=turn,
    )


def generate_multi_turn(
    rate_rps: float, duration_s: float, seed: int, max_model_len: int = 8192
) -> Schedule:
    """The seeded ``multi-turn`` schedule: ``requests`` holds each session's first turn (the
    later turns come from :func:`next_turn` as the run goes), ``sessions`` every plan."""
    tenants = multi_turn_tenants()
    starts: list[tuple[float, str, SessionPlan]] = []
    for tenant in tenants:
        rng = random.Random(f"{seed}/{MULTI_TURN}/{tenant.name}")
        rate = rate_rps / MEAN_TURNS / len(tenants)
        t = rng.expovariate(rate)
        while t < duration_s:
            starts.append((t, tenant.name, _plan(rng, "", tenant)))
            t += rng.expovariate(rate)
    starts.sort(key=lambda s: (s[0], s[1]))
    plans: dict[str, SessionPlan] = {}
    requests: list[Request] = []
    for i, (t, _, draft) in enumerate(starts):
        plan = replace(draft, session=f"{MULTI_TURN}-{seed}-{i}")
        plans[plan.session] = plan
        first = turn_request(plan, 0, plan.turns[0].message_tokens, t, max_model_len)
        assert first is not None  # the first turn is clipped, never dropped
        requests.append(first)
    return Schedule(
        MULTI_TURN,
        rate_rps,
        duration_s,
        seed,
        {t.name: t for t in tenants},
        requests,
        Sessions(plans, max_model_len),
    )


def next_turn(schedule: Schedule, req: Request, answered: int, now: float) -> Request | None:
    """The turn after ``req``, whose answer of ``answered`` tokens ended at ``now`` (virtual
    seconds): sent at ``now`` + the think time with the conversation so far; None when the
    session is over (its last turn, the context full, the schedule's end), when ``req`` is
    no session's turn, or a copy of one (a replay's probe)."""
    sessions = schedule.sessions
    if sessions is None or req.session is None:
        return None
    plan = sessions.plans.get(req.session)
    if plan is None or req.rid != turn_rid(plan, req.turn) or req.turn + 1 >= len(plan.turns):
        return None
    arrival = now + plan.turns[req.turn].think_s
    if arrival >= schedule.duration_s:
        return None
    nxt = req.turn + 1
    prompt = req.prompt_tokens + answered + plan.turns[nxt].message_tokens
    return turn_request(plan, nxt, prompt, arrival, sessions.max_model_len)


def planned_turns(
    schedule: Schedule, default_max_tokens: Callable[[Request], int]
) -> list[tuple[Request, int]]:
    """Every turn the schedule would send were each answer served whole (its true length capped
    by its max_tokens, or ``default_max_tokens``) and no think time cut by the schedule's end,
    each with its answer's length; ``schedule.requests`` for a schedule without sessions. For
    mean lengths, not for runs."""
    out: list[tuple[Request, int]] = []
    endless = replace(schedule, duration_s=math.inf)
    for first in schedule.requests:
        req: Request | None = first
        while req is not None:
            cap = req.max_tokens if req.max_tokens is not None else default_max_tokens(req)
            answered = min(req.output_tokens, cap)
            out.append((req, answered))
            req = next_turn(endless, req, answered, req.arrival_s)
    return out


def planned_reuse_share(turns: list[tuple[Request, int]], block_size: int = 16) -> float:
    """The share of the prompt tokens of ``turns`` (:func:`planned_turns`) that are whole blocks
    of the previous turn's computed tokens (its prompt and its answer but the last token, which
    has no KV): what a prefix cache that never evicts reuses. 0 for no tokens."""
    total = reused = 0
    previous: dict[str, int] = {}  # session -> tokens with KV after its last turn
    for req, answered in turns:
        total += req.prompt_tokens
        if req.session is None:
            continue
        if req.turn > 0:
            computed = previous[req.session]
            reused += min(req.prompt_tokens - 1, computed) // block_size * block_size
        previous[req.session] = req.prompt_tokens + answered - 1
    return reused / total if total else 0.0
