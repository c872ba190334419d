"""``kvgate-agent``: one entry point, one role per subcommand (``sidecar`` now; ``node`` later).

Every flag also reads an environment variable (``KVGATE_<FLAG>``), so the injected sidecar can be
configured through its pod's environment.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

from aiohttp import web

from kvgate_agent.contract.policy import PolicyError, load_policy
from kvgate_agent.sidecar.proxy import Sidecar, SidecarSettings

log = logging.getLogger("kvgate")


def _hostport(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return (host.strip("[]") or "0.0.0.0"), int(port)


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get("KVGATE_" + name, default)


def build_parser() -> argparse.ArgumentParser:
    """The ``kvgate-agent`` argument parser."""
    p = argparse.ArgumentParser(prog="kvgate-agent", description=__doc__)
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("sidecar", help="admission-controlling reverse proxy for a model server")
    s.add_argument(
        "--upstream",
        default=_env("UPSTREAM"),
        required=_env("UPSTREAM") is None,
        help="model server base URL, e.g. http://127.0.0.1:8000 [KVGATE_UPSTREAM]",
    )
    s.add_argument(
        "--policy",
        default=_env("POLICY"),
        required=_env("POLICY") is None,
        help="RateLimitPolicy manifest file (YAML or JSON) [KVGATE_POLICY]",
    )
    s.add_argument(
        "--listen",
        type=_hostport,
        default=_env("LISTEN", "127.0.0.1:8080"),
        help="HOST:PORT to serve clients on [KVGATE_LISTEN] (default %(default)s)",
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
        help="HF tokenizer.json for exact prompt counts [KVGATE_TOKENIZER]",
    )
    s.add_argument(
        "--max-body-bytes",
        type=int,
        default=int(_env("MAX_BODY_BYTES", str(8 * 1024 * 1024)) or 0),
        help="request body limit, bytes (413 above) [KVGATE_MAX_BODY_BYTES]",
    )
    s.add_argument(
        "--drain-seconds",
        type=float,
        default=float(_env("DRAIN_SECONDS", "30") or 30),
        help="on SIGTERM, how long in-flight requests may finish [KVGATE_DRAIN_SECONDS]",
    )
    s.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"))
    return p


async def run_sidecar(
    settings: SidecarSettings, listen: tuple[str, int], admin: tuple[str, int] | None
) -> int:
    """Serve until SIGTERM/SIGINT, then stop accepting, drain in-flight work up to
    ``settings.drain_seconds`` and return 0."""
    sidecar = Sidecar(settings)
    runner = web.AppRunner(sidecar.build_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, listen[0], listen[1], backlog=1024)
    await site.start()
    admin_runner: web.AppRunner | None = None
    if admin is not None:
        admin_runner = web.AppRunner(sidecar.build_admin_app(), access_log=None)
        await admin_runner.setup()
        await web.TCPSite(admin_runner, admin[0], admin[1]).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(
        f"kvgate sidecar listening on http://{listen[0]}:{listen[1]} -> {settings.upstream}",
        flush=True,
    )
    await stop.wait()
    log.info("shutting down: draining up to %.0fs", settings.drain_seconds)
    sidecar.draining = True
    await site.stop()  # stop accepting new connections
    if not await sidecar.admission.wait_idle(settings.drain_seconds):
        log.warning(
            "drain deadline passed with %d requests in flight", sidecar.controller.in_flight
        )
    await runner.cleanup()
    if admin_runner is not None:
        await admin_runner.cleanup()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvgate-agent``."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        print(f"kvgate-agent: {exc}", file=sys.stderr)
        return 2
    settings = SidecarSettings(
        upstream=args.upstream,
        policy=policy,
        tokenizer_file=args.tokenizer,
        max_body_bytes=args.max_body_bytes,
        drain_seconds=args.drain_seconds,
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


if __name__ == "__main__":
    sys.exit(main())
