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
from typing import TYPE_CHECKING, Any

from kvgate_agent.args import add_flags, add_log_level, configure_logging, from_args
from kvgate_agent.node.settings import NodeSettings

if TYPE_CHECKING:
    from kvgate_agent.gpu import GpuMonitor
    from kvgate_agent.node.kube import NodeAdmissionWatch
    from kvgate_agent.node.service import NodeAgent

log = logging.getLogger("kvgate.node")


def add_node_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``node`` subcommand to ``kvgate-agent``'s parser: one flag per flag field of
    :class:`~kvgate_agent.node.settings.NodeSettings` (:func:`~kvgate_agent.args.add_flags`),
    and ``--log-level``."""
    n = sub.add_parser(
        "node",
        help="node agent: NVML, KV usage, thresholds to sidecars, NodeAdmission status",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_flags(n, NodeSettings)
    add_log_level(n)


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
    from kvgate_agent.node.service import NodeAgent

    settings = from_args(NodeSettings, args)
    api_client = load_api_client(settings.kubeconfig)
    monitor = GpuMonitor(
        backend_from_spec(settings.gpu_backend), call_timeout=settings.gpu_call_timeout
    )
    auth = Authenticator(kube_token_reviewer(api_client), ok_ttl=settings.token_cache_seconds)
    contact = ApiContact()
    writer = StatusWriter(api_client, settings.node_name, contact)
    agent = NodeAgent(settings, monitor, auth, writer)
    watch = NodeAdmissionWatch(
        api_client,
        settings.node_name,
        asyncio.get_running_loop(),
        agent.on_spec,
        timeout_seconds=max(1, round(settings.watch_server_timeout)),
        read_timeout=settings.watch_read_timeout,
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
    agent.syncs.release_all()  # held long polls answer now: the server need not wait them out
    try:
        await server_task
    except (Exception, SystemExit) as exc:  # uvicorn exits (sys.exit) when it cannot bind
        log.error("the sync API stopped: %r", exc)
    watch.stop()
    await agent.stop()
    if server.started:
        await agent.status.write_final()  # Ready=False/AgentStopped: nobody reads stale figures
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
