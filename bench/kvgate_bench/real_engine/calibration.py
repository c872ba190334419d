"""The pure parts of the real-engine benchmark: the SLO from unloaded latencies, the capacity
from ``none``'s probes, the step-time fit and the schedule rebuilt with the lengths llama-server
really produced. No clock, no I/O.

**SLO.** The virtual benchmark scores a fixed SLO (TTFT <= 0.5 s, TPOT <= 50 ms:
:mod:`kvgate_bench.effectiveness.metrics`) written for its H100 profile, where an unloaded
request of its median prompt takes about 0.03 s to its first token and 7.5 ms per token after
(``h100-llama3-8b``: ``a + b P`` and ``a + c + d K``): the SLO is a multiple of what the engine
does unloaded. A CPU engine is 10-50x slower, so the same multiple of *its* unloaded latencies
is its SLO: TTFT SLO = :data:`TTFT_SLO_FACTOR` x the unloaded TTFT p50, TPOT SLO =
:data:`TPOT_SLO_FACTOR` x the unloaded TPOT p50, the factors the issue's user chose on this very
server (1.42 s = 4.06 x 0.35 s, 118 ms = 3.03 x 39 ms: issue 24, ``issues show 24``).

**Capacity.** The engine's goodput capacity is the largest arrival rate (requests/s) at which the
``none`` arm meets the SLO for :data:`CAPACITY_ATTAINMENT` (90 %) of the requests, as the issue's
user measured it: :func:`capacity_rate` picks it from probes (rate, attainment), interpolating
on the first drop below 90 %; load L offers L x that rate.

**Step times.** The model of :mod:`kvgate_bench.sim.steptime` is ``t = a + b P + c D + d K``
seconds per step. llama-server reports per request (``timings`` of its final chunk, read in
``tools/server/server.cpp``, https://github.com/ggml-org/llama.cpp/tree/master/tools/server):
``prompt_n`` tokens prefilled in ``prompt_ms`` and ``predicted_per_token_ms`` per decoded
token. An unloaded prefill is one step of P tokens and nothing decoding (``a + b P``); the
decode of a request alone, or of ``D`` requests started together with equal lengths, is a step
of D sequences over their contexts (``a + c D + d K``, K the decoding sequences' mean context x
D). :func:`fit_steptime` fits a, b, c, d >= 0 to such observations by least squares on the
relative error (each observation weighted by 1 / its time: a second-long prefill would otherwise
decide ``a`` for the 30 ms decode steps; every subset of the four coefficients solved by its
normal equations, the best non-negative one kept: the exact non-negative least squares for four
unknowns).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from kvgate_bench.effectiveness.workloads import Request, Schedule
from kvgate_bench.kit.toolkit import percentile
from kvgate_bench.sim.steptime import StepTimeModel

#: TTFT SLO / unloaded TTFT p50 (the issue's user's 1.42 s over 0.35 s).
TTFT_SLO_FACTOR = 4.0
#: TPOT SLO / unloaded TPOT p50 (the issue's user's 118 ms over 39 ms).
TPOT_SLO_FACTOR = 3.0
#: The share of requests ``none`` must serve within the SLO at the capacity rate.
CAPACITY_ATTAINMENT = 0.9


@dataclass(frozen=True)
class Slo:
    """The interactive SLO derived from unloaded latencies, seconds."""

    ttft_s: float
    tpot_s: float
    unloaded_ttft_p50_s: float
    unloaded_tpot_p50_s: float

    def pair(self) -> tuple[float, float]:
        """(TTFT, TPOT) SLO, seconds: what ``metrics.summarize`` and ``ArmContext.slo`` take."""
        return (self.ttft_s, self.tpot_s)


def slo_from_unloaded(ttfts_s: Sequence[float], tpots_s: Sequence[float]) -> Slo:
    """The SLO of the module docstring from unloaded TTFTs and TPOTs, seconds. Raises
    ``ValueError`` when either list is empty."""
    ttft, tpot = percentile(list(ttfts_s), 50), percentile(list(tpots_s), 50)
    if ttft is None or tpot is None:
        raise ValueError("no unloaded TTFT or TPOT to derive the SLO from")
    return Slo(TTFT_SLO_FACTOR * ttft, TPOT_SLO_FACTOR * tpot, ttft, tpot)


def capacity_rate(
    probes: Iterable[tuple[float, float]], target: float = CAPACITY_ATTAINMENT
) -> float:
    """The capacity rate (requests/s) from ``none``'s probes, (rate requests/s, SLO attainment
    0..1): the largest rate that met ``target`` below the lowest that did not, linearly
    interpolated between the two (on attainment); the lowest probe's rate x attainment / target
    when none met it. Raises ``ValueError`` without probes."""
    ps = sorted(probes)
    if not ps:
        raise ValueError("no capacity probes")
    if ps[0][1] < target:
        return ps[0][0] * ps[0][1] / target
    last_ok = ps[0]
    for rate, att in ps[1:]:
        if att < target:
            r0, a0 = last_ok
            return r0 + (rate - r0) * (a0 - target) / (a0 - att)
        last_ok = (rate, att)
    return last_ok[0]


def next_probe(probes: Sequence[tuple[float, float]], target: float = CAPACITY_ATTAINMENT) -> float:
    """The rate of the next capacity probe after ``probes`` (at least one): 1.4x the highest
    rate that met ``target`` while none failed above it, 0.7x the lowest that failed while none
    passed below it, else the midpoint of the bracket."""
    ok = [r for r, a in probes if a >= target]
    bad = [r for r, a in probes if a < target]
    if not bad:
        return 1.4 * max(ok)
    below = [r for r in ok if r < min(bad)]
    if not below:
        return 0.7 * min(bad)
    return (max(below) + min(bad)) / 2


#: Requests a capacity probe should hold (at its rate) for its attainment to mean something.
PROBE_REQUESTS = 15


def probe_duration(rate_rps: float, minimum_s: float, maximum_s: float) -> float:
    """A capacity probe's schedule length, seconds: long enough for :data:`PROBE_REQUESTS`
    arrivals at ``rate_rps``, within [``minimum_s``, ``maximum_s``]."""
    want = PROBE_REQUESTS / rate_rps if rate_rps > 0 else maximum_s
    return min(maximum_s, max(minimum_s, want))


@dataclass(frozen=True)
class StepObs:
    """One measured step time: ``prefill`` tokens (P), ``decode`` sequences (D), their
    ``context`` tokens (K) and the step's ``seconds``."""

    prefill: float
    decode: float
    context: float
    seconds: float


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None for a singular system."""
    n = len(v)
    a = [[*row, v[i]] for i, row in enumerate(m)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-18:
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                for c in range(col, n + 1):
                    a[r][c] -= f * a[col][c]
    return [a[i][n] / a[i][i] for i in range(n)]


def fit_steptime(
    obs: Sequence[StepObs], name: str, kv_capacity_tokens: int, chunked_prefill: bool = True
) -> tuple[StepTimeModel, float]:
    """The non-negative least-squares fit of ``a + b P + c D + d K`` to ``obs`` (module
    docstring) as a step-time model named ``name`` with the engine's KV pool (tokens); and the
    fit's root-mean-square relative error (:func:`fit_error`). Raises ``ValueError`` with no
    observation."""
    if not obs:
        raise ValueError("no step-time observations")
    # Relative errors: each row and its time divided by the time, so a 1 s prefill does not
    # drown the 30 ms decode steps the TPOT SLO is about.
    w = [1.0 / o.seconds if o.seconds > 0 else 1.0 for o in obs]
    rows = [
        [wi, wi * o.prefill, wi * o.decode, wi * o.context] for o, wi in zip(obs, w, strict=True)
    ]
    ys = [wi * o.seconds for o, wi in zip(obs, w, strict=True)]
    best: tuple[float, list[float]] | None = None
    for k in range(1, 5):
        for cols in itertools.combinations(range(4), k):
            m = [[sum(r[i] * r[j] for r in rows) for j in cols] for i in cols]
            v = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in cols]
            x = _solve(m, v)
            if x is None or min(x) < 0:
                continue
            coef = [0.0] * 4
            for col, val in zip(cols, x, strict=True):
                coef[col] = val
            sse = sum(
                (sum(k_ * xi for k_, xi in zip(coef, r, strict=True)) - y) ** 2
                for r, y in zip(rows, ys, strict=True)
            )
            if best is None or sse < best[0] - 1e-18:
                best = (sse, coef)
    coef = best[1] if best is not None else [min(o.seconds for o in obs), 0.0, 0.0, 0.0]
    a, b, c, d = coef
    model = StepTimeModel(
        name, a, b, c, d, kv_capacity_tokens=kv_capacity_tokens, chunked_prefill=chunked_prefill
    )
    return model, fit_error(model, obs)


def fit_error(model: StepTimeModel, obs: Sequence[StepObs]) -> float:
    """The root-mean-square relative error of ``model`` on ``obs`` (0.1: 10 %)."""
    errs = [
        (model.seconds(int(o.prefill), int(o.decode), int(o.context)) - o.seconds) / o.seconds
        for o in obs
        if o.seconds > 0
    ]
    return (sum(e * e for e in errs) / len(errs)) ** 0.5 if errs else 0.0


def unloaded_obs(
    prompt_n: int, prompt_ms: float, predicted_n: int, per_token_ms: float
) -> list[StepObs]:
    """The step observations of a request served alone, from llama-server's ``timings``: its
    prefill (one step of ``prompt_n`` tokens, ``prompt_ms``) and its decode steps (one
    sequence over ``prompt_n + predicted_n / 2`` tokens of context on average,
    ``per_token_ms``)."""
    out = [StepObs(prompt_n, 0, 0, prompt_ms / 1e3)]
    if predicted_n > 1:
        out.append(StepObs(0, 1, prompt_n + predicted_n / 2, per_token_ms / 1e3))
    return out


def batch_obs(contexts: Sequence[float], per_token_ms: Sequence[float]) -> StepObs:
    """The decode step of ``len(contexts)`` requests started together with equal lengths:
    mean context (tokens) each; the step time is their mean ``predicted_per_token_ms``."""
    d = len(contexts)
    return StepObs(0, d, sum(contexts), sum(per_token_ms) / len(per_token_ms) / 1e3)


def with_lengths(
    schedule: Schedule,
    prompt_tokens: Mapping[str, int],
    output_tokens: Mapping[str, int],
    max_tokens: int,
    seed: int,
) -> Schedule:
    """``schedule`` with each request's prompt and true output length (tokens) replaced by what
    llama-server reported for it (``prompt_tokens``, ``output_tokens`` by request id) and its
    max_tokens by ``max_tokens``: the virtual benchmark's view of the run. A request missing from
    a map draws the value of a seeded random request that has one (a refused request's lengths
    were never measured)."""
    rng = random.Random(seed)
    pvals, ovals = sorted(prompt_tokens.values()), sorted(output_tokens.values())
    reqs: list[Request] = []
    for r in schedule.requests:
        p = prompt_tokens.get(r.rid) or (rng.choice(pvals) if pvals else r.prompt_tokens)
        o = output_tokens.get(r.rid) or (rng.choice(ovals) if ovals else max_tokens)
        reqs.append(
            replace(r, prompt_tokens=max(1, p), output_tokens=max(1, o), max_tokens=max_tokens)
        )
    return replace(schedule, requests=reqs)
