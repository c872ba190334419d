"""``python -m kvgate_bench.peers``: :func:`kvgate_bench.peers.bench.main`."""

from __future__ import annotations

import sys

from kvgate_bench.peers.bench import main

if __name__ == "__main__":
    sys.exit(main())
