"""The injected sidecar's template: its settings (:class:`InjectionConfig`), the
``kvgate-sidecar`` container (its clients' port ``kvgate-http`` and its admin port
``kvgate-admin``), its token volume and the ``kvgate.io/injected`` marker.

Pure: no I/O. Invariant: :data:`TEMPLATE_VERSION` changes whenever what these functions build
changes, so the operator can tell pods injected with an older template.
"""

from __future__ import annotations

import copy
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

from kvgate_operator.inject_identity import SECRET_KEY_PATTERN, SecretFile, identity_files
from kvgate_operator.inject_router import LABEL_VALUE_PATTERN
from kvgate_operator.inject_store import StoreInjection, store_env, store_mounts

SIDECAR_NAME = "kvgate-sidecar"
PORT_NAME = "kvgate-http"
"""The sidecar's clients' port: a model Service's ``targetPort``."""
ADMIN_PORT_NAME = "kvgate-admin"
"""The sidecar's admin port (``KVGATE_ADMIN_LISTEN``): ``/metrics`` with every series, each
tenant's included, ``/healthz`` and ``/readyz``; what the chart's PodMonitor scrapes."""
TOKEN_VOLUME = "kvgate-token"
TOKEN_DIR = "/var/run/secrets/kvgate"
TOKEN_FILE = TOKEN_DIR + "/token"
RUN_AS_USER = 65532
TEMPLATE_VERSION = "0.3.0"
"""Version of the injected container's template: bump it whenever the template changes, so the
operator can tell pods injected with an older one (``kvgate.io/injected``)."""

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

Resources = dict[str, dict[str, str | int | float]]
"""A container's ``resources``: ``requests`` / ``limits`` → resource name → quantity."""


def _default_resources() -> Resources:
    return {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}


