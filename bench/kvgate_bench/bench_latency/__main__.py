"""``python -m kvgate_bench.bench_latency``: :func:`kvgate_bench.bench_latency.measure.main`."""

from __future__ import annotations

import sys

from kvgate_bench.bench_latency.measure import main

if __name__ == "__main__":
    sys.exit(main())
