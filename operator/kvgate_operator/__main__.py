"""``kvgate-operator`` / ``python -m kvgate_operator``: run the operator with kopf.

kopf runs standalone (no kopf peering, under which an old and a new pod of a rollout pause each
other: https://github.com/nolar/kopf/issues/734); replicas are coordinated by the operator's own
leader election instead (:mod:`kvgate_operator.leader`): only the leader writes.
"""

from __future__ import annotations

import logging
import sys

import kopf

from kvgate_operator import handlers
from kvgate_operator.settings import OperatorSettings


def main() -> int:
    """Entry point: read the settings (``KVGATE_OPERATOR_*``) and run kopf until stopped."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    s = OperatorSettings()
    kopf.run(
        standalone=s.standalone,
        clusterwide=s.namespace is None,
        namespaces=[s.namespace] if s.namespace else [],
        memo=kopf.Memo({handlers.SETTINGS_KEY: s}),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
