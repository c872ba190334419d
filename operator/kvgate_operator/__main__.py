"""``kvgate-operator`` / ``python -m kvgate_operator``: run the operator with kopf.

kopf runs standalone (no kopf peering, under which an old and a new pod of a rollout pause each
other: https://github.com/nolar/kopf/issues/734); replicas are coordinated by the operator's own
leader election instead (:mod:`kvgate_operator.leader`): only the leader writes.
"""

from __future__ import annotations

import argparse
import logging
import sys

import kopf
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kvgate_operator import handlers
from kvgate_operator.settings import OperatorSettings


def default_text(field: FieldInfo) -> str:
    """A setting's default as ``--help`` prints it: ``(required)``, ``(unset)`` for None, a
    model (``injection``) as its JSON with the variable's camelCase keys, else the value's
    ``repr``."""
    if field.is_required():
        return "(required)"
    value = field.get_default(call_default_factory=True, validated_data={})
    if value is None:
        return "(unset)"
    if isinstance(value, BaseModel):
        return value.model_dump_json(by_alias=True)
    return repr(value)


def settings_help() -> str:
    """One line per setting: its environment variable and default (from
    :class:`~kvgate_operator.settings.OperatorSettings`)."""
    prefix = OperatorSettings.model_config.get("env_prefix", "")
    return "\n".join(
        f"  {prefix}{name.upper()}  default {default_text(field)}"
        for name, field in OperatorSettings.model_fields.items()
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point: read the settings (``KVGATE_OPERATOR_*``) and run kopf until stopped.
    ``--help`` lists the settings and exits; the operator takes no arguments (exit 2 on any)."""
    parser = argparse.ArgumentParser(
        prog="kvgate-operator",
        description="The kvgate operator: RateLimitPolicies to NodeAdmissions, the sidecar "
        "injection webhook. Configured by environment variables only (see the README):",
        epilog=settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.parse_args(argv)
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
