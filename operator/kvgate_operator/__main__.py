"""``kvgate-operator`` / ``python -m kvgate_operator``: run the operator with kopf.

Standalone by default (no kopf peering): the chart runs one replica with a Recreate rollout, so
an old and a new pod never see each other as "another operator" and freeze (field lesson L09,
kopf #734). Liveness: ``http://0.0.0.0:<KVGATE_OPERATOR_LIVENESS_PORT>/healthz``, metrics on
the same port at ``/metrics`` (both served by :mod:`kvgate_operator.handlers`). With the webhook
enabled, the sidecar-injection webhook listens on ``KVGATE_OPERATOR_WEBHOOK_PORT`` (HTTPS,
``/inject-sidecar``).
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
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
