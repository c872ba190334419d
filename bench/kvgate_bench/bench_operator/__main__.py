"""``python -m kvgate_bench.bench_operator``: :func:`kvgate_bench.bench_operator.cli.main`."""

import sys

from kvgate_bench.bench_operator.cli import main

sys.exit(main())
