"""``kvgate-agent``: one entry point, one role per subcommand: ``sidecar`` (in each model pod, or
standalone) and ``node`` (the node agent, :mod:`kvgate_agent.node.cli`).

Every flag also reads an environment variable (``KVGATE_<FLAG>``), so the injected sidecar can be
configured through its pod's environment.

The sidecar runs in one of two modes: standalone with ``--policy FILE``, or in a cluster with
``--agent-url URL`` (thresholds from the node agent; ``--pod-namespace`` and ``--pod-name``
required, usually from the downward API).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence

from kvgate_agent.node.cli import add_node_parser, node_main
from kvgate_agent.sidecar.cli import add_sidecar_parser, sidecar_main

#: ``kvgate-agent --help``'s text: the module's docstring in plain words (argparse prints a
#: description as is, so reST markup would show).
DESCRIPTION = """One entry point, one role per subcommand: sidecar (in each model pod, or
standalone) and node (the node agent). Every flag also reads an environment variable
(KVGATE_<FLAG>), so the injected sidecar can be configured through its pod's environment. The
sidecar runs standalone with --policy FILE, or in a cluster with --agent-url URL (thresholds
from the node agent; --pod-namespace and --pod-name required, usually from the downward API).
'kvgate-agent ROLE --help' lists a role's flags."""


def version() -> str:
    """The installed ``kvgate`` distribution's version (``0.1.0``), or ``unknown`` when run
    from sources that were never installed."""
    try:
        return importlib.metadata.version("kvgate")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The ``kvgate-agent`` argument parser, one subcommand per role, and ``--version``."""
    p = argparse.ArgumentParser(prog="kvgate-agent", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = p.add_subparsers(dest="role", required=True)
    add_sidecar_parser(sub)
    add_node_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvgate-agent``. Exit codes: 0 after a clean shutdown, 1 when it cannot
    serve (a port taken), 2 on bad configuration (arguments or variables, an invalid policy, an
    unreadable tokenizer, keys or JWKS file)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # One function per role; ``args.role`` names it.
    if args.role == "node":
        return node_main(args)
    return sidecar_main(parser, args)


if __name__ == "__main__":
    sys.exit(main())
