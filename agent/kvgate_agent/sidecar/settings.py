"""The sidecar's settings: :class:`SidecarSettings`, with :class:`AgentSettings` (cluster mode,
defined by the node link) and :class:`StoreSettings` (shared limits, defined by the store) inside
it, both re-exported here.

Each field's default is written once (here, or beside its room), with its docstring under it. A
field that is also a ``kvgate-agent sidecar`` flag carries :func:`~kvgate_agent.args.flag`
metadata, from which :mod:`kvgate_agent.sidecar.cli` derives the flag, its ``KVGATE_*``
variable and its default.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from kvgate_agent.args import flag, hostport, hostport_text, non_negative_seconds, positive
from kvgate_agent.contract.policy import RateLimitPolicy
from kvgate_agent.sidecar.engine import DEFAULT_TIMEOUT_SECONDS
from kvgate_agent.sidecar.node_link import AgentSettings as AgentSettings  # re-exported
from kvgate_agent.sidecar.reading import Passthrough
from kvgate_agent.sidecar.store import StoreSettings as StoreSettings  # re-exported
from kvgate_agent.sidecar.upstream import base_url_problem


def passthrough_path(value: str) -> str:
    """An argparse type: one allowlist entry, refused (exit 2) when it could never match (see
    :class:`~kvgate_agent.sidecar.reading.endpoints.Passthrough`)."""
    path = value.strip()
    if not path.startswith("/"):
        raise argparse.ArgumentTypeError(f"expected a path starting with '/', got {value!r}")
    try:
        Passthrough.of([path])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return path


def server_leg(value: str) -> str:
    """An argparse type: the clients' server leg, ``kvgate`` (its own, the only one); ``aiohttp``,
    the leg of kvgate 0.x, was retired (exit 2, saying so)."""
    leg = value.strip()
    if leg == "aiohttp":
        raise argparse.ArgumentTypeError(
            "the aiohttp server leg was retired: kvgate serves clients on its own leg only "
            "(drop --server-leg / KVGATE_SERVER_LEG, or give 'kvgate')"
        )
    if leg != "kvgate":
        raise argparse.ArgumentTypeError(f"expected 'kvgate' (the only server leg), got {value!r}")
    return leg


def upstream_url(value: str) -> str:
    """An argparse type: the model server's root URL (``http://host:8000``; exit 2 for a path
    such as ``/v1``, a query or a fragment: :func:`~kvgate_agent.sidecar.upstream.model_server.
    base_url_problem`)."""
    problem = base_url_problem(value.strip())
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{value!r}: {problem}")
    return value.strip()


@dataclass(slots=True)
class SidecarSettings:
    """Runtime settings of one sidecar. Exactly one of :attr:`policy` and :attr:`agent` is
    given (:class:`~kvgate_agent.sidecar.app.Sidecar` refuses anything else)."""

    upstream: str = field(
        metadata=flag(
            "model server root URL, e.g. http://127.0.0.1:8000 (no path: clients' paths go "
            "upstream as sent)",
            parse=upstream_url,
            required=True,
        )
    )
    """Root URL of the model server, e.g. ``http://127.0.0.1:8000`` (no path, query or
    fragment: :func:`upstream_url`)."""

    policy: RateLimitPolicy | None = field(
        default=None,
        metadata=flag(
            "RateLimitPolicy manifest file (YAML or JSON): standalone mode; give this or "
            "--agent-url"
        ),
    )
    """The RateLimitPolicy enforced (standalone mode). Its flag names the manifest file, which
    ``kvgate-agent sidecar`` loads."""

    policy_file: str | None = None
    """The file :attr:`policy` was read from (standalone): re-read on SIGHUP
    (:meth:`~kvgate_agent.sidecar.app.Sidecar.reload`); None: not re-read."""

    agent: AgentSettings | None = None
    """The node agent to take thresholds from (cluster mode; its own flags)."""

    listen: tuple[str, int] = field(
        default=("127.0.0.1", 8080),
        metadata=flag("HOST:PORT to serve clients on", parse=hostport, text=hostport_text),
    )
    """Where :func:`~kvgate_agent.sidecar.cli.run_sidecar` serves clients."""

    server_leg: str = field(
        default="kvgate",
        metadata=flag(
            "the HTTP server serving clients: kvgate's own (llhttp, answers written straight to "
            "the socket), the only one ('aiohttp', the leg of kvgate 0.x, was retired)",
            parse=server_leg,
        ),
    )
    """The HTTP server leg serving :attr:`listen`: ``kvgate``, its own
    (:mod:`kvgate_agent.sidecar.edge.client_conn`), the only one; kept as a flag so that
    deployments passing ``--server-leg kvgate`` still start (``aiohttp``, the leg of kvgate 0.x,
    was retired: exit 2)."""

    admin_listen: tuple[str, int] | None = field(
        default=None,
        metadata=flag(
            "optional HOST:PORT serving /metrics, /healthz, /readyz",
            parse=hostport,
            text=hostport_text,
        ),
    )
    """Where :func:`~kvgate_agent.sidecar.cli.run_sidecar` serves ``/metrics``, ``/healthz``
    and ``/readyz`` on their own (None: only on :attr:`listen`)."""

    tokenizer_file: str | None = field(
        default=None,
        metadata=flag(
            "HF tokenizer.json for exact prompt counts, or 'engine': ask the model server's own "
            "/tokenize (vLLM, llama.cpp; cached by prompt, the estimate when it is slow or "
            "down)",
            name="--tokenizer",
        ),
    )
    """HF ``tokenizer.json`` for exact prompt counts (else a conservative estimate corrected by
    reported usage). Its flag's value ``engine`` sets :attr:`engine_tokenizer` instead."""

    engine_tokenizer: bool = False
    """Count prompts with the engine's own ``/tokenize`` (cached; the estimate as the fallback:
    :mod:`kvgate_agent.sidecar.engine.engine_tokens`)."""

    engine_tokenize_timeout: float = field(
        default=DEFAULT_TIMEOUT_SECONDS,
        metadata=flag(
            "with --tokenizer engine: seconds a request waits for the engine's count of a "
            "prompt not yet cached before kvgate's estimate is used",
            parse=positive(float),
        ),
    )
    """Seconds a request waits for the engine's count of a prompt it has not cached before the
    estimate is used."""

    max_body_bytes: int = field(
        default=8 * 1024 * 1024,
        metadata=flag("request body limit, bytes; larger bodies get 413", parse=positive(int)),
    )
    """Request bodies above this get 413 (bytes)."""

    connect_timeout: float = 5.0
    """Seconds to open an upstream connection."""

    upstream_timeout: float | None = field(
        default=600.0,
        metadata=flag(
            "seconds without a byte from the model server before a request fails with 504",
            parse=positive(float),
        ),
    )
    """Seconds without any upstream byte before the request fails (None: no limit)."""

    header_timeout_seconds: float = field(
        default=10.0,
        metadata=flag(
            "seconds a client connection may take to send a request's headers (slow "
            "clients get 408 and are disconnected); 0 disables",
            parse=non_negative_seconds,
        ),
    )
    """Seconds a client connection may take to send a request's headers (from the connection's
    opening, or a later request's first byte); then it gets 408 and is closed (0: no limit;
    :mod:`kvgate_agent.sidecar.edge.client_conn`)."""

    body_timeout_seconds: float = field(
        default=30.0,
        metadata=flag(
            "seconds a request's body (admitted or passed through) may take to arrive after "
            "its headers (then 408); 0 disables",
            parse=non_negative_seconds,
        ),
    )
    """Seconds a request's body (admission-controlled or passed through) may take to arrive
    once its headers are in; then 408 (0: no limit)."""

    drain_seconds: float = field(
        default=30.0,
        metadata=flag(
            "on SIGTERM, how long in-flight requests may finish; keep it below "
            "the pod's terminationGracePeriodSeconds",
            parse=positive(float),
        ),
    )
    """On SIGTERM, how long in-flight requests may take to finish."""

    passthrough_paths: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "a path (or a prefix ending in *) that POST and other mutating requests may reach "
            "the model server on without admission, besides /tokenize, /detokenize, "
            "/chat_tokenize, /v1/messages/count_tokens, /apply-template and "
            "/v1/responses/*/cancel (* in the middle: one segment); repeatable; any other "
            "unknown mutating request gets 404; an entry that can never match (a '?', a "
            "generation path, a non-canonical path) exits 2. The flags add to "
            "KVGATE_PASSTHROUGH_PATHS (comma-separated)",
            name="--passthrough-path",
            env="PASSTHROUGH_PATHS",
            parse=passthrough_path,
            repeat=True,
        ),
    )
    """Paths added to the pass-through allowlist for mutating methods (exact, or a prefix
    ending in ``*``), besides
    :data:`~kvgate_agent.sidecar.reading.endpoints.DEFAULT_PASSTHROUGH`."""

    engine_poll_seconds: float = 15.0
    """How often the engine's KV capacity is re-read when ``capacity.fromEngineMetrics`` is
    set."""

    engine_usage_seconds: float = field(
        default=1.0,
        metadata=flag(
            "how often the model server's KV tokens in use and its own waiting requests are "
            "read from its /metrics while a KV capacity or a TTFT SLO is enforced; admission "
            "counts the KV figure where it exceeds kvgate's own reservations, and the waiting "
            "requests in the expected queue wait; 0 disables",
            parse=non_negative_seconds,
        ),
    )
    """How often the engine's KV tokens in use are read from its ``/metrics`` while a KV
    capacity is enforced; admission counts that figure where it exceeds kvgate's own
    reservations (0: never read)."""

    engine_stall_seconds: float = field(
        default=60.0,
        metadata=flag(
            "seconds with streams in flight and no token from the model server after which it "
            "counts as stalled (its /health may still answer): not ready, no new work sent to "
            "it (failureMode: FailOpen queues, FailClosed refuses with 503) until tokens flow "
            "again; 0 disables",
            parse=non_negative_seconds,
        ),
    )
    """Seconds with streams in flight and no token from the engine that make a stall
    (:mod:`kvgate_agent.sidecar.upstream.engine_stall`; 0: never judged)."""

    api_keys_file: str | None = field(
        default=None,
        metadata=flag(
            "YAML keys file, keys: [{sha256: <hex SHA-256 of an API key>, tenant: NAME}], "
            "naming the tenant of each bearer token when the policy's tenants.header is "
            "authorization (tenants.unknownKeys: what other keys get); re-read when it changes"
        ),
    )
    """The keys file (:mod:`kvgate_agent.sidecar.identity.keyfiles`; None: no keys file)."""

    jwks_file: str | None = field(
        default=None,
        metadata=flag(
            "JSON Web Key Set (RFC 7517) verifying the bearer tokens of the policy's "
            "tenants.jwt; re-read when it changes"
        ),
    )
    """The JWKS file (:mod:`kvgate_agent.sidecar.identity.keyfiles`; None: no JWT is accepted)."""

    identity_poll_seconds: float = 2.0
    """How often the keys and JWKS files are checked for changes, seconds."""

    tenant_label_limit: int = 50
    """Distinct tenant label values in metrics before ``other``."""

    store: StoreSettings | None = None
    """The Redis holding ``shared`` limits' budgets (None: they are per pod; its own flags)."""
