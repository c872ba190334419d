"""The report of ``python -m kvgate_bench.peers``: its tables (load, ratios, streams, the
issue's targets) as text or Markdown, and the ``docs/benchmarks.md`` section it replaces.
What each figure means is in :data:`HOW`; the run that measures them is
:mod:`kvgate_bench.peers`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvgate_bench.kit.doc_block import Markers, replace_block
from kvgate_bench.peers.load import (
    STREAM_HEAD,
    IdleResult,
    StreamRow,
    WrkResult,
    idle_line,
    stream_rows,
)

# ---------------------------------------------------------------------------------- the report
# Added latency of an arm = its p50 (p99) minus the ``direct`` arm's p50 (p99) in the same cell
# (same body size and concurrency, same run). Ratios compare kvgate with a peer in the same cell:
# ``rps kvgate / rps nginx`` and ``added p50 kvgate / added p50 nginx``; against LiteLLM the
# inverse (``rps kvgate / rps LiteLLM`` and ``p50 LiteLLM / p50 kvgate``: how many times faster).

#: The markers of the section in ``docs/benchmarks.md`` (:mod:`kvgate_bench.kit.doc_block`:
#: the begin marker records a digest of what the run wrote; other text inside is refused).
MARKERS = Markers("kvgate_bench.peers", "python -m kvgate_bench.peers")

DIRECT, NGINX, LITELLM, KVGATE, PASSTHROUGH = (
    "direct",
    "nginx",
    "litellm",
    "kvgate",
    "kvgate pass-through",
)
#: The arms, in the tables' order. (``kvgate aiohttp leg``, the same sidecar with aiohttp's
#: web server on the clients' port, the before of the own leg, went with that leg: retired,
#: issue 35.)
ARMS = (DIRECT, NGINX, LITELLM, KVGATE, PASSTHROUGH)


@dataclass(frozen=True, slots=True)
class Cell:
    """One wrk run: ``arm`` at ``body_bytes`` and ``connections``."""

    arm: str
    body_bytes: int
    connections: int
    result: WrkResult


@dataclass
class Report:
    """Everything one run measured, and what it ran on."""

    header: list[tuple[str, str]]
    cells: list[Cell]
    streams: list[StreamRow]
    idle: IdleResult | None
    notes: list[str]


def size_label(n: int) -> str:
    """``1024`` → ``1 KB``, ``204800`` → ``200 KB``."""
    return f"{n // 1024} KB" if n >= 1024 else f"{n} B"


def _us(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1000:.2f} ms" if abs(x) >= 1000 else f"{x:.0f} us"


def _lookup(cells: Sequence[Cell]) -> dict[tuple[str, int, int], WrkResult]:
    return {(c.arm, c.body_bytes, c.connections): c.result for c in cells}


def _answered(
    by: dict[tuple[str, int, int], WrkResult], arm: str, body: int, conns: int
) -> WrkResult | None:
    r = by.get((arm, body, conns))
    return r if r is not None and r.requests > 0 else None


def load_rows(cells: Sequence[Cell]) -> list[list[str]]:
    """The load table: one row per cell, direct first in each (body, concurrency) group."""
    by = _lookup(cells)
    rows = []
    groups = sorted({(c.body_bytes, c.connections) for c in cells})
    for body, conns in groups:
        base = by.get((DIRECT, body, conns))
        for arm in ARMS:
            r = by.get((arm, body, conns))
            if r is None:
                continue
            if r.requests == 0:  # nothing answered within the window: no percentiles
                rows.append([size_label(body), str(conns), arm, "-", "-", "-", "-", "0",
                             str(r.errors) + " (no answer)"])  # fmt: skip
                continue
            added50 = r.p50_us - base.p50_us if base and arm != DIRECT else None
            added99 = r.p99_us - base.p99_us if base and arm != DIRECT else None
            rows.append([
                size_label(body), str(conns), arm, _us(r.p50_us),
                "-" if added50 is None else "+" + _us(added50) if added50 >= 0 else _us(added50),
                _us(r.p99_us),
                "-" if added99 is None else "+" + _us(added99) if added99 >= 0 else _us(added99),
                f"{r.rps:,.0f}", str(r.errors),
            ])  # fmt: skip
    return rows


LOAD_HEAD = ["body", "c", "arm", "p50", "added p50", "p99", "added p99", "rps", "errors"]


def ratio_rows(cells: Sequence[Cell]) -> list[list[str]]:
    """kvgate against nginx and LiteLLM in each cell (see the module for the definitions)."""
    by = _lookup(cells)
    rows = []
    for body, conns in sorted({(c.body_bytes, c.connections) for c in cells}):
        base, kv = _answered(by, DIRECT, body, conns), _answered(by, KVGATE, body, conns)
        ng, ll = _answered(by, NGINX, body, conns), _answered(by, LITELLM, body, conns)
        if kv is None:
            continue
        row = [size_label(body), str(conns)]
        row.append(f"{kv.rps / ng.rps:.3f}" if ng and ng.rps else "-")
        if base and ng and ng.p50_us - base.p50_us > 0:
            row.append(f"{(kv.p50_us - base.p50_us) / (ng.p50_us - base.p50_us):.1f}x")
        else:
            row.append("-")
        row.append(f"{kv.rps / ll.rps:.1f}x" if ll and ll.rps else "-")
        row.append(f"{ll.p50_us / kv.p50_us:.1f}x" if ll and kv.p50_us else "-")
        rows.append(row)
    return rows


RATIO_HEAD = [
    "body", "c", "rps kvgate / nginx", "added p50 kvgate / nginx", "rps kvgate / LiteLLM",
    "p50 LiteLLM / kvgate",
]  # fmt: skip


#: The own server leg's targets (issue 25), each a ratio within one run: (what, bound, how).
TARGETS = (
    ("p50 at c=1 (1 KB) / direct p50", "<= 2.5"),
    ("rps at c=32 (1 KB) / nginx rps", ">= 0.2"),
    ("CPU per chunk (256 streams, 10 ms ITL) / nginx", "<= 1.5"),
    ("p99 at c=256 (16 KB) / nginx p99", "<= 5"),
    ("RSS per idle keep-alive connection", "<= 20 KiB"),
)
TARGET_HEAD = ["target", "bound", "kvgate"]


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def target_values(
    cells: Sequence[Cell], streams: Sequence[StreamRow], idle: IdleResult | None, arm: str
) -> list[float | None]:
    """``arm``'s figure for each of :data:`TARGETS` (None: not measured in this run)."""
    by = _lookup(cells)

    def cell(a: str, body: int, conns: int) -> WrkResult | None:
        return _answered(by, a, body, conns)

    c1, d1 = cell(arm, 1024, 1), cell(DIRECT, 1024, 1)
    c32, n32 = cell(arm, 1024, 32), cell(NGINX, 1024, 32)
    c256, n256 = cell(arm, 16384, 256), cell(NGINX, 16384, 256)
    per = {(r.arm, r.itl_ms): r.result.us_per_chunk for r in streams}
    idle_kib = idle.kib_per_connection if idle is not None and arm == KVGATE else None
    return [
        _ratio(c1.p50_us if c1 else None, d1.p50_us if d1 else None),
        _ratio(c32.rps if c32 else None, n32.rps if n32 else None),
        _ratio(per.get((arm, 10.0)), per.get((NGINX, 10.0))),
        _ratio(c256.p99_us if c256 else None, n256.p99_us if n256 else None),
        idle_kib,
    ]


