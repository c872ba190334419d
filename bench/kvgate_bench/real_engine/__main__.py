"""``python -m kvgate_bench.real_engine``: kvgate's goodput in front of llama-server, a verdict
that holds (issue 33).

The full verdict takes hours on two cores, so a run is resumable and each invocation bounded::

    python -m kvgate_bench.real_engine --resume real.json              # repeat until done
    python -m kvgate_bench.real_engine --report real.json              # the verdict

Defaults: SmolLM2-135M-Instruct (``--model gemma``: Gemma 3 270M), llama-server ``--parallel 4
-c 4096 --no-kv-unified -t 1 --cache-ram 0``, the baselines tuned on seed 1 (``--tune-seed``),
reported on seeds 2, 3, 4 (``--seeds``), cells ``multi-tenant:2,multi-tenant:3,isolation:3,
multi-tenant:1`` (``--cells``), at least 200 requests an arm a cell (``--min-requests``;
isolation: 120 well-behaved ones), at most 60 minutes an invocation (``--budget-minutes``).
llama-server is pinned to the last CPU, this process and the sidecar to the others
(:func:`kvgate_bench.real_engine.engine.pin_cpus`).

1. **Calibrates** once (:mod:`kvgate_bench.real_engine.calibration_run`: the SLO, the engine
   profile with its decode table by batch size, the capacity), kept in the resume file and
   reused; ``--write-profile FILE`` writes the profile.
2. **Runs** (:mod:`kvgate_bench.real_engine.cells`), report seed by report seed, each cell: the
   tune seed's sweep of the baselines first where the cell has none, then ``none``,
   ``concurrency-cap``, ``token-bucket``, ``kvgate`` and ``kvgate-empty`` in the seed's rotated
   order, each on a fresh llama-server with its prompt cache off (every request's cached
   prompt tokens counted: ``cached_prompt_tokens`` must be 0), then the cell's virtual twin on
   the fitted profile and the comparison. Every arm's row is saved to ``--resume`` as soon as
   it is known (atomically) with the commit it ran at (``commit``, ``-dirty`` when the
   checkout had changes); a unit that would end past the budget is not started.
   ``--rerun ARM,...`` first reopens the finished cells of ``--cells`` and ``--seeds`` so that
   those arms run again (after their code changed; the old rows kept in the file's
   ``replaced``: :func:`kvgate_bench.real_engine.resume.reopen`).
3. **Reports** (:mod:`kvgate_bench.real_engine.verdict`): the ratios between arms with
   bootstrap 95 % intervals per seed and pooled, the issue's targets, the twin's agreement.
   ``--report FILE`` prints it from a resume file without running anything, with what is
   left to run (:mod:`kvgate_bench.real_engine.progress`) and the twin recomputed on today's
   fit, at the calibrated speed and at each arm's (:mod:`kvgate_bench.real_engine.twin`);
   ``--seeds`` chooses the report seeds among those the file has (default every seed but the
   tune seed), ``--cells`` the cells. A cell under the issue's size (200 requests an arm,
   isolation 120 well-behaved) or a ``--short`` run is labelled "not a verdict", its targets
   "indicative".

SIGTERM stops an invocation as ^C does: the running arm is cancelled, its llama-server and
sidecar stopped, what finished stays in the resume file; the exit status is 143.

``--short`` is a plumbing run, not a verdict (one cell, ``multi-tenant:2``, of 20 requests an
arm, one report seed, a smaller sweep: about 12 minutes on 2 cores). ``--json FILE`` writes
``{"meta", "calibration", "tuned", "cells", "verdict"}``
(:func:`kvgate_bench.real_engine.report.report_json`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvgate_bench.real_engine import resume
from kvgate_bench.real_engine.calibration_run import calibrate, calibration_text, profile_of
from kvgate_bench.real_engine.cells import Runner
from kvgate_bench.real_engine.cli import error_line, parse_args, run_config
from kvgate_bench.real_engine.engine import find_llama, has_flag, pin_cpus, start_llama
from kvgate_bench.real_engine.plan import cell_key
from kvgate_bench.real_engine.progress import left_text, planned, work_left
from kvgate_bench.real_engine.prompts import MODELS, corpus
from kvgate_bench.real_engine.report import report_json
from kvgate_bench.real_engine.twin import recompute
from kvgate_bench.real_engine.verdict import verdict
from kvgate_bench.real_engine.verdict_text import verdict_lines
from kvgate_bench.sim.profile_file import write_profile


def _meta(
    args: argparse.Namespace, server: str, model: str, cpus: tuple[Any, Any]
) -> dict[str, Any]:
    """This invocation's ``meta``: the server, the model, the options, the CPUs and pinning,
    the load average, the machine (``wall_s`` and ``loadavg_end`` added at the end)."""
    return {
        "llama_server": server,
        "model_file": model,
        "options": run_config(args),
        "cells": [f"{w}:{load:g}" for w, load in args.cell_list],
        "seeds": args.seed_list,
        "tune_seed": args.tune_seed,
        "cpus": os.cpu_count() or 1,
        "engine_cpus": cpus[0],
        "client_cpus": cpus[1],
        "loadavg_start": os.getloadavg(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _commit() -> str | None:
    """The git commit of the checkout this benchmark runs from (``git rev-parse HEAD`` in this
    file's folder, ``-dirty`` appended when tracked files differ from it); None outside a git
    checkout or without git."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True, timeout=10,
                               check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}-dirty" if dirty else head


