"""The pool runs of ``python -m kvgate_bench.effectiveness --replicas N --routers R,...``.

Each point (workload, load, replicas, seed) runs every router x arm pair on the same seeded
schedule, offered at ``load x replicas x`` one pod's load-1 rate (the single-pod calibration
of :mod:`kvgate_bench.effectiveness.runner`; every pod is the profile's engine):

* per pod, behind each router: ``none``, ``concurrency-cap`` (tuned: the best of its sweep)
  and ``kvgate`` (the recommended policy, :mod:`.kvgate_defaults`; behind ``epp`` the EPP
  reads kvgate's gauges, ``kvgate_queue_depth`` and ``kvgate_kv_reserved_fraction``);
* at the router, behind ``epp`` only: ``flow-control``, llm-d's flow control
  (:class:`PoolFlowControlArm`, tuned) with ``none`` per pod;
* run only when named (``--arms``): ``dynamo-drr`` per pod (NVIDIA Dynamo's policy-class
  queues in front of each replica, each with its own state: :mod:`..arms.dynamo_drr`), tuned
  over its sweep with the classes the workload's users would give it (``tier``: the declared
  classes, ``premium`` and ``regular`` on ``tiers``, with their weights);
* run only when named: ``kvgate-exchange``, ``kvgate`` with the replicas' exchange of service
  counters on (pool-wide fair shares, one shared in-memory exchange per run:
  :mod:`.exchange`).

``epp-affinity`` (run only when named) is ``epp`` with each tenant pinned to a home replica
(:mod:`kvgate_bench.effectiveness.pool.routers`); flow control stands in front of it too.

``least-request`` and ``epp`` retry refusals as Envoy does with the recipe of
``docs/routers.md`` (:class:`~kvgate_bench.effectiveness.pool.routers.RetryPolicy`); ``random``
(kube-proxy) never retries. Rows are the single-pod rows' keys plus ``replicas``, ``router``,
``refused_while_room``, ``retries`` and ``per_replica_requests``
(:mod:`kvgate_bench.effectiveness.pool`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvgate_bench.effectiveness.arms import dynamo_drr
from kvgate_bench.effectiveness.arms.flow_control import FlowControlArm
from kvgate_bench.effectiveness.arms.flow_control import candidates as fc_candidates
from kvgate_bench.effectiveness.arms.registry import make_arm
from kvgate_bench.effectiveness.calibration import Calibration
from kvgate_bench.effectiveness.model.engines import steptime_of
from kvgate_bench.effectiveness.model.gate import Arm, Gate
from kvgate_bench.effectiveness.model.metrics import summarize
from kvgate_bench.effectiveness.model.workloads import generate
from kvgate_bench.effectiveness.pool.driver import FrontGate, Replica, simulate_pool
from kvgate_bench.effectiveness.pool.exchange import EXCHANGE_ARM, KvgateExchangeArm, MemoryExchange
from kvgate_bench.effectiveness.pool.routers import (
    ALL_ROUTERS,
    EPP_ROUTERS,
    RetryPolicy,
    make_router,
)
from kvgate_bench.effectiveness.runner import run_parallel, tuning_seed_of

#: The arms of a pool run by default, in report order (names are an interface: JSON ``arm``).
POOL_ARMS: tuple[str, ...] = ("none", "concurrency-cap", "kvgate", "flow-control")
#: Pool arms run only when named (``--arms``).
POOL_EXTRA_ARMS: tuple[str, ...] = ("dynamo-drr", EXCHANGE_ARM)
#: Every pool arm, in report order.
ALL_POOL_ARMS: tuple[str, ...] = POOL_ARMS + POOL_EXTRA_ARMS
#: The concurrency cap's settings swept per pod (``--short``: fewer).
CAP_SWEEP = ((32, 0.25), (64, 0.25), (64, 1.0), (128, 0.25), (128, 1.0), (192, 1.0))
SHORT_CAP_SWEEP = ((64, 0.25), (128, 0.25), (128, 1.0))


class PoolFlowControlArm(FlowControlArm):
    """llm-d's flow control at the EPP, in front of the whole pool (see
    :class:`~kvgate_bench.effectiveness.arms.flow_control.FlowControlArm` for its bands, flows and
    TTL). The saturation detector reads every replica at each scrape: a replica is saturated
    at ``queue_threshold`` waiting or ``kv_threshold`` KV usage, and the pool while every
    replica is, counting the requests dispatched since the scrape against the queue room of
    the replicas not saturated by KV (any one of them may get each)."""

    name = "flow-control"

    def __init__(self, ttl_s: float, queue_threshold: int, kv_threshold: float) -> None:
        super().__init__(ttl_s, queue_threshold, kv_threshold)
        self.replicas: list[Replica] = []
        self._room = 0

    def start(self, gate: Gate, now: float) -> None:
        if not isinstance(gate, FrontGate):
            raise TypeError("PoolFlowControlArm stands in front of a pool (simulate_pool)")
        self.replicas = gate.pool.replicas
        super().start(gate, now)

    def scrape(self, now: float) -> None:
        self._room = sum(
            max(0, self.queue_threshold - r.engine.num_waiting)
            for r in self.replicas
            if r.engine.kv_usage < self.kv_threshold
        )
        self._scraped_at, self._since_scrape = now, 0
        self._next_scrape = now + self.scrape_s

    def saturated(self, now: float) -> bool:
        return now - self._scraped_at > self.staleness_s or self._since_scrape >= self._room

    def busy(self) -> bool:
        return bool(self._queued) or any(r.engine.has_work for r in self.replicas)


def pool_candidates(arm: str, short: bool) -> list[dict[str, Any]]:
    """The settings swept for ``arm`` in a pool run (one empty dict for untuned arms)."""
    if arm == "concurrency-cap":
        sweep = SHORT_CAP_SWEEP if short else CAP_SWEEP
        return [{"cap": c, "queue_timeout_s": q} for c, q in sweep]
    if arm == "flow-control":
        return fc_candidates(True)
    if arm == "dynamo-drr":  # the classes as the workload's users declare them
        return [c for c in dynamo_drr.candidates(short) if c["classes"] == "tier"]
    return [{}]


def pairs(routers: Iterable[str], arms: Iterable[str]) -> list[tuple[str, str]]:
    """The (router, arm) pairs run: every pair but ``flow-control`` off the EPP routers."""
    return [(r, a) for r in routers for a in arms if a != "flow-control" or r in EPP_ROUTERS]


@dataclass(frozen=True)
class PoolTask:
    """One pool run: a router x arm setting on one schedule."""

    workload: str
    load: float
    seed: int
    replicas: int
    router: str
    arm: str
    params: tuple[tuple[str, Any], ...]
    profile: str
    duration_s: float
    calibration: Calibration
    #: Envoy's ``rate_limited_retry_back_off.max_interval`` (seconds): a longer Retry-After is
    #: ignored and the exponential back-off applies (:class:`RetryPolicy`).
    retry_after_cap_s: float = RetryPolicy.max_interval_s


def run_pool_task(task: PoolTask) -> dict[str, Any]:
    """Simulate ``task``; its row (see the module docstring)."""
    steptime = steptime_of(task.profile)
    cal = task.calibration
    ctx = cal.context(steptime, task.workload)
    n = task.replicas
    sched = generate(task.workload, cal.rate(task.load) * n, task.duration_s, task.seed)
    params = dict(task.params)
    front: Arm | None = None
    per_pod = task.arm
    if task.arm == "flow-control":
        front = PoolFlowControlArm(
            float(params.get("ttl_s", 60.0)),
            int(params.get("queue_threshold", 5)),
            float(params.get("kv_threshold", 0.8)),
        )
        per_pod = "none"
    kvgate_gauges = task.arm.startswith("kvgate")
    router = make_router(task.router, task.seed, ctx.engine.block_size, kvgate_gauges)
    retry = RetryPolicy(max_interval_s=task.retry_after_cap_s) if router.retries else None

    exchange = MemoryExchange()

    def arm_of(i: int) -> Arm:
        if per_pod == EXCHANGE_ARM:  # the replicas share one exchange
            return KvgateExchangeArm(ctx, exchange, params)
        return make_arm(per_pod, ctx, {} if front is not None else params)

    run, stats = simulate_pool(sched, arm_of, router, steptime, n, front=front, retry=retry)
    row: dict[str, Any] = {
        "workload": task.workload,
        "load": task.load,
        "arm": task.arm,
        "seed": task.seed,
        "replicas": n,
        "router": task.router,
    }
    row.update(summarize(run))
    row["params"] = params
    row["refused_while_room"] = stats.refused_while_room
    row["retries"] = stats.retries
    row["per_replica_requests"] = stats.per_replica_requests
    row["rate_rps"] = sched.rate_rps
    return row


def build_pool_tasks(
    workloads: Iterable[str],
    loads: Iterable[float],
    seeds: Iterable[int],
    replicas: Iterable[int],
    routers: Iterable[str],
    arms: Iterable[str],
    calibrations: dict[str, Calibration],
    prof: str,
    duration_s: float,
    short: bool,
    retry_after_cap_s: float = RetryPolicy.max_interval_s,
) -> list[PoolTask]:
    """Every pool run, the heaviest (most replicas, highest load) first. Raises
    ``ValueError`` for an unknown router or arm."""
    routers, arms = list(routers), list(arms)
    for r in routers:
        if r not in ALL_ROUTERS:
            raise ValueError(f"unknown router {r!r}; choose from {', '.join(ALL_ROUTERS)}")
    for a in arms:
        if a not in ALL_POOL_ARMS:
            raise ValueError(f"unknown pool arm {a!r}; choose from {', '.join(ALL_POOL_ARMS)}")
    tasks = [
        PoolTask(
            w,
            load,
            seed,
            n,
            router,
            arm,
            tuple(sorted(p.items())),
            prof,
            duration_s,
            calibrations[w],
            retry_after_cap_s,
        )
        for w in workloads
        for load in loads
        for seed in seeds
        for n in replicas
        for router, arm in pairs(routers, arms)
        for p in pool_candidates(arm, short)
    ]
    tasks.sort(key=lambda t: (-t.replicas * t.load, t.router, t.arm))
    return tasks


def run_pool_all(
    tasks: list[PoolTask], jobs: int, progress: Callable[[int, int], None] | None = None
) -> list[dict[str, Any]]:
    """Run ``tasks`` on ``jobs`` processes (1: in this process); rows in task order."""
    return run_parallel(run_pool_task, tasks, jobs, progress)


def _point(r: dict[str, Any]) -> tuple[str, float, int, str, str]:
    return (r["workload"], r["load"], r["replicas"], r["router"], r["arm"])


def pick_best_pool(
    rows: list[dict[str, Any]], tune_seed: int | None = None
) -> list[dict[str, Any]]:
    """The rows (every seed's) of each (workload, load, replicas, router, arm)'s best setting by
    goodput on the tuning seed alone (``tune_seed``, by default the first seed of ``rows``: a
    tuned baseline, as its users would tune it, chosen without the seeds it is reported on),
    each flagged ``tuning_seed``: true on the tuning seed's row. Raises ``ValueError`` when
    ``rows`` hold no run of ``tune_seed``."""
    if not rows:
        return []
    tune = tuning_seed_of(rows, tune_seed)
    tuned: dict[tuple[Any, ...], list[float]] = {}
    for r in rows:
        gs = tuned.setdefault((*_point(r), json.dumps(r["params"], sort_keys=True)), [])
        if r["seed"] == tune:
            gs.append(float(r["goodput_tokens_per_s"]))
    best: dict[tuple[Any, ...], tuple[float | None, str]] = {}
    for key, gs in tuned.items():
        g = sum(gs) / len(gs) if gs else None
        held = best.get(key[:-1])
        if held is None or (g is not None and (held[0] is None or g > held[0])):
            best[key[:-1]] = (g, key[-1])
    chosen = [r for r in rows if json.dumps(r["params"], sort_keys=True) == best[_point(r)][1]]
    for r in chosen:
        r["tuning_seed"] = r["seed"] == tune
    return chosen