class InjectionConfig(BaseModel):
    """How the sidecar is injected. The chart renders it as JSON (camelCase keys) into the
    operator's environment variable ``KVGATE_OPERATOR_INJECTION``. Each field's docstring is
    under it; the chart's ``injector`` values carry the same defaults (held equal by
    ``tests/unit/test_settings_chart.py``)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )

    sidecar_image: str = Field("ghcr.io/kvgate/kvgate-agent:0.1.0", min_length=1)
    """The kvgate-agent image; its entrypoint is ``kvgate-agent``."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """``Always``, ``IfNotPresent`` or ``Never``."""
    native_sidecar: bool = True
    """True: an init container with ``restartPolicy: Always`` (Kubernetes >= 1.29), which starts
    before and stops after the model server; False: a plain container appended to
    ``spec.containers``."""
    sidecar_port: int = Field(8001, ge=1, le=65535)
    """TCP port the sidecar listens on, unless the pod annotates ``kvgate.io/sidecar-port``."""
    admin_port: int = Field(9471, ge=1, le=65535)
    """TCP port of the sidecar's admin listener (``KVGATE_ADMIN_LISTEN``, the container port
    named ``kvgate-admin``), unless the pod annotates ``kvgate.io/admin-port``: ``/metrics``
    with every series (where the policy names tenants by credentials the clients' port leaves
    each tenant's out), ``/healthz``, ``/readyz``; the chart's PodMonitor scrapes it. 9471 sits
    beside the node agent's 9470, clear of the sidecar's 8001 and of the engines' usual ports
    (vLLM and TensorRT-LLM 8000, TGI 80 and 8080, llama.cpp 8080, SGLang 30000, Triton
    8000-8002, Ollama 11434)."""
    agent_port: int = Field(9470, ge=1, le=65535)
    """The node agent's hostPort; the sidecar syncs with
    ``http://$(KVGATE_HOST_IP):<agent_port>``."""
    token_audience: str = Field("kvgate-agent", min_length=1)
    """Audience of the projected service-account token the sidecar presents."""
    token_expiration_seconds: int = Field(3600, ge=600, le=2**32)
    """Lifetime of that token, seconds (Kubernetes minimum 600)."""
    resources: Resources = Field(default_factory=_default_resources)
    """The sidecar's ``resources`` (``requests`` / ``limits``), copied as is."""
    excluded_namespaces: list[str] = Field(
        default_factory=lambda: ["kube-system", "kube-public", "kube-node-lease"]
    )
    """Never injected, whatever their labels say."""
    own_namespace: str | None = None
    """kvgate's own namespace, never injected (set by the operator)."""
    drain_seconds: int = Field(30, gt=0)
    """The sidecar's ``KVGATE_DRAIN_SECONDS`` (> 0)."""
    header_timeout_seconds: float = Field(10.0, ge=0, le=3600)
    """The sidecar's ``KVGATE_HEADER_TIMEOUT_SECONDS``: seconds a client may take to send a
    request's headers (slow-loris bound; 0 disables)."""
    body_timeout_seconds: float = Field(30.0, ge=0, le=3600)
    """The sidecar's ``KVGATE_BODY_TIMEOUT_SECONDS``: seconds a request's body may take after its
    headers (0 disables)."""
    upstream_timeout_seconds: float = Field(600.0, gt=0, le=86400)
    """The sidecar's ``KVGATE_UPSTREAM_TIMEOUT``: seconds without a byte from the model server
    before 504 (> 0)."""
    log_level: str = "INFO"
    """The sidecar's ``KVGATE_LOG_LEVEL``: DEBUG, INFO, WARNING or ERROR."""
    passthrough_paths: list[str] = Field(default_factory=list)
    """The sidecar's ``KVGATE_PASSTHROUGH_PATHS``: paths (or prefixes ending in ``*``) POST and
    other mutating requests may reach the model server on without admission, besides the sidecar's
    built-in allowlist; set only when non-empty."""
    store: StoreInjection | None = None
    """The Redis of shared limits (:mod:`kvgate_operator.inject_store`); None: shared limits are per
    pod."""
    api_keys_secret: str | None = None
    """Secret (in the pod's namespace) holding the sidecar's API keys file under
    :attr:`api_keys_key`, mounted read-only and passed as ``KVGATE_API_KEYS_FILE``
    (:mod:`kvgate_operator.inject_identity`); None (or empty, as the chart says it): no keys
    file."""
    api_keys_key: str = Field("keys.yaml", pattern=SECRET_KEY_PATTERN)
    """The keys file's key in :attr:`api_keys_secret`."""
    jwks_secret: str | None = None
    """Secret (in the pod's namespace) holding the JWKS verifying the policy's ``tenants.jwt``
    tokens under :attr:`jwks_key`, passed as ``KVGATE_JWKS_FILE``; None: no JWKS file."""
    jwks_key: str = Field("jwks.json", pattern=SECRET_KEY_PATTERN)
    """The JWKS's key in :attr:`jwks_secret`."""
    epp_engine_type: Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)] | None = None
    """The value of the pod label ``llm-d.ai/engine-type`` set on injected pods, naming the
    endpoint picker's ``engineConfigs`` entry that reads kvgate's router gauges
    (:mod:`kvgate_operator.inject_router`); None (or empty, as the chart says it): no label."""

    def identity_files(self) -> list[SecretFile]:
        """The keys and JWKS files mounted from Secrets (see
        :func:`~kvgate_operator.inject_identity.identity_files`)."""
        return identity_files(
            self.api_keys_secret, self.api_keys_key, self.jwks_secret, self.jwks_key
        )

    @field_validator("api_keys_secret", "jwks_secret", "epp_engine_type")
    @classmethod
    def _no_secret(cls, v: str | None) -> str | None:
        return v or None

    @field_validator("passthrough_paths")
    @classmethod
    def _paths(cls, v: list[str]) -> list[str]:
        for path in v:
            if not path.startswith("/") or "," in path or path != path.strip():
                raise ValueError(f"a path starting with '/', without commas or spaces: {path!r}")
        return v

    @field_validator("resources")
    @classmethod
    def _resource_keys(cls, v: Resources) -> Resources:
        unknown = sorted(set(v) - {"requests", "limits"})
        if unknown:
            raise ValueError(f"only 'requests' and 'limits' are allowed, got {unknown}")
        return v

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, v: str) -> str:
        level = v.upper()
        if level not in LOG_LEVELS:
            raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}, got {v!r}")
        return level


def _probe(path: str, port: int, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
    }


