"""Step 2 of :mod:`kvgate_bench.real_engine.__main__`: the baselines' sweep on the tune seed
and the cells of the report seeds, each arm on a fresh llama-server, each result saved to the
resume file as soon as it is known.

**Units.** One arm's run of one schedule is a unit: llama-server started afresh (prompt cache
off), the arm's requests sent (:func:`kvgate_bench.real_engine.client.run_arm`), llama-server
stopped, the row saved (:mod:`kvgate_bench.real_engine.resume`). A cell starts only when all
its arms left end within the invocation's budget
(:func:`kvgate_bench.real_engine.plan.cell_fits`), and each unit only when its estimate
(:func:`kvgate_bench.real_engine.plan.unit_estimate_s`) does; otherwise the invocation stops
there, and the next one goes on from the file.

**Tuning** (:meth:`Runner.tune`): on the tune seed, the schedule of the cell that tunes this one
(:func:`kvgate_bench.real_engine.plan.tuned_on`) through every setting of the two baselines
(:func:`kvgate_bench.real_engine.plan.sweeps`); the best goodput's setting per baseline is
stored under that cell and reused on every report seed.

**Cells** (:meth:`Runner.cell`): on a report seed, the cell's schedule
(:func:`kvgate_bench.real_engine.plan.sized_schedule`) through the arms in the seed's rotated
order (:func:`kvgate_bench.real_engine.plan.arm_order`), the baselines at their tuned setting.
When every arm has run, the virtual twin runs the same schedule
(:func:`kvgate_bench.real_engine.virtual.virtual_rows`), each pair is compared
(:func:`kvgate_bench.real_engine.agreement.compare_cell`) and the cell is closed in the file.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate_bench.effectiveness.model.gate import DEGRADED, SERVED
from kvgate_bench.effectiveness.model.schedule import Schedule
from kvgate_bench.real_engine import plan, progress, resume
from kvgate_bench.real_engine.agreement import compare_cell
from kvgate_bench.real_engine.calibration_run import engine_check, profile_of, slo_of
from kvgate_bench.real_engine.cli import run_config
from kvgate_bench.real_engine.client import ArmRun, run_arm
from kvgate_bench.real_engine.engine import start_llama
from kvgate_bench.real_engine.limit_trace import summary
from kvgate_bench.real_engine.prompts import Model
from kvgate_bench.real_engine.report import row_text
from kvgate_bench.real_engine.rows import build_row, output_stats
from kvgate_bench.real_engine.virtual import arm_context, virtual_rows


def natural_outputs(run: ArmRun) -> dict[str, int]:
    """Output tokens by request id of the requests that ended on their own (EOS) or at the
    max_tokens they were sent undegraded: the lengths the twin may take as the model's."""
    out: dict[str, int] = {}
    for rec in run.result.records:
        rid = rec.request.rid
        if rec.outcome != SERVED or rid not in run.output_tokens:
            continue
        if run.finish.get(rid) in ("stop", "length"):
            out[rid] = run.output_tokens[rid]
    return out


