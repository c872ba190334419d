"""The added-latency measurement and its report: direct and via-sidecar round trips interleaved in
blocks (:func:`measure`), their percentiles and the added latency (:class:`Comparison`,
milliseconds), the table and the verdict against the targets, and :func:`main`.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvgate_bench import bench_latency
from kvgate_bench.bench_latency.client import RawHTTP, build_request, processes
from kvgate_bench.bench_latency.upstream import CONTENT, serve_upstream
from kvgate_bench.kit.toolkit import percentile

TARGET_ADDED_P50_MS = 0.35


TARGET_ADDED_P99_MS = 1.0


@dataclass(frozen=True, slots=True)
class PathStats:
    """Latency percentiles of one path, milliseconds."""

    p50: float
    p99: float
    mean: float


def _stats(ns: Sequence[int]) -> PathStats:
    ms = [x / 1e6 for x in ns]
    return PathStats(
        percentile(ms, 50) or 0.0, percentile(ms, 99) or 0.0, sum(ms) / max(1, len(ms))
    )


@dataclass(frozen=True, slots=True)
class Comparison:
    """Direct vs via-sidecar for one measure (e.g. round trip, TTFT).

    ``passthrough`` is the same request through the sidecar on a path it forwards without
    admission (``/bench/chat``): the cost of the proxy itself, so ``sidecar − passthrough`` is
    what admission, body parsing and accounting add on top.
    """

    name: str
    direct: PathStats
    sidecar: PathStats
    passthrough: PathStats | None
    samples: int

    @property
    def added_p50(self) -> float:
        """p50(sidecar) − p50(direct), ms."""
        return self.sidecar.p50 - self.direct.p50

    @property
    def added_p99(self) -> float:
        """p99(sidecar) − p99(direct), ms."""
        return self.sidecar.p99 - self.direct.p99


ADMITTED_PATH = "/v1/chat/completions"


PASSTHROUGH_PATH = "/bench/chat"


def measure(
    up_port: int, sc_port: int, *, stream: bool, n: int, warmup: int, block: int
) -> list[Comparison]:
    """``warmup`` then ``n`` requests on each path (direct, via the sidecar's admitted path, via
    its pass-through), in rotating blocks of ``block`` requests.

    Returns one :class:`Comparison` for non-streaming requests (round trip), or two for
    streaming ones (time to the first content byte, and to the end of the stream).
    """
    paths = (
        ("direct", RawHTTP("127.0.0.1", up_port), build_request(up_port, stream)),
        ("sidecar", RawHTTP("127.0.0.1", sc_port), build_request(sc_port, stream)),
        (
            "passthrough",
            RawHTTP("127.0.0.1", sc_port),
            build_request(sc_port, stream, PASSTHROUGH_PATH),
        ),
    )
    marker = CONTENT.encode() if stream else None
    first: dict[str, list[int]] = {name: [] for name, _, _ in paths}
    whole: dict[str, list[int]] = {name: [] for name, _, _ in paths}
    try:
        for phase, count in (("warmup", warmup), ("measure", n)):
            done = 0
            while done < count:
                k = min(block, count - done)
                shift = (done // block) % len(paths)  # rotate which path goes first
                for name, conn, req in paths[shift:] + paths[:shift]:
                    for _ in range(k):
                        status, t_first, t_end = conn.roundtrip(req, marker)
                        if status != 200:
                            raise RuntimeError(f"{name}: HTTP {status}")
                        if phase == "measure":
                            first[name].append(t_first)
                            whole[name].append(t_end)
                done += k
    finally:
        for _, conn, _ in paths:
            conn.close()

    def comp(name: str, data: dict[str, list[int]]) -> Comparison:
        return Comparison(
            name,
            _stats(data["direct"]),
            _stats(data["sidecar"]),
            _stats(data["passthrough"]),
            n,
        )

    if not stream:
        return [comp("round trip", whole)]
    return [comp("stream: TTFT", first), comp("stream: whole", whole)]


def format_table(rows: Sequence[Comparison]) -> str:
    """A markdown table of the comparisons (milliseconds)."""
    out = [
        "| request | direct p50 | via sidecar p50 | added p50 | direct p99 | via sidecar p99 "
        "| added p99 | p50 ratio | p99 ratio | pass-through p50 / p99 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in rows:
        pt = "-" if c.passthrough is None else f"{c.passthrough.p50:.3f} / {c.passthrough.p99:.3f}"
        out.append(
            f"| {c.name} | {c.direct.p50:.3f} | {c.sidecar.p50:.3f} | **{c.added_p50:.3f}** "
            f"| {c.direct.p99:.3f} | {c.sidecar.p99:.3f} | **{c.added_p99:.3f}** "
            f"| {c.sidecar.p50 / c.direct.p50:.2f}x | {c.sidecar.p99 / c.direct.p99:.2f}x "
            f"| {pt} |"
        )
    return "\n".join(out)


def breakdown(c: Comparison) -> str:
    """One sentence splitting the added p50 into the proxy hop and what admission adds."""
    if c.passthrough is None:
        return ""
    hop = c.passthrough.p50 - c.direct.p50
    adm = c.sidecar.p50 - c.passthrough.p50
    return (
        f"Of the added p50 ({c.added_p50:.3f} ms), the proxy hop itself (pass-through, no "
        f"admission) accounts for {hop:.3f} ms and admission + body parsing + accounting for "
        f"{adm:.3f} ms."
    )


def verdict(c: Comparison) -> str:
    """Whether the non-streaming round trip meets the targets, and by how much it misses."""
    parts = []
    for label, added, target in (
        ("p50", c.added_p50, TARGET_ADDED_P50_MS),
        ("p99", c.added_p99, TARGET_ADDED_P99_MS),
    ):
        if added <= target:
            parts.append(f"added {label} {added:.3f} ms ≤ {target:g} ms: met")
        else:
            parts.append(
                f"added {label} {added:.3f} ms > {target:g} ms: MISSED by {added - target:.3f} ms"
            )
    return "; ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns 0 (1 with ``--check`` when a target is missed)."""
    p = argparse.ArgumentParser(
        prog="python -m kvgate_bench.bench_latency", description=bench_latency.__doc__
    )
    p.add_argument("-n", "--requests", type=int, default=2000, help="measured requests per path")
    p.add_argument("--warmup", type=int, default=2000, help="warm-up requests per path")
    p.add_argument("--block", type=int, default=100, help="requests per interleaved block")
    p.add_argument("--no-stream", action="store_true", help="skip the streaming variant")
    p.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    p.add_argument(
        "--profile-sidecar",
        type=Path,
        metavar="FILE",
        help="run the sidecar under cProfile and write its stats to FILE (inflates its latency)",
    )
    p.add_argument("--serve-upstream", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_upstream:
        serve_upstream(args.port)
        return 0

    rows: list[Comparison] = []
    with (
        tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp,
        processes(Path(tmp), args.profile_sidecar) as (
            up,
            sc,
        ),
    ):
        kw = {"n": args.requests, "warmup": args.warmup, "block": args.block}
        rows += measure(up, sc, stream=False, **kw)
        if not args.no_stream:
            rows += measure(up, sc, stream=True, **kw)
    print(
        f"# kvgate sidecar added latency ({args.requests} requests per path after "
        f"{args.warmup} warm-up, blocks of {args.block}, {platform.python_implementation()} "
        f"{platform.python_version()}, {os.cpu_count()} CPUs)\n"
    )
    print(format_table(rows))
    print("\nmilliseconds; added = percentile via sidecar − same percentile direct.")
    print(breakdown(rows[0]))
    print("Targets (round trip): " + verdict(rows[0]) + ".")
    met = rows[0].added_p50 <= TARGET_ADDED_P50_MS and rows[0].added_p99 <= TARGET_ADDED_P99_MS
    return 1 if (args.check and not met) else 0