def sidecar_container(
    config: InjectionConfig,
    *,
    model_port: int,
    sidecar_port: int,
    policy: str | None,
    admin_port: int | None = None,
) -> dict[str, Any]:
    """The ``kvgate-sidecar`` container: ``kvgate-agent sidecar`` in cluster mode (thresholds
    from the node agent), proxying ``0.0.0.0:<sidecar_port>`` to ``127.0.0.1:<model_port>``,
    with its admin listener on ``0.0.0.0:<admin_port>`` (None: ``config.admin_port``).

    The env order is fixed: ``KVGATE_HOST_IP`` precedes ``KVGATE_AGENT_URL``, which refers to
    it as ``$(KVGATE_HOST_IP)`` (Kubernetes expands only variables defined earlier)."""

    def field_ref(name: str, path: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    admin = config.admin_port if admin_port is None else admin_port
    env: list[dict[str, Any]] = [
        {"name": "KVGATE_UPSTREAM", "value": f"http://127.0.0.1:{model_port}"},
        {"name": "KVGATE_LISTEN", "value": f"0.0.0.0:{sidecar_port}"},
        {"name": "KVGATE_ADMIN_LISTEN", "value": f"0.0.0.0:{admin}"},
        field_ref("KVGATE_HOST_IP", "status.hostIP"),
        {"name": "KVGATE_AGENT_URL", "value": f"http://$(KVGATE_HOST_IP):{config.agent_port}"},
        field_ref("KVGATE_POD_NAMESPACE", "metadata.namespace"),
        field_ref("KVGATE_POD_NAME", "metadata.name"),
        field_ref("KVGATE_POD_UID", "metadata.uid"),
        field_ref("KVGATE_POD_IP", "status.podIP"),
        {"name": "KVGATE_TOKEN_FILE", "value": TOKEN_FILE},
        {"name": "KVGATE_DRAIN_SECONDS", "value": str(config.drain_seconds)},
        {"name": "KVGATE_HEADER_TIMEOUT_SECONDS", "value": f"{config.header_timeout_seconds:g}"},
        {"name": "KVGATE_BODY_TIMEOUT_SECONDS", "value": f"{config.body_timeout_seconds:g}"},
        {"name": "KVGATE_UPSTREAM_TIMEOUT", "value": f"{config.upstream_timeout_seconds:g}"},
        {"name": "KVGATE_LOG_LEVEL", "value": config.log_level},
    ]
    if policy is not None:
        env.append({"name": "KVGATE_EXPECTED_POLICY", "value": policy})
    if config.passthrough_paths:
        env.append(
            {"name": "KVGATE_PASSTHROUGH_PATHS", "value": ",".join(config.passthrough_paths)}
        )
    container: dict[str, Any] = {
        "name": SIDECAR_NAME,
        "image": config.sidecar_image,
        "imagePullPolicy": config.image_pull_policy,
        "args": ["sidecar"],
        "ports": [
            {"name": PORT_NAME, "containerPort": sidecar_port, "protocol": "TCP"},
            {"name": ADMIN_PORT_NAME, "containerPort": admin, "protocol": "TCP"},
        ],
        "env": env,
        "resources": copy.deepcopy(config.resources),
        "volumeMounts": [{"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}],
        "readinessProbe": _probe("/readyz", sidecar_port, 5, 3),
        "livenessProbe": _probe("/healthz", sidecar_port, 10, 3),
        "startupProbe": _probe("/healthz", sidecar_port, 1, 30),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if config.store is not None:
        env += store_env(config.store)
        container["volumeMounts"] += store_mounts(config.store)
    for f in config.identity_files():
        env.append(f.env())
        container["volumeMounts"].append(f.mount())
    if config.native_sidecar:
        container["restartPolicy"] = "Always"
    return container


def token_volume(config: InjectionConfig) -> dict[str, Any]:
    """The ``kvgate-token`` volume: a projected service-account token for the node agent."""
    return {
        "name": TOKEN_VOLUME,
        "projected": {
            "sources": [
                {
                    "serviceAccountToken": {
                        "audience": config.token_audience,
                        "expirationSeconds": config.token_expiration_seconds,
                        "path": "token",
                    }
                }
            ]
        },
    }


def injected_annotation(
    *, model_port: int, sidecar_port: int, admin_port: int, native: bool
) -> str:
    """The value of ``kvgate.io/injected``: compact JSON, sorted keys."""
    return json.dumps(
        {
            "adminPort": admin_port,
            "modelPort": model_port,
            "native": native,
            "sidecarPort": sidecar_port,
            "version": TEMPLATE_VERSION,
        },
        sort_keys=True,
        separators=(",", ":"),
    )
