"""``kvgate-operator`` / ``python -m kvgate_operator``: run the operator with kopf.

Standalone by default (no kopf peering): the chart runs one replica with a Recreate rollout, so
an old and a new pod never see each other as "another operator" and freeze (field lesson L09,
kopf #734). Liveness: ``http://0.0.0.0:<KVGATE_OPERATOR_LIVENESS_PORT>/healthz``.
"""

from __future__ import annotations

import logging
import sys

import kopf

from kvgate_operator import handlers


def main() -> int:
    """Entry point."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    s = handlers.SETTINGS
    kopf.run(
        standalone=s.standalone,
        clusterwide=s.namespace is None,
        namespaces=[s.namespace] if s.namespace else [],
        liveness_endpoint=f"http://0.0.0.0:{s.liveness_port}/healthz",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
