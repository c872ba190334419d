"""``python -m kvgate_bench.bench_latency``: :func:`kvgate_bench.bench_latency.measure.main`."""

import sys

from kvgate_bench.bench_latency.measure import main

sys.exit(main())
