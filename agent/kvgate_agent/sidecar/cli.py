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
import gc
import logging
import os
import signal
import socket
import sys

from kvgate_agent.args import add_flags, add_log_level, configure_logging, from_args
from kvgate_agent.contract.policy import PolicyError, RateLimitPolicy, load_policy
from kvgate_agent.sidecar.app import Sidecar
from kvgate_agent.sidecar.identity import KeyFileError
from kvgate_agent.sidecar.node_link import gpu_uuids_from_env, sidecar_metrics_url
from kvgate_agent.sidecar.reading import TokenizerError
from kvgate_agent.sidecar.server import SidecarServer
from kvgate_agent.sidecar.settings import (
    AgentSettings,
    SidecarSettings,
    StoreSettings,
    passthrough_path,
)

log = logging.getLogger("kvgate")

#: ``--tokenizer`` value asking the model server's own ``/tokenize`` (a tokenizer file of that
#: name is given as ``./engine``).
ENGINE_TOKENIZER = "engine"


def add_sidecar_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``sidecar`` subcommand to ``kvgate-agent``'s parser: one flag per flag field of
    :class:`~kvgate_agent.sidecar.settings.SidecarSettings`, :class:`AgentSettings` and
    :class:`StoreSettings` (:func:`~kvgate_agent.args.add_flags`), and ``--log-level``."""
    s = sub.add_parser(
        "sidecar",
        help="admission-controlling reverse proxy for a model server",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_flags(s, SidecarSettings)
    add_flags(s.add_argument_group("node agent (cluster mode: --agent-url)"), AgentSettings)
    add_flags(s.add_argument_group("store of shared limits (a Redis)"), StoreSettings)
    add_log_level(s)


def store_settings(args: argparse.Namespace) -> StoreSettings | None:
    """The store settings from parsed ``sidecar`` arguments (None without ``--store``); the
    sidecar's name among its peers is the pod's name, else host and pid."""
    if not args.store:
        return None
    return from_args(
        StoreSettings,
        args,
        password_file=args.store_password_file or None,
        ca_file=args.store_ca_file or None,
        member=args.pod_name or f"{socket.gethostname()}-{os.getpid()}",
    )


#: The cyclic collector's thresholds while serving (CPython's default: 700, 10, 10). A request
#: makes no reference cycle (only a connection does, collected when it closes), but the objects
#: of the requests in flight survive young collections and reach the oldest generation, whose
#: collections then stall the loop: with the defaults, 32 connections at one core saw p99 51 ms
#: and 5,375 requests/s; with these, p99 8.4 ms and 6,802 requests/s (and at 256 connections
#: p99 140 -> 76 ms), the memory held by garbage unchanged (the same approach as
#: https://instagram-engineering.com/dismissing-python-garbage-collection-at-instagram-4dca40b29172).
GC_THRESHOLDS = (50_000, 20, 100)


async def run_sidecar(
    settings: SidecarSettings, listen: tuple[str, int], admin: tuple[str, int] | None
) -> int:
    """Serve until SIGTERM/SIGINT, then: refuse new work (waiting requests get 503 with
    Retry-After, the listener closes), let in-flight requests finish for up to
    ``settings.drain_seconds`` (a second signal cuts that short), end what is left (streams
    with a terminal ``shutting_down`` error event, unanswered requests with 503; every
    reservation is released on that path too) and return 0. SIGHUP re-reads the policy file
    (standalone), the keys and the JWKS files (:meth:`Sidecar.reload`: a bad file keeps what
    is enforced) and serving goes on."""
    server = SidecarServer(Sidecar(settings))
    await server.start(listen, admin)
    # What startup built (modules, the policy, the tokenizer) lives as long as the process:
    # out of the cyclic collector's generations, so that its collections on the request path
    # do not walk it again (https://docs.python.org/3/library/gc.html#gc.freeze).
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    stop = asyncio.Event()
    hurry = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    reloads: set[asyncio.Task[None]] = set()

    def on_hup() -> None:  # re-read the files; never ends the sidecar
        log.info("SIGHUP: re-reading the policy, keys and JWKS files")
        task = loop.create_task(server.sidecar.reload())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_hup)
    source = (
        f"thresholds from {settings.agent.url}" if settings.agent is not None else "policy file"
    )
    host = f"[{listen[0]}]" if ":" in listen[0] else listen[0]  # an IPv6 address in a URL
    admin_at = ""
    if admin is not None:
        admin_host = f"[{admin[0]}]" if ":" in admin[0] else admin[0]
        admin_at = f"; admin on http://{admin_host}:{server.admin_port}"
    print(
        f"kvgate sidecar listening on http://{host}:{listen[1]} -> {settings.upstream} "
        f"({source}; server leg {settings.server_leg}{admin_at})",
        flush=True,
    )
    await stop.wait()
    await server.drain(settings.drain_seconds, hurry)
    return 0


def agent_settings(args: argparse.Namespace) -> AgentSettings:
    """The node-agent settings from parsed ``sidecar`` arguments (``--agent-url`` given); the
    pod's GPUs come from ``KVGATE_GPU_UUIDS`` or ``NVIDIA_VISIBLE_DEVICES``."""
    host, port = args.listen
    return from_args(
        AgentSettings,
        args,
        pod_uid=args.pod_uid or None,
        pod_ip=args.pod_ip or None,
        metrics_url=sidecar_metrics_url(args.pod_ip or None, host, port),
        gpu_uuids=gpu_uuids_from_env(os.environ),
        expected_policy=args.expected_policy or None,
    )


def sidecar_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``kvgate-agent sidecar``: check the mode (exactly one of ``--policy`` and
    ``--agent-url``; exit 2 otherwise) and that ``--share-sync`` comes with ``--store`` (exit 2
    otherwise: without a store there is nothing to exchange through), then serve until
    signalled."""
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
    if args.share_sync > 0 and not args.store:
        parser.error(
            "sidecar: --share-sync (KVGATE_SHARE_SYNC) needs --store (KVGATE_STORE_URL): the "
            "service counters are exchanged through the store"
        )
    try:  # the flags went through the type already, the environment's entries did not
        passthrough = tuple(passthrough_path(p) for p in args.passthrough_path)
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
    settings = from_args(
        SidecarSettings,
        args,
        policy=policy,
        policy_file=args.policy,
        agent=agent,
        tokenizer_file=None if args.tokenizer == ENGINE_TOKENIZER else args.tokenizer,
        engine_tokenizer=args.tokenizer == ENGINE_TOKENIZER,
        passthrough_paths=passthrough,
        store=store_settings(args),
        api_keys_file=args.api_keys_file or None,
        jwks_file=args.jwks_file or None,
    )
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    try:
        return asyncio.run(run_sidecar(settings, settings.listen, settings.admin_listen))
    except OSError as exc:  # e.g. the port is taken
        print(
            f"kvgate-agent: cannot serve on {args.listen[0]}:{args.listen[1]}: {exc}",
            file=sys.stderr,
        )
        return 1
    except (TokenizerError, KeyFileError) as exc:  # configuration: exit 2, as a bad flag
        print(f"kvgate-agent: {exc}", file=sys.stderr)
        return 2
