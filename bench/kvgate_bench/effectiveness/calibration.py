"""Calibration: the ``none`` arm's goodput capacity per workload and profile, which sets load 1.

**Load.** Load L means an offered output-token rate of L x the ``none`` arm's goodput capacity:
``rate(L) = L x C / E[out]`` requests per second, where ``E[out]`` is the mean output a request
of the workload produces when served to the end (its true length capped by its max_tokens, or by
the engine's default when unset; over 20,000 seeded requests) and ``C`` is the largest goodput
(tokens/s) the ``none`` arm reaches over arrival rates: :func:`calibrate` doubles the rate from
1 request/s until goodput stops growing by 5 % (on an engine whose goodput does not grow past
1 request/s, a profile file's CPU engine, it halves the rate instead while halving keeps 95 % of
the goodput), then narrows the peak by golden-section search on the log of the rate
(calibration schedules of ``duration_s``, seed ``seed``). Goodput is scored under the
profile's SLO (:class:`kvgate_bench.effectiveness.model.engines.Engine`).
"""

from __future__ import annotations

import math
import multiprocessing
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from kvgate_bench.effectiveness.arms.context import ArmContext
from kvgate_bench.effectiveness.arms.registry import make_arm
from kvgate_bench.effectiveness.model.driver import MAX_MODEL_LEN, engine_config, simulate
from kvgate_bench.effectiveness.model.engines import engine_of
from kvgate_bench.effectiveness.model.gate import engine_default_max_tokens
from kvgate_bench.effectiveness.model.metrics import Slo, summarize
from kvgate_bench.effectiveness.model.schedule import Request
from kvgate_bench.effectiveness.model.sessions import planned_turns
from kvgate_bench.effectiveness.model.workloads import (
    calibration_workload,
    generate,
    served_output_tokens,
    tenants_of,
)
from kvgate_bench.sim.sequences import EngineConfig
from kvgate_bench.sim.steptime import StepTimeModel, profile

#: Requests sampled for ``E[out]`` and ``E[prompt + out]``.
MEAN_SAMPLE = 20_000


@dataclass
class Calibration:
    """The ``none`` arm's goodput capacity for one workload and profile.

    Attributes:
        workload, profile: what was calibrated (``profile``: the ``--profile`` value, a
            built-in name or a profile file's path).
        capacity_goodput_tokens_per_s: ``C``, the largest goodput seen, output tokens/s.
        peak_rate_rps: the arrival rate at which it was seen, requests/s.
        mean_output_tokens: ``E[out]``, tokens per request.
        mean_total_tokens: ``E[prompt + out]``, tokens per request.
        probes: (rate requests/s, goodput tokens/s) of every calibration run.
    """

    workload: str
    profile: str
    capacity_goodput_tokens_per_s: float
    peak_rate_rps: float
    mean_output_tokens: float
    mean_total_tokens: float
    probes: list[tuple[float, float]] = field(default_factory=list)

    @property
    def load1_rate_rps(self) -> float:
        """Arrival rate at load 1, requests/s: ``C / E[out]``."""
        return self.capacity_goodput_tokens_per_s / self.mean_output_tokens

    def rate(self, load: float) -> float:
        """Arrival rate at ``load``, requests/s."""
        return load * self.load1_rate_rps

    def context(
        self,
        steptime: StepTimeModel,
        workload: str,
        config: EngineConfig | None = None,
        slo: Slo | None = None,
    ) -> ArmContext:
        """What the arms may know: the engine (``config``, default the benchmark's shape for
        ``steptime``), the tenants, the capacity at load 1 and the SLO (None: the benchmark's
        fixed one)."""
        return ArmContext(
            config if config is not None else engine_config(steptime),
            {t.name: t for t in tenants_of(workload)},
            self.load1_rate_rps,
            self.load1_rate_rps * self.mean_total_tokens,
            slo,
        )


