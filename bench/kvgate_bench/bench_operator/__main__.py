"""``python -m kvgate_bench.bench_operator``: :func:`kvgate_bench.bench_operator.cli.main`."""

from __future__ import annotations

import sys

from kvgate_bench.bench_operator.cli import main

if __name__ == "__main__":
    sys.exit(main())
