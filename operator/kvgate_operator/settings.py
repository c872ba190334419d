"""Operator settings, from environment variables ``KVGATE_OPERATOR_*`` (pydantic-settings)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class OperatorSettings(BaseSettings):
    """All operator settings; each field reads ``KVGATE_OPERATOR_<FIELD>``.

    Attributes:
        namespace: watch only this namespace's policies and pods (None: the whole cluster).
        debounce_seconds: wait after a watch event before a pass, so a burst is one pass.
        resync_seconds: a pass runs at least this often even without events.
        liveness_stale_seconds: the liveness probe fails when no pass succeeded for this long.
        watch_server_timeout: seconds the API server keeps one watch open before the operator
            re-establishes it (kopf ``watching.server_timeout``).
        watch_client_timeout: seconds the client waits on a silent watch before treating it as
            hung and reconnecting (kopf ``watching.client_timeout``); above the server timeout.
        connect_timeout: seconds to connect to the API server.
        liveness_port: port of the liveness endpoint (``/healthz``).
        standalone: run without kopf peering (one replica with a Recreate rollout; see README).
    """

    model_config = SettingsConfigDict(env_prefix="KVGATE_OPERATOR_")

    namespace: str | None = None
    debounce_seconds: float = Field(0.2, ge=0, le=60)
    resync_seconds: float = Field(300.0, gt=0)
    liveness_stale_seconds: float = Field(900.0, gt=0)
    watch_server_timeout: int = Field(300, gt=0)
    watch_client_timeout: int = Field(330, gt=0)
    connect_timeout: int = Field(10, gt=0)
    liveness_port: int = Field(8080, ge=0, le=65535)
    standalone: bool = True
