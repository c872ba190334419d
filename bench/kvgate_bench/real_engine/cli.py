"""The command line of ``python -m kvgate_bench.real_engine``: its flags, their defaults, the
``--help`` text and the checks that refuse a bad option (exit status 2, one line on stderr)
before anything runs (the run itself: :mod:`kvgate_bench.real_engine.__main__`).

Defaults filled in after parsing (the flag's own default is None): ``--max-tokens`` the
model's ceiling (SmolLM2 256, Gemma 96); ``--duration`` 60 s (``--short`` 20 s), the shortest
schedule (a cell's is longer when it needs more time for ``--min-requests``); ``--drain`` 20 s
(``--short`` 8 s); ``--probe-duration`` 20 s (``--short`` 15 s); ``--min-requests`` 200
(``--short`` 20); ``--cells`` ``multi-tenant:2,multi-tenant:3,isolation:3,multi-tenant:1``
(``--short``: ``multi-tenant:2``); ``--seeds`` 2,3,4 (``--short``: 2); ``rerun_arms`` the
arms of ``--rerun`` (() without it).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import NoReturn

from kvgate_bench.real_engine.plan import (
    ARMS,
    DEFAULT_CELLS,
    MIN_REQUESTS,
    SHORT_CELLS,
    parse_cells,
    parse_seeds,
)
from kvgate_bench.real_engine.prompts import MODELS

PROG = "python -m kvgate_bench.real_engine"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="kvgate's goodput in front of a real llama-server (none, tuned cap, tuned "
        "token bucket, kvgate, kvgate with an empty spec), each arm on a fresh server with its "
        "prompt cache off, next to the virtual benchmark on the fitted engine profile. "
        "Resumable: --resume FILE keeps every finished cell; --report FILE prints the verdict. "
        "llama-server and the models: $KVGATE_LLAMA_SERVER, $KVGATE_SMOLLM2_MODEL, "
        "$KVGATE_LLAMA_MODEL (Gemma), else the test command's cache, else scripts/build-llama "
        "builds and fetches them.",
    )
    p.add_argument(
        "--short",
        action="store_true",
        help="a plumbing run, not a verdict: one cell of 20 requests an arm, one seed (about "
        "12 min on 2 cores)",
    )
    p.add_argument(
        "--model", choices=sorted(MODELS), default="smollm2", help="the model (default smollm2)"
    )
    p.add_argument("--seeds", help="report seeds, comma-separated (default 2,3,4; --short 2)")
    p.add_argument(
        "--tune-seed",
        type=int,
        default=1,
        help="the seed the baselines' sweep runs on (default 1); its choice is reused",
    )
    p.add_argument(
        "--cells",
        help=f"WORKLOAD:LOAD,... of multi-tenant, isolation and isolation-alone (isolation's "
        f"well-behaved tenants alone, through none and kvgate; default {DEFAULT_CELLS})",
    )
    p.add_argument("--resume", type=Path, help="JSON of finished cells: read, skipped, appended")
    p.add_argument(
        "--report",
        type=Path,
        help="print the verdict from this resume file and exit (runs nothing)",
    )
    p.add_argument(
        "--budget-minutes",
        type=float,
        default=60.0,
        help="start no arm run the estimate says ends past this (default 60)",
    )
    p.add_argument(
        "--min-requests",
        type=int,
        help=f"requests per arm per cell (isolation: 0.6x this well-behaved; default "
        f"{MIN_REQUESTS}; --short 20)",
    )
    p.add_argument("--parallel", type=int, default=4, help="llama-server slots (default 4)")
    p.add_argument(
        "--ctx", type=int, default=4096, help="llama-server context, all slots (default 4096)"
    )
    p.add_argument("--threads", type=int, default=1, help="llama-server threads (default 1)")
    p.add_argument(
        "--max-tokens", type=int, help="max_tokens ceiling (default: SmolLM2 256, Gemma 96)"
    )
    p.add_argument(
        "--duration", type=float, help="shortest schedule per cell, s (default 60; --short 20)"
    )
    p.add_argument(
        "--drain",
        type=float,
        help="seconds after a schedule before cutting (default 20 s; --short 8 s)",
    )
    p.add_argument(
        "--probe-duration",
        type=float,
        help=(
            "shortest capacity probe, s (a probe is long enough for 40 arrivals, up to 900 s;"
            " --short: 15 arrivals, up to 3x this; default 20 s; --short 15 s)"
        ),
    )
    p.add_argument(
        "--rerun",
        help="ARM,... to run again on the finished cells of --cells and --seeds in the --resume "
        "file (after their code changed, e.g. kvgate,kvgate-empty after an admission change): "
        "their rows are set aside in the file's 'replaced', the other arms' kept; no other "
        "invocation may write the file meanwhile",
    )
    p.add_argument("--no-pin", action="store_true", help="no taskset pinning")
    p.add_argument("--json", type=Path, help="also write this invocation's rows and verdict here")
    p.add_argument("--write-profile", type=Path, help="write the fitted engine profile (JSON) here")
    return p


def error_line(message: str) -> int:
    """``message`` on stderr as one line, ``python -m kvgate_bench.real_engine: error: ...``
    (as argparse and :class:`_Refuse` refuse); the exit status, 2."""
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


class _Refuse:
    """``error(message)``: the message on stderr, one line, and exit status 2."""

    @staticmethod
    def error(message: str) -> NoReturn:
        raise SystemExit(error_line(message))


def _check(p: _Refuse, a: argparse.Namespace) -> None:
    """Refuse bad values with ``p.error`` (exit 2, one line)."""
    for name in ("parallel", "ctx", "threads", "max_tokens", "min_requests"):
        v = getattr(a, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    for name in ("duration", "drain", "probe_duration", "budget_minutes"):
        v = getattr(a, name)
        if v is not None and (not math.isfinite(v) or v <= 0):
            p.error(f"--{name.replace('_', '-')} must be a number > 0, got {v}")
    if a.ctx < 2 * a.parallel:
        p.error(f"--ctx {a.ctx} leaves under 2 tokens a slot at --parallel {a.parallel}")
    try:
        a.cell_list = parse_cells(a.cells or (SHORT_CELLS if a.short else DEFAULT_CELLS))
        a.seed_list = parse_seeds(a.seeds or ("2" if a.short else "2,3,4"))
    except ValueError as e:
        p.error(str(e))
    if a.tune_seed in a.seed_list:
        p.error(f"--tune-seed {a.tune_seed} is also a report seed: report on other seeds")
    a.rerun_arms = tuple(x.strip() for x in (a.rerun or "").split(",") if x.strip())
    unknown = [x for x in a.rerun_arms if x not in ARMS]
    if unknown:
        p.error(f"--rerun {','.join(unknown)}: not an arm (arms: {', '.join(ARMS)})")
    if a.rerun is not None and not a.rerun_arms:
        p.error("--rerun wants at least one arm")
    if a.rerun_arms and (a.resume is None or not a.resume.is_file()):
        p.error("--rerun needs the --resume file whose finished cells it reopens")
    if a.rerun_arms and a.report is not None:
        p.error("--rerun runs arms; --report runs nothing: give one of them")
    if a.report is not None and not a.report.is_file():
        p.error(f"--report {a.report}: no such file")
    for name in ("resume", "json", "write_profile"):
        path = getattr(a, name)
        if path is not None and not path.resolve().parent.is_dir():
            p.error(f"--{name.replace('_', '-')} {path}: its folder does not exist")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The run's options from ``argv`` (default ``sys.argv[1:]``), the defaults filled in and
    ``cell_list`` ([(workload, load)]) and ``seed_list`` ([int]) added. Exits 2 with a one-line
    message for a bad option (:func:`_check`)."""
    a = _parser().parse_args(argv)
    _check(_Refuse(), a)
    a.max_tokens = a.max_tokens or MODELS[a.model].max_tokens
    a.duration = a.duration or (20.0 if a.short else 60.0)
    a.drain = a.drain or (8.0 if a.short else 20.0)
    a.probe_duration = a.probe_duration or (15.0 if a.short else 20.0)
    a.min_requests = a.min_requests or (20 if a.short else MIN_REQUESTS)
    a.commit = None  # the checkout's commit, set by the run (each row records it)
    return a


def run_config(a: argparse.Namespace) -> dict[str, object]:
    """The options a result depends on: a resume file made with other values is refused."""
    return {
        "model": a.model,
        "parallel": a.parallel,
        "ctx": a.ctx,
        "threads": a.threads,
        "max_tokens": a.max_tokens,
        "short": a.short,
        "min_requests": a.min_requests,
        "duration_s": a.duration,
        "drain_s": a.drain,
    }