def _report(args: argparse.Namespace) -> int:
    """``--report FILE``: the verdict from a resume file; exit 2 with one line for a file that
    is missing, empty, not JSON or malformed (:func:`kvgate_bench.real_engine.resume.validate`,
    or a row that lacks what the verdict reads)."""
    try:
        doc = resume.load(args.report)
        if doc is None:
            raise ValueError(f"{args.report}: no such file")
        resume.validate(doc)
        cells = [cell_key(w, load) for w, load in args.cell_list] if args.cells else None
        v = verdict(doc, args.seed_list if args.seeds else None, cells)
        v["twin"] = recompute(doc, v["report_seeds"], cells)
        plan_of = planned(doc, args.cell_list if args.cells else None,
                          args.seed_list if args.seeds else None)  # fmt: skip
        v["left"] = work_left(doc, *plan_of, doc["config"])
        lines = verdict_lines(v)
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        return error_line(f"--report {args.report}: malformed resume file "
                          f"({type(e).__name__}: {e})")  # fmt: skip
    except ValueError as e:
        where = "" if str(e).startswith(str(args.report)) else f"{args.report}: "
        return error_line(f"--report {where}{e}")
    for line in lines:
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps(report_json({"report": str(args.report)}, doc, v),
                                        indent=1, default=str))  # fmt: skip
    return 0


async def _calibrate(runner: Runner) -> None:
    """The calibration on a server of its own, into the resume document."""
    a = runner.args
    proc = await asyncio.to_thread(
        start_llama, runner.server, runner.model_path, runner.workdir / "llama-calibration.log",
        parallel=a.parallel, ctx=a.ctx, threads=a.threads, alias=runner.model.alias,
        cache_ram_off=runner.cache_ram_off, cpus=runner.engine_cpus,
    )  # fmt: skip
    try:
        c = await calibrate(proc.url, a, runner.words, runner.workdir)
    finally:
        await asyncio.to_thread(proc.stop)
    c = json.loads(json.dumps(c, default=str))
    runner.doc["calibration"], runner.doc["profile"] = c, c["profile"]
    runner.save()


async def _main(args: argparse.Namespace) -> int:
    if args.report is not None:
        return _report(args)
    task = asyncio.current_task()
    if task is not None:  # SIGTERM cancels the run, so that its servers are stopped
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    if args.resume is None:
        return await _run(args)
    # Held for the whole invocation: --rerun writes over the file (resume.hold).
    try:
        fd = resume.hold(args.resume, exclusive=bool(args.rerun_arms))
    except ValueError as e:
        return error_line(f"--resume {e}")
    try:
        return await _run(args)
    finally:
        os.close(fd)


