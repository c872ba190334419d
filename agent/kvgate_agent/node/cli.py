"""``kvgate-agent node``: the node agent (one per GPU node, a DaemonSet).

Every flag also reads an environment variable (``KVGATE_<FLAG>``). The node name usually comes
from the downward API (``spec.nodeName`` into ``KVGATE_NODE_NAME``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvgate_agent.args import add_log_level, configure_logging, positive
from kvgate_agent.args import env as _env
from kvgate_agent.args import hostport as _hostport

if TYPE_CHECKING:
    from kvgate_agent.gpu import GpuMonitor
    from kvgate_agent.node.kube import NodeAdmissionWatch
    from kvgate_agent.node.service import NodeAgent

log = logging.getLogger("kvgate.node")


def _seconds(value: str) -> float:
    return float(positive(float)(value))


#: The node agent's flags in seconds: (flag, environment variable after ``KVGATE_``, default,
#: help text).
SECONDS_FLAGS: tuple[tuple[str, str, str, str], ...] = (
    ("--gpu-poll-seconds", "GPU_POLL_SECONDS", "2", "how often NVML is read"),
    ("--gpu-call-timeout", "GPU_CALL_TIMEOUT", "2", "bound on each NVML read of one GPU"),
    ("--scrape-seconds", "SCRAPE_SECONDS", "5", "how often engine metrics are scraped"),
    (
        "--status-min-interval",
        "STATUS_MIN_INTERVAL",
        "5",
        "NodeAdmission status writes at most this often",
    ),
    ("--heartbeat-seconds", "HEARTBEAT_SECONDS", "30", "...and at least this often"),
    ("--thresholds-ttl", "THRESHOLDS_TTL", "30", "how long sidecars enforce without a sync"),
    ("--sync-interval", "SYNC_INTERVAL", "1", "how often sidecars sync"),
    (
        "--max-sync-wait",
        "MAX_SYNC_WAIT",
        "25",
        "longest hold of a sidecar's sync until its answer changes (long poll)",
    ),
    (
        "--token-cache-seconds",
        "TOKEN_CACHE_SECONDS",
        "60",
        "how long an accepted token is trusted",
    ),
    (
        "--api-liveness-seconds",
        "API_LIVENESS_SECONDS",
        "120",
        "liveness (/healthz) fails once the API server has not answered for this long",
    ),
    (
        "--watch-server-timeout",
        "WATCH_SERVER_TIMEOUT",
        "20",
        "the API server ends each NodeAdmission watch after this; it is renewed",
    ),
    (
        "--watch-read-timeout",
        "WATCH_READ_TIMEOUT",
        "30",
        "a watch silent this long (above the server timeout) is dead: reconnect",
    ),
)


def add_node_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``node`` subcommand to ``kvgate-agent``'s parser."""
    n = sub.add_parser(
        "node",
        help="node agent: NVML, KV usage, thresholds to sidecars, NodeAdmission status",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    n.add_argument(
        "--node-name",
        default=_env("NODE_NAME"),
        required=_env("NODE_NAME") is None,
        help="this node's name (downward API spec.nodeName) [KVGATE_NODE_NAME]",
    )
    n.add_argument(
        "--listen",
        type=_hostport,
        default=_env("LISTEN", "0.0.0.0:9470"),
        help="HOST:PORT for the sidecars' sync API, /metrics, /healthz, /readyz [KVGATE_LISTEN]",
    )
    n.add_argument(
        "--gpu-backend",
        default=_env("GPU_BACKEND", "nvml"),
        help="'nvml', or 'fake:<scenario.json>' for tests [KVGATE_GPU_BACKEND]",
    )
    n.add_argument(
        "--kubeconfig",
        default=_env("KUBECONFIG_FILE"),
        help="kubeconfig for running outside a pod (default: in-cluster, then $KUBECONFIG) "
        "[KVGATE_KUBECONFIG_FILE]",
    )
    _add_seconds_flags(n)
    n.add_argument(
        "--proc-root",
        default=_env("PROC_ROOT", "/proc"),
        help="host /proc (with hostPID) to map NVML processes to pods [KVGATE_PROC_ROOT]",
    )
    add_log_level(n)


def _add_seconds_flags(n: argparse.ArgumentParser) -> None:
    """The flags of :data:`SECONDS_FLAGS`, each also read from its environment variable."""
    for flag, env, default, text in SECONDS_FLAGS:
        n.add_argument(
            flag,
            type=_seconds,
            default=_env(env, default),
            help=f"{text}, seconds [KVGATE_{env}]",
        )


def _build(
    args: argparse.Namespace,
) -> tuple[Any, GpuMonitor, NodeAgent, NodeAdmissionWatch]:
    """The agent's parts from its flags: (API client, GPU monitor, agent, NodeAdmission watch);
    the agent's liveness sees the watch and when the API server last answered."""
    from kvgate_agent.gpu import GpuMonitor
    from kvgate_agent.gpu.select import backend_from_spec
    from kvgate_agent.node.auth import Authenticator, kube_token_reviewer
    from kvgate_agent.node.kube import (
        ApiContact,
        NodeAdmissionWatch,
        StatusWriter,
        load_api_client,
    )
    from kvgate_agent.node.service import NodeAgent, NodeSettings

    api_client = load_api_client(args.kubeconfig)
    settings = NodeSettings(
        node_name=args.node_name,
        gpu_poll_seconds=args.gpu_poll_seconds,
        scrape_seconds=args.scrape_seconds,
        status_min_interval=args.status_min_interval,
        heartbeat_seconds=args.heartbeat_seconds,
        ttl_seconds=args.thresholds_ttl,
        sync_interval_seconds=args.sync_interval,
        max_wait_seconds=args.max_sync_wait,
        proc_root=Path(args.proc_root),
        api_liveness_seconds=args.api_liveness_seconds,
    )
    monitor = GpuMonitor(backend_from_spec(args.gpu_backend), call_timeout=args.gpu_call_timeout)
    auth = Authenticator(kube_token_reviewer(api_client), ok_ttl=args.token_cache_seconds)
    contact = ApiContact()
    agent = NodeAgent(settings, monitor, auth, StatusWriter(api_client, args.node_name, contact))
    watch = NodeAdmissionWatch(
        api_client,
        args.node_name,
        asyncio.get_running_loop(),
        agent.on_spec,
        timeout_seconds=max(1, round(args.watch_server_timeout)),
        read_timeout=args.watch_read_timeout,
        contact=contact,
    )
    agent.api_contact_age, agent.watch_alive = contact.age, watch.alive
    return api_client, monitor, agent, watch


async def run_node(args: argparse.Namespace) -> int:
    """Run the node agent until SIGTERM/SIGINT."""
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn's server without its own signal capture: the agent decides the shutdown
        order (stop serving, stop the watch and loops, close NVML) and exits 0."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    from kvgate_agent.node.api import build_app

    api_client, monitor, agent, watch = _build(args)
    loop = asyncio.get_running_loop()
    await agent.start()
    watch.start()
    config = uvicorn.Config(
        build_app(agent),
        host=args.listen[0],
        port=args.listen[1],
        log_level="warning",
        access_log=False,
        lifespan="off",
    )
    server = _Server(config)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server_task = asyncio.create_task(server.serve())
    print(
        f"kvgate node agent for {args.node_name} listening on http://{args.listen[0]}:{args.listen[1]}",
        flush=True,
    )
    await asyncio.wait(
        {server_task, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED
    )
    server.should_exit = True
    agent.release_syncs()  # held long polls answer now: the server need not wait them out
    try:
        await server_task
    except (Exception, SystemExit) as exc:  # uvicorn exits (sys.exit) when it cannot bind
        log.error("the sync API stopped: %r", exc)
    watch.stop()
    await agent.stop()
    if server.started:
        await agent.write_final_status()  # Ready=False/AgentStopped: nobody reads stale figures
    monitor.close()
    api_client.close()
    return 0 if server.started else 1


def node_main(args: argparse.Namespace) -> int:
    """``kvgate-agent node`` with parsed arguments. Exit codes: 0 after a clean shutdown, 1 when
    it cannot serve or has no Kubernetes configuration, 2 on a bad GPU backend."""
    from kvgate_agent.gpu.select import backend_from_spec

    configure_logging(args.log_level)
    try:
        backend_from_spec(args.gpu_backend)
    except ValueError as exc:
        print(f"kvgate-agent node: {exc}", file=sys.stderr)
        return 2
    if not args.node_name.strip():
        print("kvgate-agent node: --node-name (KVGATE_NODE_NAME) is empty", file=sys.stderr)
        return 2
    if args.watch_read_timeout <= args.watch_server_timeout:
        print(
            "kvgate-agent node: --watch-read-timeout must exceed --watch-server-timeout",
            file=sys.stderr,
        )
        return 2
    rc = 1
    try:
        rc = asyncio.run(run_node(args))
    except OSError as exc:
        print(f"kvgate-agent node: {exc}", file=sys.stderr)
    except Exception as exc:
        from kubernetes.config import ConfigException

        if not isinstance(exc, ConfigException):
            traceback.print_exc()  # a bug: show it (os._exit below would swallow a raise)
            return 1  # (the finally clause exits with rc = 1)
        where = args.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        print(
            f"kvgate-agent node: no Kubernetes configuration (not in a pod, and {where}: {exc})",
            file=sys.stderr,
        )
    finally:
        # A GPU call hung in the driver keeps its worker thread, which the interpreter would
        # join at exit (forever): everything is closed by now, so leave without waiting for it.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def main(argv: Sequence[str]) -> int:
    """``kvgate-agent node`` from its arguments (without the subcommand)."""
    parser = argparse.ArgumentParser(prog="kvgate-agent")
    add_node_parser(parser.add_subparsers(dest="role", required=True))
    return node_main(parser.parse_args(["node", *argv]))