def mean_lengths(
    workload: str, seed: int, max_model_len: int = MAX_MODEL_LEN
) -> tuple[float, float]:
    """(E[out], E[prompt + out]) of ``workload``'s requests served to the end on an engine of
    ``max_model_len`` tokens, tokens."""

    def default_max(r: Request) -> int:
        return engine_default_max_tokens(r, max_model_len)

    sched = generate(workload, 100.0, MEAN_SAMPLE / 100.0, seed + 7919, max_model_len=max_model_len)
    if sched.sessions is not None:  # every turn, each answer served whole
        turns = planned_turns(sched, default_max)
        outs = [answered for _, answered in turns]
        totals = [o + r.prompt_tokens for r, o in turns]
        return sum(outs) / len(outs), sum(totals) / len(totals)
    outs = [served_output_tokens(r, default_max) for r in sched.requests]
    totals = [o + r.prompt_tokens for o, r in zip(outs, sched.requests, strict=True)]
    return sum(outs) / len(outs), sum(totals) / len(totals)


def none_goodput(workload: str, rate: float, duration_s: float, seed: int, prof: str) -> float:
    """Goodput of the ``none`` arm at ``rate`` requests/s on ``prof``'s engine, scored under
    its SLO, output tokens/s."""
    eng = engine_of(prof)
    sched = generate(workload, rate, duration_s, seed, max_model_len=eng.config.max_model_len)
    run = simulate(sched, make_arm("none", _dummy(), {}), eng.steptime, eng.config)
    return float(summarize(run, eng.score_slo)["goodput_tokens_per_s"])


def _dummy() -> ArmContext:
    return ArmContext(engine_config(profile("constant")), {}, 1.0, 1.0)


def calibrate(workload: str, prof: str, duration_s: float, seed: int) -> Calibration:
    """Measure the ``none`` arm's goodput capacity (see the module docstring) on
    ``calibration_workload(workload)`` (``isolation`` is measured as ``conversation``)."""
    workload = calibration_workload(workload)
    probes: dict[float, float] = {}

    def g(rate: float) -> float:
        if rate not in probes:
            probes[rate] = none_goodput(workload, rate, duration_s, seed, prof)
        return probes[rate]

    rate = 1.0
    while g(2 * rate) > 1.05 * g(rate) and rate < 4096:
        rate *= 2
    if rate == 1.0:  # a slow engine (a CPU profile): halve while halving keeps 95 % of goodput
        while g(rate / 2) >= g(rate) / 1.05 and rate > 1 / 4096:
            rate /= 2
    # The peak lies in [rate / 2, 4 rate]: golden-section search on log(rate).
    lo, hi = math.log(rate / 2), math.log(rate * 4)
    phi = (math.sqrt(5) - 1) / 2
    a, b = hi - phi * (hi - lo), lo + phi * (hi - lo)
    for _ in range(5):
        if g(math.exp(a)) >= g(math.exp(b)):
            hi, b = b, a
            a = hi - phi * (hi - lo)
        else:
            lo, a = a, b
            b = lo + phi * (hi - lo)
    peak_rate = max(probes, key=lambda r: probes[r])
    mean_out, mean_total = mean_lengths(workload, seed, engine_of(prof).config.max_model_len)
    return Calibration(
        workload,
        prof,
        probes[peak_rate],
        peak_rate,
        mean_out,
        mean_total,
        sorted(probes.items()),
    )


def _calibrate_args(args: tuple[str, str, float, int]) -> Calibration:
    return calibrate(*args)


def calibrate_all(
    workloads: list[str], prof: str, duration_s: float, seed: int, jobs: int
) -> list[Calibration]:
    """:func:`calibrate` each of ``workloads``, on up to ``jobs`` processes; in order (a
    workload measured as another, :func:`calibration_workload`, shares its calibration)."""
    unique = list(dict.fromkeys(calibration_workload(w) for w in workloads))
    work = [(w, prof, duration_s, seed) for w in unique]
    if jobs <= 1 or len(work) == 1:
        found = [_calibrate_args(a) for a in work]
    else:
        ctx = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
        with ctx.Pool(min(jobs, len(work))) as pool:
            found = pool.map(_calibrate_args, work)
    by_name = dict(zip(unique, found, strict=True))
    return [by_name[calibration_workload(w)] for w in workloads]


def calibration_json(cal: Calibration) -> dict[str, Any]:
    """``cal`` as JSON-ready data, with the load-1 rate."""
    d = asdict(cal)
    d["load1_rate_rps"] = cal.load1_rate_rps
    return d