async def _run(args: argparse.Namespace) -> int:
    """One invocation, start to end (the module docstring's steps)."""
    t_start = time.monotonic()
    model = MODELS[args.model]
    try:
        doc = resume.load(args.resume) if args.resume is not None else None
        if doc is not None:
            resume.check(doc, run_config(args), args.tune_seed)
            resume.validate(doc)
    except ValueError as e:
        where = "" if str(e).startswith(str(args.resume)) else f"{args.resume}: "
        return error_line(f"--resume {where}{e}")
    doc = doc or resume.new_doc(run_config(args), args.tune_seed)
    commit = args.commit = _commit()
    if args.rerun_arms:
        why = f"--rerun {','.join(args.rerun_arms)} at {commit or 'an unknown commit'}"
        reopened = [
            f"{cell}@{seed} ({', '.join(arms)})"
            for seed in args.seed_list
            for cell in (cell_key(w, load) for w, load in args.cell_list)
            if (arms := resume.reopen(doc, cell, seed, args.rerun_arms, why))
        ]
        if not reopened:
            return error_line(f"--rerun: no finished cell of --cells/--seeds has "
                              f"{', '.join(args.rerun_arms)} in {args.resume}")  # fmt: skip
        resume.write(args.resume, doc)
        print(f"rerun: reopened {'; '.join(reopened)} (the old rows kept in 'replaced')",
              flush=True)  # fmt: skip
    server, model_path = find_llama(model)
    cache_ram_off = has_flag(server, "--cache-ram")
    if not cache_ram_off:
        print("warning: this llama-server has no --cache-ram; cache_prompt false alone keeps "
              "prompts uncached (cached_prompt_tokens is checked)", flush=True)  # fmt: skip
    cpus = pin_cpus(args.no_pin)
    meta = _meta(args, server, model_path, cpus)
    meta["cache_ram_off"] = cache_ram_off
    meta["commit"] = commit
    print(f"real engine: {Path(server).name}, {Path(model_path).name}, --parallel "
          f"{args.parallel} -c {args.ctx} -t {args.threads}, engine on CPU {cpus[0]}, client on "
          f"{cpus[1]}; load average {meta['loadavg_start'][0]:.2f}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvgate-real-") as tmp:
        runner = Runner(
            args, server, model_path, model, cache_ram_off, corpus(), Path(tmp), cpus[0],
            cpus[1], doc, args.resume, args.budget_minutes * 60.0, t_start,
        )  # fmt: skip
        if runner.doc["calibration"] is None:
            await _calibrate(runner)
        c = runner.doc["calibration"]
        print(calibration_text(c), flush=True)
        if args.write_profile is not None:
            write_profile(profile_of(c), args.write_profile)
        units, secs = runner.left_s(args.cell_list, args.seed_list)
        print(f"{left_text(units, secs)} (at most; invocations of {args.budget_minutes:g} min)",
              flush=True)  # fmt: skip
        done = True
        for seed in args.seed_list:
            for workload, load in args.cell_list:
                done = await runner.cell(workload, load, seed)
                if not done:
                    break
            if not done:
                break
    meta["wall_s"] = time.monotonic() - t_start
    meta["loadavg_end"] = os.getloadavg()
    runner.doc["invocations"].append({"started": meta["started"], "wall_s": meta["wall_s"],
                                      "units": runner.units, "finished": done,
                                      "cells": meta["cells"], "seeds": args.seed_list})  # fmt: skip
    runner.save()
    v = verdict(runner.doc, args.seed_list)
    v["left"] = work_left(runner.doc, args.cell_list, args.seed_list, run_config(args))
    for line in verdict_lines(v):
        print(line)
    print(f"wall {meta['wall_s'] / 60:.1f} min; {'all cells done' if done else 'not finished'}")
    if args.json is not None:
        args.json.write_text(json.dumps(report_json(meta, runner.doc, v), indent=1, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; the exit status (2 for a bad option or resume file, 143 when SIGTERM
    stopped it)."""
    try:
        return asyncio.run(_main(parse_args(argv)))
    except asyncio.CancelledError:
        print("stopped by SIGTERM: the running arm was cut; finished units are kept", flush=True)
        return 128 + signal.SIGTERM


if __name__ == "__main__":
    sys.exit(main())