def real_row(
    run: ArmRun,
    args: argparse.Namespace,
    slo: tuple[float, float],
    *,
    workload: str,
    load: float,
    arm: str,
    seed: int,
    params: dict[str, Any],
    tuned: str,
    position: int,
    engine_check: list[dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """The JSON row of one arm's real run (:mod:`kvgate_bench.real_engine.rows`) with what only
    the real engine has: ``cached_prompt_tokens`` (must be 0), the timeouts, 5xx, statuses,
    send lag, llama-server's gauges, the load average, the outputs' lengths and EOS share, the
    sidecar's limit (``kvgate`` arms), the lengths by request id (for the twin), ``tuned``
    (``swept``, ``reused`` or ``-``), ``params``, ``position`` (its place in the order run)
    and ``engine_check`` (llama-server's ``timings`` of one unloaded request on the arm's
    server before the arm and one after, None where it failed: the engine's speed while the
    arm ran, which the twin runs at, :mod:`kvgate_bench.real_engine.twin`)."""
    extra: dict[str, Any] = {
        "engine_check": list(engine_check or []),
        "params": params,
        "tuned": tuned,
        "position": position,
        "cached_prompt_tokens": run.cached_prompt_tokens,
        "cached_reported": len(run.cached_tokens),
        "timeouts": run.timeouts,
        "errors_5xx": run.errors_5xx,
        "statuses": run.statuses,
        "send_lag_p99_s": run.send_lag_p99_s,
        "kept_up": run.kept_up,
        "engine": run.engine.summary(),
        "loadavg_before": run.loadavg_before,
        "loadavg_after": run.loadavg_after,
        "wall_s": run.wall_s,
        "degraded_share": sum(1 for r in run.result.records if r.outcome == DEGRADED)
        / max(1, len(run.result.records)),
        **output_stats(run.output_tokens, run.finish, args.max_tokens),
        "prompt_tokens_by_id": run.prompt_tokens,
        "natural_output_tokens_by_id": natural_outputs(run),
    }
    if run.limit_trace or arm.startswith("kvgate"):
        done = [r.finished_at for r in run.result.records
                if r.outcome in (SERVED, DEGRADED) and r.finished_at is not None]  # fmt: skip
        extra.update(summary(run.limit_trace, done))
    return build_row(
        run.result, slo, workload=workload, load=load, arm=arm, seed=seed,
        profile="llama-server", extra=extra, queue_waits_s=run.queue_waits_s,
    )  # fmt: skip


@dataclass
class Runner:
    """Runs the units of an invocation against fresh llama-servers and saves each result.

    Attributes:
        args: the parsed options (:func:`kvgate_bench.real_engine.cli.parse_args`).
        server, model_path: llama-server's binary and the GGUF file.
        model: the model served (its alias).
        cache_ram_off: whether llama-server takes ``--cache-ram 0``.
        words: the prompts' text.
        workdir: where the servers' and sidecars' logs go.
        engine_cpus, client_cpus: ``taskset -c`` lists, or None.
        doc: the resume document (its ``calibration`` set).
        path: the resume file, or None (results then live in ``doc`` only).
        budget_s: seconds this invocation may run, from ``t0`` (``time.monotonic()``).
        units: the units run so far.
    """

    args: argparse.Namespace
    server: str
    model_path: str
    model: Model
    cache_ram_off: bool
    words: list[str]
    workdir: Path
    engine_cpus: str | None
    client_cpus: str | None
    doc: dict[str, Any]
    path: Path | None
    budget_s: float
    t0: float = field(default_factory=time.monotonic)
    units: int = 0

    def save(self) -> None:
        if self.path is not None:
            self.doc = resume.save(self.path, self.doc)

    def schedule(self, workload: str, load: float, seed: int) -> Schedule:
        c = self.doc["calibration"]
        return plan.configured_schedule(
            run_config(self.args), float(c["capacity_rps"]), workload, load, seed
        )

    def fits(self, sched: Schedule, what: str) -> bool:
        """Whether a unit on ``sched`` fits the budget; says so when it does not."""
        est = plan.unit_estimate_s(sched.duration_s, self.args.drain)
        elapsed = time.monotonic() - self.t0
        if plan.fits(est, elapsed, self.budget_s):
            return True
        print(
            f"budget: {what} (~{est / 60:.1f} min) would end past the "
            f"{self.budget_s / 60:.0f}-minute budget ({elapsed / 60:.1f} min used): stopping "
            "here; run again with the same --resume to go on",
            flush=True,
        )
        return False

    async def run_unit(
        self, sched: Schedule, workload: str, load: float, arm: str, params: dict[str, Any]
    ) -> tuple[ArmRun, list[dict[str, Any] | None]]:
        """``arm`` at ``params`` on ``sched`` against a llama-server of its own; with the
        engine's checks on that server before the arm and after (:func:`engine_check`)."""
        a, c = self.args, self.doc["calibration"]
        ctx = arm_context(plan.base_workload(workload), a, float(c["capacity_rps"]),
                          float(c["mean_total_tokens"]), slo_of(c), load)  # fmt: skip
        self.units += 1
        log = self.workdir / f"llama-{self.units}.log"
        proc = await asyncio.to_thread(
            start_llama, self.server, self.model_path, log, parallel=a.parallel, ctx=a.ctx,
            threads=a.threads, alias=self.model.alias, cache_ram_off=self.cache_ram_off,
            cpus=self.engine_cpus,
        )  # fmt: skip
        try:
            checks = [await engine_check(proc.url, self.words, self.model.alias)]
            run = await run_arm(
                proc.url, sched, arm, ctx, params, max_tokens=a.max_tokens, drain_s=a.drain,
                words=self.words, workdir=self.workdir, alias=self.model.alias,
                client_cpus=self.client_cpus,
            )  # fmt: skip
            checks.append(await engine_check(proc.url, self.words, self.model.alias))
            return run, checks
        finally:
            await asyncio.to_thread(proc.stop)

    def left_s(self, cells: list[tuple[str, float]], seeds: list[int]) -> tuple[int, float]:
        """(arm runs, seconds) the unfinished work of ``cells`` x ``seeds`` is estimated at, the
        tune seed's sweeps included (:func:`kvgate_bench.real_engine.progress.work_left`)."""
        left = progress.work_left(self.doc, cells, seeds, run_config(self.args))
        return int(left["arm_runs"]), float(left["seconds"] or 0.0)

    async def tune(self, workload: str, load: float) -> bool:
        """The tune seed's sweep of ``workload`` at ``load`` (module docstring); False when the
        budget stopped it."""
        key, seed = plan.cell_key(workload, load), int(self.args.tune_seed)
        if key in self.doc["tuned"]:
            return True
        sched = self.schedule(workload, load, seed)
        slo = slo_of(self.doc["calibration"])
        sweeps = plan.sweeps(self.args.short, self.args.parallel, slo.ttft_s)
        tuned: dict[str, Any] = {}
        for arm, settings in sweeps.items():
            found: list[tuple[dict[str, Any], float]] = []
            for params in settings:
                row = resume.sweep_row(self.doc, key, arm, params)
                if row is None:
                    if not self.fits(sched, f"tuning {key} {arm} {params}"):
                        return False
                    run, checks = await self.run_unit(sched, workload, load, arm, params)
                    row = real_row(run, self.args, slo.pair(), workload=workload, load=load,
                                   arm=arm, seed=seed, params=params, tuned="swept",
                                   position=0, engine_check=checks)  # fmt: skip
                    resume.add_sweep(self.doc, key, arm, params, row)
                    self.save()
                    print(f"  tune {key} seed {seed}: {row_text(row)}", flush=True)
                found.append((params, float(row["goodput_tokens_per_s"])))
            tuned[arm] = max(found, key=lambda pg: pg[1])[0]
        self.doc["tuned"][key] = tuned
        self.save()
        print(f"  tuned {key} on seed {seed}: {tuned}", flush=True)
        return True

    async def cell(self, workload: str, load: float, seed: int) -> bool:
        """One report seed's cell (module docstring); False when the budget stopped it."""
        key = plan.cell_key(workload, load)
        if (key, seed) in resume.finished(self.doc):
            return True
        tuned_key = plan.cell_key(*plan.tuned_on(workload, load))
        if not await self.tune(*plan.tuned_on(workload, load)):
            return False
        sched = self.schedule(workload, load, seed)
        slo = slo_of(self.doc["calibration"])
        print(f"{key} seed {seed}: {sched.rate_rps:.3f} req/s, {len(sched.requests)} requests "
              f"over {sched.duration_s:.0f} s", flush=True)  # fmt: skip
        order = plan.arm_order(seed, plan.arms_of(workload))
        left = [a for a in order if resume.run_row(self.doc, key, seed, a) is None]
        unit_s = plan.unit_estimate_s(sched.duration_s, self.args.drain)
        elapsed = time.monotonic() - self.t0
        if left and not plan.cell_fits(unit_s, len(left), elapsed, self.budget_s):
            print(f"budget: {key} seed {seed} ({len(left)} arms, ~{unit_s * len(left) / 60:.0f} "
                  f"min) would end past the {self.budget_s / 60:.0f}-minute budget "
                  f"({elapsed / 60:.1f} min used): stopping here; run again with the same "
                  "--resume to go on", flush=True)  # fmt: skip
            return False
        for pos, arm in enumerate(order):
            if arm not in left:
                continue
            params = dict(self.doc["tuned"][tuned_key].get(arm, {}))
            if not self.fits(sched, f"{key} seed {seed} {arm}"):
                return False
            run, checks = await self.run_unit(sched, workload, load, arm, params)
            row = real_row(run, self.args, slo.pair(), workload=workload, load=load, arm=arm,
                           seed=seed, params=params, tuned="reused" if params else "-",
                           position=pos, engine_check=checks)  # fmt: skip
            row["commit"] = self.args.commit
            resume.add_run(self.doc, key, seed, arm, row)
            self.save()
            print(row_text(row), flush=True)
        self.close(workload, load, seed, sched)
        return True

    def close(self, workload: str, load: float, seed: int, sched: Schedule) -> None:
        """The cell's twin and comparison; the cell moved into the file's ``cells``."""
        key, c = plan.cell_key(workload, load), self.doc["calibration"]
        rows = [resume.run_row(self.doc, key, seed, arm) for arm in plan.arms_of(workload)]
        real = [r for r in rows if r is not None]
        ctx = arm_context(plan.base_workload(workload), self.args, float(c["capacity_rps"]),
                          float(c["mean_total_tokens"]), slo_of(c), load)  # fmt: skip
        vrows = virtual_rows(
            sched, real, ctx, profile_of(c), slo_of(c), workload=workload, load=load,
            seed=seed, max_tokens=self.args.max_tokens,
        )  # fmt: skip
        comp = compare_cell(real, vrows)
        resume.close_cell(self.doc, {
            "cell": key, "workload": workload, "load": load, "seed": seed,
            "rate_rps": sched.rate_rps, "duration_s": sched.duration_s,
            "requests": len(sched.requests),
            "arm_order": plan.arm_order(seed, plan.arms_of(workload)),
            "tuned_on": plan.cell_key(*plan.tuned_on(workload, load)),
            "rows": real, "virtual": vrows, "comparison": comp,
        })  # fmt: skip
        self.save()
        for x in comp:
            tail = "" if x["agrees"] else f"  DISAGREE: {x['disagreement']}"
            tail += "" if x["interval_rule"] else f"  ({x['rule']})"
            print(f"  twin {x['arm']:<16} real {x['real_goodput']:6.1f} virtual "
                  f"{x['virtual_goodput']:6.1f} tok/s{tail}", flush=True)  # fmt: skip
