"""The command line of ``python -m kvgate_bench.real_engine``: its flags, their defaults and the
``--help`` text (the run itself: :mod:`kvgate_bench.real_engine.__main__`).

Four defaults are filled in after parsing (the flags' own default is None, and an absent or zero
value takes the default): ``--max-tokens`` 96, ``--duration`` 40 s (``--short`` 20), ``--drain``
10 s (8), ``--probe-duration`` 20 s (15).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The run's options from ``argv`` (default ``sys.argv[1:]``), the defaults filled in."""
    p = argparse.ArgumentParser(
        prog="python -m kvgate_bench.real_engine",
        description="kvgate's goodput in front of a real llama-server (none, tuned cap, tuned "
        "token bucket, kvgate), next to the virtual benchmark on a fitted engine. llama-server "
        "and its model: $KVGATE_LLAMA_SERVER and $KVGATE_LLAMA_MODEL, else the test command's "
        "cache, else scripts/build-llama builds them.",
    )
    p.add_argument(
        "--short", action="store_true", help="fewer cells and shorter schedules (<8 min)"
    )
    p.add_argument("--seed", type=int, default=1, help="the schedules' seed (default 1)")
    p.add_argument("--parallel", type=int, default=4, help="llama-server slots (default 4)")
    p.add_argument(
        "--ctx", type=int, default=4096, help="llama-server context, all slots (default 4096)"
    )
    p.add_argument("--threads", type=int, default=1, help="llama-server threads (default 1)")
    p.add_argument("--max-tokens", type=int, help="cap on each request's max_tokens (default 96)")
    p.add_argument(
        "--duration", type=float, help="schedule length per cell, s (default 40; --short 20)"
    )
    p.add_argument(
        "--drain",
        type=float,
        help="seconds after a schedule before cutting requests (default 10; --short 8)",
    )
    p.add_argument(
        "--probe-duration",
        type=float,
        help="shortest capacity probe, s (a probe is long enough for 15 arrivals, up to 3x this)",
    )
    p.add_argument("--no-pin", action="store_true", help="no taskset pinning")
    p.add_argument("--json", type=Path, help="write rows, calibration and meta here")
    a = p.parse_args(argv)
    a.max_tokens = a.max_tokens or 96
    a.duration = a.duration or (20.0 if a.short else 40.0)
    a.drain = a.drain or (8.0 if a.short else 10.0)
    a.probe_duration = a.probe_duration or (15.0 if a.short else 20.0)
    return a
