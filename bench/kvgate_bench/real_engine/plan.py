"""What a real-engine run does, in what order, and how long it takes (pure: no clock, no I/O).

* **Cells** (:func:`parse_cells`): ``WORKLOAD:LOAD`` items, ``multi-tenant`` or
  ``isolation`` (its load is the noisy tenant's, x the calibrated capacity; the total offered
  is :func:`kvgate_bench.effectiveness.model.workloads.isolation_load`), or
  ``isolation-alone``: the same seed's ``isolation`` schedule with the noisy tenant's requests
  taken out, run through :data:`ALONE_ARMS` only. It is the reference the isolation target
  is read against: what the well-behaved tenants get on this engine with no noisy tenant at
  all (performance isolation as "attainment when sharing against attainment alone": Verma et
  al., "Large-scale cluster management at Google with Borg", EuroSys 2015,
  https://research.google/pubs/pub43438/, measure a workload's slowdown against running
  alone the same way).
* **Arms** (:data:`ARMS`) run in turn on a cell's schedule, on a freshly started llama-server
  each; the order is rotated per seed (:func:`arm_order`: seed s starts at index
  s mod len(ARMS)), so no arm always runs first or last.
* **Schedule size** (:func:`sized_schedule`): long enough for ``min_requests`` requests
  (``multi-tenant``) or ``0.6 x min_requests`` well-behaved ones (``isolation``: 120 at the
  default 200), and at least ``min_duration_s``: the duration starts at max(min_duration_s,
  need / rate) and grows by the shortfall (x 1.05) until the seeded schedule holds enough.
* **Tuning** (:func:`tuned_on`): the baselines are swept, on the tune seed only, on each
  ``multi-tenant`` cell at load 2 or more (where the targets compare kvgate with the best tuned
  baseline); every other cell (``isolation``, ``multi-tenant`` under load 2) reuses the
  settings tuned on ``multi-tenant:2``.
* **Sweeps** (:func:`sweeps`): the baselines' settings, run on the tune seed only: caps 1 ..
  ``parallel`` and 2 x ``parallel`` (queue wait = the TTFT SLO), token-bucket factors 1, 1.5
  and 2 of each tenant's share of the capacity (10 s bursts); ``short``: caps parallel/2 and
  parallel, factors 1 and 1.5.
* **Estimates** (:func:`unit_estimate_s`): an arm's run is its schedule, at most ``drain_s``
  of draining, and :data:`RESTART_S` for llama-server's restart and the sidecar's start. A cell
  starts only when all its arms left end within the invocation's budget (:func:`cell_fits`),
  so that a cell's arms run together; a cell longer than a whole budget runs arm by arm.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from kvgate_bench.effectiveness.model.metrics import NOISY_TENANT
from kvgate_bench.effectiveness.model.schedule import Schedule
from kvgate_bench.effectiveness.model.workloads import (
    ISOLATION_WELL_BEHAVED_LOAD,
    generate,
    isolation_load,
)

NONE, CAP, BUCKET, KVGATE, KVGATE_EMPTY = (
    "none",
    "concurrency-cap",
    "token-bucket",
    "kvgate",
    "kvgate-empty",
)
#: The arms of a cell, before the per-seed rotation.
ARMS: tuple[str, ...] = (NONE, CAP, BUCKET, KVGATE, KVGATE_EMPTY)
#: ``isolation`` with the noisy tenant's requests taken out (module docstring).
ALONE = "isolation-alone"
#: The arms of an ``isolation-alone`` cell: the engine ungated and kvgate.
ALONE_ARMS: tuple[str, ...] = (NONE, KVGATE)
#: The baselines (swept on the tune seed).
BASELINES: tuple[str, ...] = (CAP, BUCKET)
#: Workloads a cell may name.
WORKLOADS: tuple[str, ...] = ("multi-tenant", "isolation", ALONE)
#: Requests per arm per cell by default (isolation: this x 0.6 well-behaved ones).
MIN_REQUESTS = 200
#: Seconds an arm's run costs beyond its schedule and drain: llama-server's restart, the
#: sidecar's start, the idle checks.
RESTART_S = 15.0
DEFAULT_CELLS = "multi-tenant:2,multi-tenant:3,isolation:3,multi-tenant:1"
SHORT_CELLS = "multi-tenant:2"


def parse_cells(text: str) -> list[tuple[str, float]]:
    """``multi-tenant:2,isolation:3`` -> [("multi-tenant", 2.0), ("isolation", 3.0)]. Raises
    ``ValueError`` (one line) for an unknown workload, a load that is not a number > 0, a
    duplicate or an empty list."""
    out: list[tuple[str, float]] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        workload, sep, load_text = item.partition(":")
        if workload not in WORKLOADS or not sep:
            raise ValueError(f"cell {item!r}: want WORKLOAD:LOAD, WORKLOAD one of {WORKLOADS}")
        try:
            load = float(load_text)
        except ValueError:
            raise ValueError(f"cell {item!r}: the load {load_text!r} is not a number") from None
        if not load > 0 or load == float("inf"):
            raise ValueError(f"cell {item!r}: the load must be > 0")
        if (workload, load) in out:
            raise ValueError(f"cell {item!r} named twice")
        out.append((workload, load))
    if not out:
        raise ValueError("no cells")
    return out


def cell_key(workload: str, load: float) -> str:
    """``multi-tenant:2``: the cell's name in the resume file and the report."""
    return f"{workload}:{load:g}"


