"""``python -m kvgate_agent`` = ``kvgate-agent``."""

import sys

from kvgate_agent.cli import main

sys.exit(main())
