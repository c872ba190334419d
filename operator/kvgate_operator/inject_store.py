"""What the injected sidecar gets for the store of ``shared`` limits (the chart's ``store.*``
values): ``KVGATE_STORE_URL``, the password and CA files mounted from Secrets, and the share
exchange's sync period ``KVGATE_SHARE_SYNC`` (``store.shareSync``, the sidecar's
``--share-sync``) when it is on.

The Secrets are mounted from the model pod's own namespace (a pod can mount no other), so
``store.existingSecret`` and ``store.tls.caSecret`` must exist in every namespace whose pods are
injected. Pure: no Kubernetes client.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

#: Pod annotation the webhook sets on pods whose sidecar it gave a store: the operator gives such
#: a pod the whole budget of a ``shared`` Global limit (leased), a pod without it its 1/N split
#: (a pod injected before ``store.url`` was set runs without a store until recreated).
ANNOTATION_STORE = "kvgate.io/store"
STORE_KIND = "redis"
#: Volume and mount of the store's password Secret.
PASSWORD_VOLUME = "kvgate-store-password"
PASSWORD_DIR = "/var/run/secrets/kvgate-store"
#: Volume and mount of the store's CA Secret.
CA_VOLUME = "kvgate-store-ca"
CA_DIR = "/var/run/secrets/kvgate-store-ca"
#: ``store.shareSync`` must stay below this, seconds: the sidecar's pool view goes stale after
#: 5 s without a read (``kvgate_agent.admission.fairqueue.pool.STALE_S``), so a longer sync
#: period would leave each pod on its own counters between syncs.
SHARE_SYNC_MAX = 5.0


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class StoreTls(_Model):
    """``store.tls``: verify a ``rediss://`` store with the CA in ``caSecret`` (key ``caKey``);
    without a ``caSecret`` the system's CAs verify it."""

    ca_secret: str | None = Field(None, min_length=1)
    ca_key: str = Field("ca.crt", min_length=1)


class StoreInjection(_Model):
    """``store``: the Redis holding shared limits' budgets.

    Attributes:
        url: ``redis://HOST:PORT/DB`` or ``rediss://HOST:PORT/DB`` (TLS).
        existing_secret: Secret holding the password under ``password_key`` (None: no AUTH).
        password_key: the key in that Secret.
        tls: the CA for ``rediss://``.
        share_sync: seconds between the sidecars' exchanges of the tenants' service counters
            through the store, for fair shares across the pool (the sidecar's
            ``--share-sync``, ``KVGATE_SHARE_SYNC``; 0.5 recommended); 0: off, each pod's fair
            queue sees its own pod only (the sidecar's default). Below :data:`SHARE_SYNC_MAX`.
    """

    url: str
    existing_secret: str | None = Field(None, min_length=1)
    password_key: str = Field("password", min_length=1)
    tls: StoreTls = Field(default_factory=StoreTls)
    share_sync: float = 0.0

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if not v.startswith(("redis://", "rediss://")) or len(v) < 10:
            raise ValueError(f"expected a redis:// or rediss:// URL, got {v!r}")
        return v

    @field_validator("share_sync")
    @classmethod
    def _share_sync(cls, v: float) -> float:
        if not 0 <= v < SHARE_SYNC_MAX:
            raise ValueError(
                f"store.shareSync: expected seconds >= 0 and < {SHARE_SYNC_MAX:g} (0: off; 0.5 "
                f"recommended; past {SHARE_SYNC_MAX:g} s without a read each pod uses its own "
                f"counters), got {v!r}"
            )
        return v


def store_env(store: StoreInjection) -> list[dict[str, Any]]:
    """The sidecar's ``KVGATE_STORE_*`` variables, and ``KVGATE_SHARE_SYNC`` when the share
    exchange is on."""
    env: list[dict[str, Any]] = [{"name": "KVGATE_STORE_URL", "value": store.url}]
    if store.existing_secret is not None:
        env.append(
            {"name": "KVGATE_STORE_PASSWORD_FILE", "value": f"{PASSWORD_DIR}/{store.password_key}"}
        )
    if store.tls.ca_secret is not None:
        env.append({"name": "KVGATE_STORE_CA_FILE", "value": f"{CA_DIR}/{store.tls.ca_key}"})
    if store.share_sync > 0:  # 0 is the sidecar's default: the exchange off
        env.append({"name": "KVGATE_SHARE_SYNC", "value": f"{store.share_sync:g}"})
    return env


def store_mounts(store: StoreInjection) -> list[dict[str, Any]]:
    """The sidecar's read-only mounts of the store's Secrets."""
    mounts = []
    if store.existing_secret is not None:
        mounts.append({"name": PASSWORD_VOLUME, "mountPath": PASSWORD_DIR, "readOnly": True})
    if store.tls.ca_secret is not None:
        mounts.append({"name": CA_VOLUME, "mountPath": CA_DIR, "readOnly": True})
    return mounts


def store_volumes(store: StoreInjection | None) -> list[dict[str, Any]]:
    """The pod's volumes of the store's Secrets (only the keys used, mode 0440)."""
    if store is None:
        return []
    vols = []
    if store.existing_secret is not None:
        vols.append(_secret(PASSWORD_VOLUME, store.existing_secret, store.password_key))
    if store.tls.ca_secret is not None:
        vols.append(_secret(CA_VOLUME, store.tls.ca_secret, store.tls.ca_key))
    return vols


def store_ops(store: StoreInjection | None) -> list[dict[str, Any]]:
    """JSON Patch ops adding the store's Secret volumes and the :data:`ANNOTATION_STORE`
    annotation (after the op that makes sure ``metadata.annotations`` exists)."""
    if store is None:
        return []
    ops = [{"op": "add", "path": "/spec/volumes/-", "value": v} for v in store_volumes(store)]
    path = "/metadata/annotations/" + ANNOTATION_STORE.replace("~", "~0").replace("/", "~1")
    ops.append({"op": "add", "path": path, "value": STORE_KIND})
    return ops


def _secret(volume: str, secret: str, key: str) -> dict[str, Any]:
    return {
        "name": volume,
        "secret": {
            "secretName": secret,
            "items": [{"key": key, "path": key}],
            "defaultMode": 0o440,
        },
    }