def parse_seeds(text: str) -> list[int]:
    """``2,3,4`` -> [2, 3, 4]. Raises ``ValueError`` for a non-integer, a duplicate or none."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds {text!r}: want integers, comma-separated") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {text!r}: want distinct integers")
    return seeds


def arms_of(workload: str) -> tuple[str, ...]:
    """The arms a cell of ``workload`` runs: :data:`ALONE_ARMS` for ``isolation-alone``,
    else :data:`ARMS`."""
    return ALONE_ARMS if workload == ALONE else ARMS


def base_workload(workload: str) -> str:
    """The workload whose schedule and tenants a cell of ``workload`` uses: ``isolation``
    for ``isolation-alone``, else ``workload``."""
    return "isolation" if workload == ALONE else workload


def arm_order(seed: int, arms: tuple[str, ...] = ARMS) -> list[str]:
    """``arms`` rotated to start at index ``seed mod len(arms)``."""
    k = seed % len(arms)
    return [*arms[k:], *arms[:k]]


def total_load(workload: str, load: float) -> float:
    """The load offered in all (x capacity): ``isolation``'s noisy load plus its well-behaved
    tenants' 0.6, else ``load``."""
    return isolation_load(load) if base_workload(workload) == "isolation" else load


def needed(workload: str, min_requests: int) -> int:
    """Requests (``isolation``: well-behaved requests; ``isolation-alone`` holds no others) a
    cell's schedule must hold."""
    return round(0.6 * min_requests) if base_workload(workload) == "isolation" else min_requests


def required(workload: str) -> int:
    """Requests an arm of a cell needs for a verdict (issue 33): :data:`MIN_REQUESTS`;
    ``isolation``: well-behaved ones, 0.6 x that (120). ``--min-requests`` sizes a run, not
    this."""
    return needed(workload, MIN_REQUESTS)


def row_requests(row: Mapping[str, Any]) -> int:
    """The requests of an arm's row that :func:`required` counts: ``requests``;
    ``isolation``: ``well_behaved_requests``."""
    if row.get("workload") == "isolation":
        return int(row.get("well_behaved_requests") or 0)
    return int(row.get("requests") or 0)


def counted(workload: str, sched: Schedule) -> int:
    """The requests :func:`needed` counts in ``sched``."""
    if base_workload(workload) == "isolation":
        return sum(1 for r in sched.requests if r.tenant != NOISY_TENANT)
    return len(sched.requests)


