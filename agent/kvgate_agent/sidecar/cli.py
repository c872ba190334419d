"""``kvgate-agent sidecar``: the admission-controlling reverse proxy in front of one model server.

Every flag also reads an environment variable (``KVGATE_<FLAG>``), so the injected sidecar is
configured through its pod's environment. Exactly one of ``--policy FILE`` (standalone) and
``--agent-url URL`` (thresholds from the node agent; ``--pod-namespace`` and ``--pod-name``
required, usually from the downward API) is given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys

from aiohttp import web

from kvgate_agent.admission import Reason
from kvgate_agent.args import add_log_level, configure_logging
from kvgate_agent.args import env as _env
from kvgate_agent.args import hostport as _hostport
from kvgate_agent.args import positive as _positive
from kvgate_agent.contract.policy import FailureMode, PolicyError, RateLimitPolicy, load_policy
from kvgate_agent.contract.sync import MAX_WAIT_SECONDS
from kvgate_agent.sidecar.agent_link import (
    DEFAULT_TOKEN_FILE,
    AgentSettings,
    gpu_uuids_from_env,
    sidecar_metrics_url,
)
from kvgate_agent.sidecar.app import Sidecar, SidecarSettings
from kvgate_agent.sidecar.endpoints import Passthrough
from kvgate_agent.sidecar.engine_tokens import DEFAULT_TIMEOUT_SECONDS
from kvgate_agent.sidecar.store import StoreSettings
from kvgate_agent.sidecar.tokens import TokenizerError

log = logging.getLogger("kvgate")

#: ``--tokenizer`` value asking the model server's own ``/tokenize`` (a tokenizer file of that
#: name is given as ``./engine``).
ENGINE_TOKENIZER = "engine"


def _url(value: str) -> str:
    if not value.startswith(("http://", "https://")) or len(value) < 10:
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, got {value!r}")
    return value


def _non_negative_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {value!r}")
    return seconds


def _passthrough_path(value: str) -> str:
    """One allowlist entry, refused (exit 2) when it could never match (see
    :class:`~kvgate_agent.sidecar.endpoints.Passthrough`)."""
    path = value.strip()
    if not path.startswith("/"):
        raise argparse.ArgumentTypeError(f"expected a path starting with '/', got {value!r}")
    try:
        Passthrough.of([path])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return path


def add_sidecar_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``sidecar`` subcommand to ``kvgate-agent``'s parser. String defaults from the
    environment go through each flag's type, so a bad ``KVGATE_*`` value is reported like a bad
    flag."""
    s = sub.add_parser(
        "sidecar",
        help="admission-controlling reverse proxy for a model server",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_source_args(s)
    _add_agent_args(s)
    _add_serving_args(s)
    _add_store_args(s)
    add_log_level(s)


def _add_source_args(s: argparse.ArgumentParser) -> None:
    """The model server and where thresholds come from (policy file or node agent)."""
    s.add_argument(
        "--upstream",
        type=_url,
        default=_env("UPSTREAM"),
        required=_env("UPSTREAM") is None,
        help="model server base URL, e.g. http://127.0.0.1:8000 [KVGATE_UPSTREAM]",
    )
    s.add_argument(
        "--policy",
        default=_env("POLICY"),
        help="RateLimitPolicy manifest file (YAML or JSON): standalone mode; give this or "
        "--agent-url [KVGATE_POLICY]",
    )
    s.add_argument(
        "--agent-url",
        type=_url,
        default=_env("AGENT_URL"),
        help="node agent base URL, e.g. http://$(HOST_IP):9470: thresholds come from it "
        "(cluster mode; give this or --policy) [KVGATE_AGENT_URL]",
    )


def _add_agent_args(s: argparse.ArgumentParser) -> None:
    """Agent mode: the pod's identity, its token and what applies without answers."""
    s.add_argument(
        "--token-file",
        default=_env("TOKEN_FILE", DEFAULT_TOKEN_FILE),
        help="projected service-account token (audience kvgate-agent) sent to the node agent, "
        "re-read before every sync [KVGATE_TOKEN_FILE]",
    )
    s.add_argument(
        "--pod-namespace",
        default=_env("POD_NAMESPACE"),
        help="this pod's namespace (downward API); required with --agent-url "
        "[KVGATE_POD_NAMESPACE]",
    )
    s.add_argument(
        "--pod-name",
        default=_env("POD_NAME"),
        help="this pod's name (downward API); required with --agent-url [KVGATE_POD_NAME]",
    )
    s.add_argument(
        "--pod-uid",
        default=_env("POD_UID"),
        help="this pod's uid (downward API), checked by the node agent [KVGATE_POD_UID]",
    )
    s.add_argument(
        "--pod-ip",
        default=_env("POD_IP"),
        help="this pod's IP (downward API): the node agent scrapes the engine's metrics "
        "through http://POD_IP:PORT/metrics [KVGATE_POD_IP]",
    )
    s.add_argument(
        "--failure-mode",
        default=_env("FAILURE_MODE", FailureMode.FAIL_OPEN.value),
        choices=[m.value for m in FailureMode],
        help="with --agent-url: what applies until the node agent's first answer (FailOpen: no "
        "limits; FailClosed: 503), and past the TTL when no policy selects the pod "
        "[KVGATE_FAILURE_MODE]",
    )
    s.add_argument(
        "--expected-policy",
        default=_env("EXPECTED_POLICY"),
        help="with --agent-url: the RateLimitPolicy this pod should be governed by (the "
        "webhook sets it from the kvgate.io/policy annotation); a different or no policy is "
        "logged and shown in kvgate_policy_mismatch [KVGATE_EXPECTED_POLICY]",
    )
    s.add_argument(
        "--thresholds-ttl",
        type=_positive(float),
        default=_env("THRESHOLDS_TTL"),
        help="with --agent-url: seconds the last thresholds stay enforced while the node "
        "agent is unreachable, then the policy's failureMode applies (default: the agent's "
        "ttlSeconds, 30 before its first answer) [KVGATE_THRESHOLDS_TTL]",
    )
    s.add_argument(
        "--sync-wait",
        type=_non_negative_seconds,
        default=_env("SYNC_WAIT", str(MAX_WAIT_SECONDS)),
        help="with --agent-url: seconds the node agent may hold a sync until the thresholds "
        "change (long poll; capped below the TTL); 0 = poll every sync interval "
        "[KVGATE_SYNC_WAIT]",
    )


def _add_serving_args(s: argparse.ArgumentParser) -> None:
    """Listening, the tokenizer, body and time limits."""
    s.add_argument(
        "--listen",
        type=_hostport,
        default=_env("LISTEN", "127.0.0.1:8080"),
        help="HOST:PORT to serve clients on [KVGATE_LISTEN]",
    )
    s.add_argument(
        "--admin-listen",
        type=_hostport,
        default=_env("ADMIN_LISTEN"),
        help="optional HOST:PORT serving /metrics, /healthz, /readyz [KVGATE_ADMIN_LISTEN]",
    )
    s.add_argument(
        "--tokenizer",
        default=_env("TOKENIZER"),
        help="HF tokenizer.json for exact prompt counts, or 'engine': ask the model server's own "
        "/tokenize (vLLM, llama.cpp; cached by prompt, the estimate when it is slow or down) "
        "[KVGATE_TOKENIZER]",
    )
    s.add_argument(
        "--engine-tokenize-timeout",
        type=_positive(float),
        default=_env("ENGINE_TOKENIZE_TIMEOUT", str(DEFAULT_TIMEOUT_SECONDS)),
        help="with --tokenizer engine: seconds a request waits for the engine's count of a "
        "prompt not yet cached before kvgate's estimate is used [KVGATE_ENGINE_TOKENIZE_TIMEOUT]",
    )
    s.add_argument(
        "--max-body-bytes",
        type=_positive(int),
        default=_env("MAX_BODY_BYTES", str(8 * 1024 * 1024)),
        help="request body limit, bytes; larger bodies get 413 [KVGATE_MAX_BODY_BYTES]",
    )
    s.add_argument(
        "--upstream-timeout",
        type=_positive(float),
        default=_env("UPSTREAM_TIMEOUT", "600"),
        help="seconds without a byte from the model server before a request "
        "fails with 504 [KVGATE_UPSTREAM_TIMEOUT]",
    )
    s.add_argument(
        "--header-timeout-seconds",
        type=_non_negative_seconds,
        default=_env("HEADER_TIMEOUT_SECONDS", "10"),
        help="seconds a client connection may take to send a request's headers (slow "
        "clients get 408 and are disconnected); 0 disables [KVGATE_HEADER_TIMEOUT_SECONDS]",
    )
    s.add_argument(
        "--body-timeout-seconds",
        type=_non_negative_seconds,
        default=_env("BODY_TIMEOUT_SECONDS", "30"),
        help="seconds a request's body (admitted or passed through) may take to arrive after "
        "its headers (then 408); 0 disables [KVGATE_BODY_TIMEOUT_SECONDS]",
    )
    s.add_argument(
        "--drain-seconds",
        type=_positive(float),
        default=_env("DRAIN_SECONDS", "30"),
        help="on SIGTERM, how long in-flight requests may finish; keep it below "
        "the pod's terminationGracePeriodSeconds [KVGATE_DRAIN_SECONDS]",
    )
    _add_routing_args(s)


def _add_routing_args(s: argparse.ArgumentParser) -> None:
    """The pass-through allowlist and the engine's usage polling."""
    s.add_argument(
        "--passthrough-path",
        action="append",
        type=_passthrough_path,
        default=[p for p in (_env("PASSTHROUGH_PATHS") or "").split(",") if p.strip()],
        help="a path (or a prefix ending in *) that POST and other mutating requests may reach "
        "the model server on without admission, besides /tokenize, /detokenize, "
        "/chat_tokenize, /v1/messages/count_tokens, /apply-template and "
        "/v1/responses/*/cancel (* in the middle: one segment); repeatable; any other unknown "
        "mutating request gets 404; an entry that can never match (a '?', a generation path, "
        "a non-canonical path) exits 2. The flags add to KVGATE_PASSTHROUGH_PATHS "
        "(comma-separated) [KVGATE_PASSTHROUGH_PATHS]",
    )
    s.add_argument(
        "--engine-usage-seconds",
        type=_non_negative_seconds,
        default=_env("ENGINE_USAGE_SECONDS", "1"),
        help="how often the model server's KV tokens in use and its own waiting requests are "
        "read from its /metrics while a KV capacity or a TTFT SLO is enforced; admission "
        "counts the KV figure where it exceeds kvgate's own reservations, and the waiting "
        "requests in the expected queue wait; 0 disables [KVGATE_ENGINE_USAGE_SECONDS]",
    )


def _store_url(value: str) -> str:
    if not value.startswith(("redis://", "rediss://")):
        raise argparse.ArgumentTypeError(f"expected a redis:// or rediss:// URL, got {value!r}")
    return value


def _add_store_args(s: argparse.ArgumentParser) -> None:
    """The store of ``shared`` limits (a Redis; see :mod:`kvgate_agent.sidecar.store`)."""
    s.add_argument(
        "--store",
        type=_store_url,
        default=_env("STORE_URL"),
        help="Redis holding the budgets of shared limits, redis://HOST:PORT/DB or rediss:// "
        "(TLS); without it shared limits are enforced per pod [KVGATE_STORE_URL]",
    )
    s.add_argument(
        "--store-password-file",
        default=_env("STORE_PASSWORD_FILE"),
        help="file holding the store's password (a mounted Secret) [KVGATE_STORE_PASSWORD_FILE]",
    )
    s.add_argument(
        "--store-ca-file",
        default=_env("STORE_CA_FILE"),
        help="CA bundle verifying a rediss:// store [KVGATE_STORE_CA_FILE]",
    )
    s.add_argument(
        "--store-timeout",
        type=_positive(float),
        default=_env("STORE_TIMEOUT", "1.0"),
        help="seconds one store command may take before the sync counts as failed "
        "[KVGATE_STORE_TIMEOUT]",
    )


def store_settings(args: argparse.Namespace) -> StoreSettings | None:
    """The store settings from parsed ``sidecar`` arguments (None without ``--store``); the
    sidecar's name among its peers is the pod's name, else host and pid."""
    if not args.store:
        return None
    member = args.pod_name or f"{socket.gethostname()}-{os.getpid()}"
    return StoreSettings(
        url=args.store,
        password_file=args.store_password_file or None,
        ca_file=args.store_ca_file or None,
        timeout=args.store_timeout,
        member=member,
    )


async def run_sidecar(
    settings: SidecarSettings, listen: tuple[str, int], admin: tuple[str, int] | None
) -> int:
    """Serve until SIGTERM/SIGINT, then: refuse new work (waiting requests get 503 with
    Retry-After, the listener closes), let in-flight requests finish for up to
    ``settings.drain_seconds`` (a second signal cuts that short), end what is left (streams
    with a terminal ``shutting_down`` error event, unanswered requests with 503; every
    reservation is released on that path too) and return 0."""
    sidecar = Sidecar(settings)
    runner = sidecar.runner(
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=1.0,
        max_field_size=65536,
        max_line_size=65536,
    )
    await runner.setup()
    site = web.TCPSite(runner, listen[0], listen[1], backlog=1024)
    admin_runner: web.AppRunner | None = None
    try:
        await site.start()
        if admin is not None:
            admin_runner = sidecar.runner(admin=True, access_log=None, shutdown_timeout=1.0)
            await admin_runner.setup()
            await web.TCPSite(admin_runner, admin[0], admin[1]).start()
    except BaseException:  # a port taken: close what started (the upstream session) first
        if admin_runner is not None:
            await admin_runner.cleanup()
        await runner.cleanup()
        raise
    stop = asyncio.Event()
    hurry = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    source = (
        f"thresholds from {settings.agent.url}" if settings.agent is not None else "policy file"
    )
    print(
        f"kvgate sidecar listening on http://{listen[0]}:{listen[1]} -> {settings.upstream} "
        f"({source})",
        flush=True,
    )
    await stop.wait()
    log.info("shutting down: draining up to %.0fs", settings.drain_seconds)
    sidecar.draining = True
    sidecar.admission.reject_waiting(Reason.DRAINING, 503, 1.0, "the sidecar is shutting down")
    await site.stop()  # stop accepting new connections
    idle = asyncio.ensure_future(sidecar.admission.wait_idle(settings.drain_seconds))
    cut = asyncio.ensure_future(hurry.wait())
    await asyncio.wait({idle, cut}, return_when=asyncio.FIRST_COMPLETED)
    cut.cancel()
    if not idle.done() or not idle.result():
        idle.cancel()
        log.warning(
            "stopping with %d requests in flight (drain deadline or second signal)",
            sidecar.admission.stats().in_flight,
        )
        await sidecar.forwarder.end_all(grace=1.0)  # streams end with an error event
    await runner.cleanup()  # cancels what is still running: their reservations are released
    if admin_runner is not None:
        await admin_runner.cleanup()
    return 0


def agent_settings(args: argparse.Namespace) -> AgentSettings:
    """The node-agent settings from parsed ``sidecar`` arguments (``--agent-url`` given); the
    pod's GPUs come from ``KVGATE_GPU_UUIDS`` or ``NVIDIA_VISIBLE_DEVICES``."""
    host, port = args.listen
    return AgentSettings(
        url=args.agent_url,
        pod_namespace=args.pod_namespace,
        pod_name=args.pod_name,
        pod_uid=args.pod_uid or None,
        token_file=args.token_file,
        failure_mode=FailureMode(args.failure_mode),
        ttl_override=args.thresholds_ttl,
        metrics_url=sidecar_metrics_url(args.pod_ip or None, host, port),
        gpu_uuids=gpu_uuids_from_env(os.environ),
        expected_policy=args.expected_policy or None,
        sync_wait=args.sync_wait,
    )


def sidecar_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``kvgate-agent sidecar``: check the mode (exactly one of ``--policy`` and
    ``--agent-url``; exit 2 otherwise), then serve until signalled."""
    if (args.policy is None) == (args.agent_url is None):
        parser.error(
            "sidecar: give exactly one of --policy (standalone) or --agent-url (thresholds "
            "from the node agent)"
        )
    if args.agent_url is not None and not (args.pod_namespace and args.pod_name):
        parser.error(
            "sidecar: --agent-url needs --pod-namespace and --pod-name (KVGATE_POD_NAMESPACE, "
            "KVGATE_POD_NAME from the downward API)"
        )
    try:  # the flags went through the type already, the environment's entries did not
        passthrough = tuple(_passthrough_path(p) for p in args.passthrough_path)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"sidecar: KVGATE_PASSTHROUGH_PATHS: {exc}")
    configure_logging(args.log_level)
    policy: RateLimitPolicy | None = None
    agent: AgentSettings | None = None
    if args.policy is not None:
        try:
            policy = load_policy(args.policy)
        except PolicyError as exc:
            print(f"kvgate-agent: {exc}", file=sys.stderr)
            return 2
    else:
        agent = agent_settings(args)
    settings = SidecarSettings(
        upstream=args.upstream,
        policy=policy,
        agent=agent,
        tokenizer_file=None if args.tokenizer == ENGINE_TOKENIZER else args.tokenizer,
        engine_tokenizer=args.tokenizer == ENGINE_TOKENIZER,
        engine_tokenize_timeout=args.engine_tokenize_timeout,
        max_body_bytes=args.max_body_bytes,
        read_timeout=args.upstream_timeout,
        drain_seconds=args.drain_seconds,
        header_timeout=args.header_timeout_seconds,
        body_timeout=args.body_timeout_seconds,
        engine_usage_seconds=args.engine_usage_seconds,
        passthrough_paths=passthrough,
        store=store_settings(args),
    )
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    try:
        return asyncio.run(run_sidecar(settings, args.listen, args.admin_listen))
    except OSError as exc:  # e.g. the port is taken
        print(
            f"kvgate-agent: cannot serve on {args.listen[0]}:{args.listen[1]}: {exc}",
            file=sys.stderr,
        )
        return 1
    except TokenizerError as exc:
        print(f"kvgate-agent: {exc}", file=sys.stderr)
        return 1
