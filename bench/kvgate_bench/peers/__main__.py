"""``python -m kvgate_bench.peers``: :func:`kvgate_bench.peers.bench.main`."""

import sys

from kvgate_bench.peers.bench import main

sys.exit(main())
