"""``python -m kvgate_bench.stages`` (see the package docstring)."""

import sys

from kvgate_bench.stages.run import main

sys.exit(main())
