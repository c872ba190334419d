"""``python -m kvgate_bench.real_engine``: kvgate's goodput in front of llama-server (issue 24).

Starts llama-server (:func:`kvgate_bench.real_engine.engine.find_llama`: the test command's
build; ``--parallel 4 -c 4096 --no-kv-unified -t 1`` by default, the issue's), pinned to the
last CPU with this process and the sidecar on the others (``taskset``, where there are two CPUs
or more: :func:`kvgate_bench.real_engine.engine.pin_cpus`), then:

1. **Calibrates** (:mod:`kvgate_bench.real_engine.calibration_run`): unloaded requests of three
   prompt lengths (five without ``--short``), one at a time (TTFT, TPOT, the outputs' lengths;
   the SLO: :mod:`kvgate_bench.real_engine.calibration`); two bursts of 2 and ``parallel``
   equal requests (decode steps of several sequences); the step-time model fitted to
   llama-server's ``timings``; then ``none``'s probes on ``conversation`` (Poisson chat
   arrivals), the first at the capacity the fitted engine predicts in virtual time
   (:func:`kvgate_bench.real_engine.virtual.predicted_capacity`), the next bracketing the rate
   at which ``none`` meets the SLO for 90 %
   (:func:`kvgate_bench.real_engine.calibration.next_probe`; 2 probes with ``--short``, 3
   without), each long enough for 15 arrivals (15-45 s with ``--short``, 20-60 s without:
   :func:`kvgate_bench.real_engine.calibration.probe_duration`).
2. **Runs** each cell (:mod:`kvgate_bench.real_engine.cells`: ``multi-tenant`` at loads 1, 2
   and 3; ``isolation`` with the noisy tenant at 3x, total load 3.6; ``--short``: multi-tenant
   1 and 2, isolation 3) through ``none``, the tuned ``concurrency-cap``, the tuned
   ``token-bucket`` and ``kvgate``, each in turn against the same server, one seeded open-loop
   schedule per cell (:mod:`kvgate_bench.real_engine.client`). The baselines are swept on
   multi-tenant at load 2 (cap: half the slot count and the slot count, queue wait = the TTFT
   SLO; bucket: factors 1 and 1.5 of each tenant's share of the capacity, 10 s bursts; the full
   run adds a cap of twice the slots and factor 2) and their best setting runs the other cells.
3. **Compares** each row with the virtual benchmark on the same schedule (the prompts' and
   outputs' lengths llama-server reported in that cell's ``none`` run) with the fitted engine:
   ``simulate`` with the same arm and setting, 4 slots of ``ctx / parallel`` tokens
   (:mod:`kvgate_bench.real_engine.virtual`).

``--json FILE`` writes ``{"meta", "calibration", "rows", "virtual", "comparison", "targets"}``
(:func:`kvgate_bench.real_engine.report.report_json`; the options:
:mod:`kvgate_bench.real_engine.cli`). The machine's quietness is in ``meta`` (CPUs, pinning,
threads, load average) and per row (load average before and after, the client's send lag:
``kept_up``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvgate_bench.real_engine.calibration_run import calibrate, calibration_text
from kvgate_bench.real_engine.cells import CellRunner
from kvgate_bench.real_engine.cli import parse_args
from kvgate_bench.real_engine.client import corpus
from kvgate_bench.real_engine.engine import find_llama, pin_cpus, start_llama
from kvgate_bench.real_engine.report import comparison, report_json, summary_lines, targets


def _meta(
    args: argparse.Namespace,
    server: str,
    model: str,
    engine_cpus: str | None,
    client_cpus: str | None,
    load0: tuple[float, float, float],
) -> dict[str, Any]:
    """The run's ``meta`` (``loadavg_end`` and ``wall_s`` are added at the end): the server, the
    model, the options, the CPUs and the pinning, the load average at the start, the machine."""
    return {
        "llama_server": server,
        "model": model,
        "parallel": args.parallel,
        "ctx": args.ctx,
        "threads": args.threads,
        "cpus": os.cpu_count() or 1,
        "engine_cpus": engine_cpus,
        "client_cpus": client_cpus,
        "loadavg_start": load0,
        "short": args.short,
        "seed": args.seed,
        "duration_s": args.duration,
        "drain_s": args.drain,
        "max_tokens": args.max_tokens,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


async def _main(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    server, model = find_llama()
    engine_cpus, client_cpus = pin_cpus(args.no_pin)
    load0 = os.getloadavg()
    words = corpus()
    meta = _meta(args, server, model, engine_cpus, client_cpus, load0)
    print(
        f"real engine: llama-server {Path(server).name}, {Path(model).name}, --parallel "
        f"{args.parallel} -c {args.ctx} -t {args.threads}, engine on CPU {engine_cpus}, client "
        f"on {client_cpus}; load average {load0[0]:.2f}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="kvgate-real-") as tmp:
        workdir = Path(tmp)
        proc = await asyncio.to_thread(
            start_llama,
            server,
            model,
            workdir / "llama.log",
            parallel=args.parallel,
            ctx=args.ctx,
            threads=args.threads,
            cpus=engine_cpus,
        )
        try:
            c = await calibrate(proc.url, args, words, workdir)
            print(calibration_text(c), flush=True)
            runner = CellRunner(proc.url, args, c, words, workdir, client_cpus)
            rows, vrows = await runner.run()
        finally:
            await asyncio.to_thread(proc.stop)
    comp = comparison(rows, vrows)
    tg = targets(rows)
    for line in summary_lines(comp, tg):
        print(line)
    meta["loadavg_end"] = os.getloadavg()
    meta["wall_s"] = time.perf_counter() - t_start
    print(f"wall {meta['wall_s']:.0f} s; load average {meta['loadavg_end'][0]:.2f}")
    if args.json is not None:
        doc = report_json(meta, c, rows, vrows, comp, tg)
        args.json.write_text(json.dumps(doc, indent=2, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; the exit status."""
    return asyncio.run(_main(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
