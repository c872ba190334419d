"""Where the shared buckets live: :class:`StoreSettings` (a Redis), part of
:class:`~kvgate_agent.sidecar.settings.SidecarSettings`. Each field's default is written here
once, with its docstring under it; a field that is also a flag carries
:func:`~kvgate_agent.args.flag` metadata.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from kvgate_agent.admission import POOL_STALE_S as STALE_S
from kvgate_agent.args import flag, positive

__all__ = ["StoreSettings", "non_negative", "share_period", "store_url"]


def store_url(value: str) -> str:
    """An argparse type: a ``redis://`` or ``rediss://`` URL."""
    if not value.startswith(("redis://", "rediss://")):
        raise argparse.ArgumentTypeError(f"expected a redis:// or rediss:// URL, got {value!r}")
    return value


def non_negative(value: str) -> float:
    """An argparse type: a finite number >= 0 (seconds)."""
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not 0 <= v < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value!r}")
    return v


def share_period(value: str) -> float:
    """An argparse type: the share exchange's sync period, seconds, >= 0 and below
    :data:`~kvgate_agent.admission.fairqueue.pool.STALE_S` (past which a pod reads the pool's
    figures as stale and decides on its own counters: a longer period would leave the
    exchange on in name only). 0: off."""
    v = non_negative(value)
    if v >= STALE_S:
        raise argparse.ArgumentTypeError(
            f"expected seconds below {STALE_S:g} (the pool's figures are stale after "
            f"{STALE_S:g} s without a sync), got {value!r}"
        )
    return v


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """Where the shared buckets live (a Redis; see :mod:`kvgate_agent.sidecar.store.buckets`)."""

    url: str = field(
        metadata=flag(
            "Redis holding the budgets of shared limits, redis://HOST:PORT/DB or rediss:// "
            "(TLS); without it shared limits are enforced per pod",
            name="--store",
            env="STORE_URL",
            parse=store_url,
        )
    )
    """``redis://HOST:PORT/DB`` or ``rediss://HOST:PORT/DB``."""

    password_file: str | None = field(
        default=None,
        metadata=flag(
            "file holding the store's password (a mounted Secret)", name="--store-password-file"
        ),
    )
    """File holding the password (read at start; trailing newline dropped)."""

    ca_file: str | None = field(
        default=None,
        metadata=flag("CA bundle verifying a rediss:// store", name="--store-ca-file"),
    )
    """CA bundle to verify a ``rediss://`` server with (default: the system's)."""

    timeout: float = field(
        default=1.0,
        metadata=flag(
            "seconds one store command may take before the sync counts as failed",
            name="--store-timeout",
            parse=positive(float),
        ),
    )
    """Seconds any one command (and connecting) may take."""

    share_sync: float = field(
        default=0.0,
        metadata=flag(
            "seconds between exchanges of the tenants' service counters with the other "
            "sidecars through the store (needs --store), for fair shares across the pool (0.5 "
            "recommended); "
            f"0: off, each pod's fair queue sees its own pod only; below {STALE_S:g}",
            parse=share_period,
        ),
    )
    """The share exchange's sync period, seconds (:mod:`kvgate_agent.sidecar.store.exchange`);
    0: off (the default)."""

    member: str = ""
    """This sidecar's name among its peers (pod name, or host and pid)."""