def target_rows(
    cells: Sequence[Cell], streams: Sequence[StreamRow], idle: IdleResult | None
) -> list[list[str]]:
    """The targets table: each target's bound and the own leg's figure, with "met" or
    "missed" after it."""
    own = target_values(cells, streams, idle, KVGATE)
    rows = []
    for (what, bound), x in zip(TARGETS, own, strict=True):
        kib = bound.endswith("KiB")
        limit = float(bound.split()[1])
        ok = None if x is None else (x >= limit if bound.startswith(">=") else x <= limit)

        def fmt(v: float | None, kib: bool = kib) -> str:
            if v is None:
                return "-"
            return f"{v:.1f} KiB" if kib else f"{v:.2f}x" if v >= 0.995 else f"{v:.3f}"

        verdict = "" if ok is None else " (met)" if ok else " (missed)"
        rows.append([what, bound, fmt(x) + verdict])
    return rows


def text_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table with aligned columns (first three left, the rest right)."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=False)]

    def line(cells: Sequence[str]) -> str:
        out = [
            c.ljust(w) if i < 3 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, rows)])


def md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table (numeric columns right-aligned)."""
    align = ["---" if i < 3 else "---:" for i in range(len(head))]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


#: What the section measures, written above its tables in ``docs/benchmarks.md``.
HOW = """\
Five arms side by side in one run, every server pinned to one CPU and the load generator to
another (`taskset`; see `pinning`): **direct** (nginx `return 200` with a small OpenAI chat
response), **nginx** as a proxy in front of it (keep-alive upstream, `proxy_buffering off`),
the **LiteLLM** proxy (one worker, no database, no master key; one model entry pointing at
direct), the **kvgate** sidecar of this checkout with a realistic policy (per-tenant and pod
rate limits, a concurrency cap, Predicted KV reservation, a queue; budgets large enough that
every request is admitted; `bench/kvgate_bench/peers/servers.py`) and **kvgate pass-through** (the
same sidecar on an allowlisted path, forwarded without admission). A sixth arm, **kvgate aiohttp
leg** (aiohttp's web server on the clients' port, as kvgate served before its own leg), ran
until that leg was retired (issue 35). Load: `wrk -t1 --latency`
with a Lua script POSTing a chat body of the given size at `c` connections, arms rotated cell
by cell; added = the arm's percentile minus direct's in the same cell. Streaming: 256
concurrent streams from the llm-d simulator (on the servers' CPU) at the given inter-token
latency through the sidecar and through nginx; CPU per chunk = the server's
utime + stime (`/proc/<pid>/stat`) over the window / SSE `data:` events counted by the client.
Memory: the sidecar's VmRSS. The last table holds the own leg's targets (issue 25), each a
ratio within the run. The sidecars run with the
mypyc-compiled modules the agent image ships (`--pure`: the checkout's Python sources).
Options: `--quick`, `--seconds S`, `--client-cpu N`, `--server-cpu N`, `--no-litellm`,
`--no-stream`, `--no-write`, `--pure`, `--docs FILE`, `--workdir DIR` (keeps the
configurations and the servers' logs), `--force` (overwrite text between this section's markers
that the last run did not write; without it the run refuses before it starts)."""


def render(report: Report, *, markdown: bool) -> str:
    """The whole report as text (stdout) or Markdown (the docs section)."""
    table = md_table if markdown else text_table
    parts = [HOW] if markdown else []
    if markdown:
        parts.append(md_table(["", ""], [[k, v] for k, v in report.header]))
    else:
        parts.append("\n".join(f"{k}: {v}" for k, v in report.header))
    if report.cells:
        parts.append(table(LOAD_HEAD, load_rows(report.cells)))
        parts.append(table(RATIO_HEAD, ratio_rows(report.cells)))
    if report.streams:
        parts.append(table(STREAM_HEAD, stream_rows(report.streams)))
    parts.append(idle_line(report.idle))
    if report.cells:
        parts.append(table(TARGET_HEAD, target_rows(report.cells, report.streams, report.idle)))
    parts.extend(report.notes)
    return "\n\n".join(parts) + "\n"


def replace_section(
    doc: str, body: str, *, title: str, name: str = "docs/benchmarks.md", force: bool = False
) -> str:
    """``doc`` with the text between :data:`MARKERS` replaced by ``title`` and ``body``; the
    section is appended at the end when ``doc`` has none
    (:func:`kvgate_bench.kit.doc_block.replace_block`; ``name`` names the document in errors).

    Raises:
        BrokenMarkers: only one of the two markers, more than one section, the end first.
        ForeignText: the text between the markers is not what the last run wrote (unless
            ``force``).
    """
    return replace_block(doc, f"{title}\n\n{body.rstrip()}", MARKERS, name=name, force=force)
