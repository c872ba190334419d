"""What both demos share: their common flags and the pieces of their plain-text reports.

- :func:`add_schedule_flags`, :func:`add_quiet_flag`: ``--duration`` (seconds, float),
  ``--seed`` (int) and ``--quiet`` (no progress display on stderr), each demo with its own
  defaults and help;
- :func:`row`: one table line of padded cells (both demos' tables are built from it);
- :func:`figure`: a number in a format, or ``-`` when there is none.

Pure: no I/O.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def add_schedule_flags(
    parser: argparse.ArgumentParser,
    *,
    duration: float,
    duration_help: str,
    seed: int,
    seed_help: str,
) -> None:
    """Add ``--duration`` (seconds of schedule, float, default ``duration``) and ``--seed``
    (the schedule's seed, int, default ``seed``) to ``parser``, with the demo's help texts
    (``%(default)s`` expands as usual). Checking the values is the demo's."""
    parser.add_argument("--duration", type=float, default=duration, help=duration_help)
    parser.add_argument("--seed", type=int, default=seed, help=seed_help)


def add_quiet_flag(parser: argparse.ArgumentParser) -> None:
    """Add ``--quiet`` (a boolean: no progress display on stderr; stdout carries the report
    either way) to ``parser``."""
    parser.add_argument("--quiet", action="store_true", help="no progress display on stderr")


def row(cells: Sequence[str], widths: Sequence[int], *, left: int = 2, sep: str = "  ") -> str:
    """One table line: each cell padded to its width (characters), the first ``left`` cells
    left-aligned and the rest right-aligned, joined by ``sep``; trailing spaces dropped. A cell
    longer than its width is kept whole (the line grows). ``cells`` and ``widths`` must have the
    same length (``ValueError`` otherwise)."""
    pairs = enumerate(zip(cells, widths, strict=True))
    return sep.join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in pairs).rstrip()


def figure(value: float | None, spec: str = ".0f", scale: float = 1.0) -> str:
    """``value * scale`` in the format ``spec`` (e.g. ``.1f``), or ``-`` when ``value`` is
    None."""
    return "-" if value is None else format(value * scale, spec)