def sized_schedule(
    workload: str,
    load: float,
    capacity_rps: float,
    seed: int,
    *,
    min_duration_s: float,
    min_requests: int,
    max_model_len: int,
) -> Schedule:
    """The cell's seeded schedule at ``total_load x capacity_rps`` requests/s, sized as the
    module docstring says (``isolation-alone``: ``isolation``'s, the noisy tenant's requests
    taken out). Raises ``ValueError`` for a capacity <= 0."""
    if workload == ALONE:
        sched = sized_schedule(
            "isolation", load, capacity_rps, seed, min_duration_s=min_duration_s,
            min_requests=min_requests, max_model_len=max_model_len,
        )  # fmt: skip
        quiet = [r for r in sched.requests if r.tenant != NOISY_TENANT]
        return dataclasses.replace(sched, requests=quiet)
    if capacity_rps <= 0:
        raise ValueError("the capacity must be > 0")
    rate = total_load(workload, load) * capacity_rps
    want = needed(workload, min_requests)
    share = (
        ISOLATION_WELL_BEHAVED_LOAD / total_load(workload, load) if workload == "isolation" else 1.0
    )
    return grown(
        lambda d: generate(workload, rate, d, seed, max_model_len=max_model_len, noisy_load=load),
        max(min_duration_s, want / (rate * share)),
        want,
        lambda sched: counted(workload, sched),
    )


def grown(
    make: Callable[[float], Schedule],
    duration_s: float,
    want: int,
    count: Callable[[Schedule], int] = lambda sched: len(sched.requests),
    maximum_s: float = math.inf,
    tries: int = 50,
) -> Schedule:
    """``make(duration)``, its duration grown by the shortfall (x 1.05) until ``count`` of the
    schedule reaches ``want`` or the duration reaches ``maximum_s`` (seconds), at most ``tries``
    schedules: seeded arrivals come in bursts, so a span can hold fewer than rate x span."""
    sched = make(duration_s)
    for _ in range(tries - 1):
        got = count(sched)
        if got >= want or duration_s >= maximum_s:
            break
        duration_s = min(maximum_s, duration_s * 1.05 * want / max(got, 1))
        sched = make(duration_s)
    return sched


def configured_schedule(
    config: Mapping[str, Any], capacity_rps: float, workload: str, load: float, seed: int
) -> Schedule:
    """:func:`sized_schedule` with the sizes of a resume file's ``config`` (its ``duration_s``,
    ``min_requests``, ``ctx`` and ``parallel``: what ``cli.run_config`` records): the cell's
    schedule as its run built it."""
    return sized_schedule(
        workload, load, capacity_rps, seed,
        min_duration_s=float(config["duration_s"]), min_requests=int(config["min_requests"]),
        max_model_len=int(config["ctx"]) // int(config["parallel"]),
    )  # fmt: skip


def tuned_on(workload: str, load: float) -> tuple[str, float]:
    """The cell whose sweep sets ``workload`` at ``load``'s baselines (module docstring)."""
    if workload == "multi-tenant" and load >= 2.0:
        return (workload, load)
    return ("multi-tenant", 2.0)  # isolation and isolation-alone included


def sweeps(short: bool, parallel: int, ttft_slo_s: float) -> dict[str, list[dict[str, Any]]]:
    """The baselines' settings (module docstring), by arm."""
    wait = round(ttft_slo_s, 3)
    if short:
        caps = sorted({max(1, parallel // 2), parallel})
        factors = [1.0, 1.5]
    else:
        caps = [*range(1, parallel + 1), 2 * parallel]
        factors = [1.0, 1.5, 2.0]
    return {
        CAP: [{"cap": c, "queue_timeout_s": wait} for c in caps],
        BUCKET: [{"factor": f, "burst_s": 10.0} for f in factors],
    }


def unit_estimate_s(duration_s: float, drain_s: float) -> float:
    """Seconds one arm's run is expected to take at most (module docstring)."""
    return duration_s + drain_s + RESTART_S


def cell_fits(unit_s: float, units_left: int, elapsed_s: float, budget_s: float) -> bool:
    """Whether a cell may start its ``units_left`` arms of ``unit_s`` seconds each
    (:func:`unit_estimate_s`), ``elapsed_s`` into a budget of ``budget_s``: when they all end
    within it, or when they could not end within even a whole budget (such a cell runs arm by
    arm, each checked by :func:`fits`)."""
    whole = unit_s * units_left
    return fits(whole, elapsed_s, budget_s) or whole > budget_s


def fits(estimate_s: float, elapsed_s: float, budget_s: float) -> bool:
    """Whether a unit estimated at ``estimate_s`` ends within ``budget_s`` of the invocation's
    start, ``elapsed_s`` seconds in."""
    return elapsed_s + estimate_s <= budget_s
