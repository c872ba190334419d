"""``python -m kvgate_bench.demo``: the real-time demo over HTTP (:mod:`kvgate_bench.demo.http`)."""

from __future__ import annotations

import sys

from kvgate_bench.demo.http import main

if __name__ == "__main__":
    sys.exit(main())
