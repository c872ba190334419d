"""Shared fixtures: the sidecar in-process or as a real process, the llm-d inference simulator and
llama.cpp's llama-server as real processes, the local control plane. Clocks, waiting, ports and
Prometheus reading are in :mod:`kvgate_bench.kit.toolkit`."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from kvgate_agent.contract.policy import parse_policy
from kvgate_agent.sidecar.app import Sidecar, SidecarSettings
from kvgate_agent.sidecar.server import SidecarServer
from kvgate_bench.kit.llamaserver import llama_args, wait_loaded
from kvgate_bench.kit.processes import Proc, start_sidecar
from kvgate_bench.kit.processes import start as start_process
from kvgate_bench.kit.redisserver import RedisServer, find_redis_server
from kvgate_bench.kit.toolkit import (
    find_k8s_bin,
    free_port,
    parse_samples,
    series,
)
from kvgate_bench.sim.config import SimConfig
from kvgate_bench.sim.server import start_sim
from tests.upstream import Upstream, serve_handler

REPO = Path(__file__).resolve().parent.parent


def policy_doc(spec: dict[str, Any], name: str = "test") -> dict[str, Any]:
    """A RateLimitPolicy manifest around ``spec``."""
    return {
        "apiVersion": "kvgate.io/v1alpha1",
        "kind": "RateLimitPolicy",
        "metadata": {"name": name},
        "spec": spec,
    }


SidecarFactory = Callable[..., Awaitable[tuple[str, Sidecar]]]


#: The admin port's base URL of each sidecar served by :func:`serve_sidecar` with one, by its
#: clients' base URL (:func:`gauges` reads there when there is one).
ADMIN_URLS: dict[str, str] = {}


async def serve_sidecar(sc: Sidecar, runners: list[Any]) -> str:
    """Serve ``sc`` on a free loopback port in this event loop, as the CLI serves it
    (:class:`SidecarServer`: the server leg its settings name, the header deadline, OpenAI
    answers to malformed HTTP), and its admin port too when ``sc.settings.admin_listen`` is
    given (port 0: a free one; its URL in :data:`ADMIN_URLS`); the server is appended to
    ``runners`` (closed with ``cleanup()``); returns its base URL."""
    server = SidecarServer(sc)
    await server.start(("127.0.0.1", 0), sc.settings.admin_listen)
    runners.append(server)
    url = f"http://127.0.0.1:{server.port}"
    # A port is reused once its earlier sidecar closed: an entry left by that one would send
    # gauges() to its closed admin port (connection refused, seen on a busy machine).
    ADMIN_URLS.pop(url, None)
    if server.admin_port is not None:
        ADMIN_URLS[url] = f"http://127.0.0.1:{server.admin_port}"
    return url


#: The admin port, on a free loopback port: ``sidecar_factory(..., **ADMIN)``.
ADMIN: dict[str, Any] = {"admin_listen": ("127.0.0.1", 0)}


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    """An aiohttp client session for the test."""
    async with aiohttp.ClientSession() as s:
        yield s


async def gauges(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The sidecar's own metrics as {series with labels: value} (:func:`series`): its admin
    port's ``/metrics`` when it has one (:data:`ADMIN_URLS`), else ``/kvgate/metrics`` on
    ``url``."""
    admin = ADMIN_URLS.get(url)
    async with session.get(url + "/kvgate/metrics" if admin is None else admin + "/metrics") as r:
        return series(parse_samples(await r.text()))


async def raw_exchange(url: str, request: bytes) -> tuple[bytes, bytes]:
    """Send ``request`` exactly as given (no client normalisation) on a new connection;
    the response's (head, body), read until the sidecar closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    writer.write(request)
    await writer.drain()
    got = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), 10):
            got += chunk
    except ConnectionResetError:
        pass
    writer.close()
    head, _, body = got.partition(b"\r\n\r\n")
    return head, body


@pytest.fixture
async def sidecar_factory() -> AsyncIterator[SidecarFactory]:
    """Start sidecars in this event loop: ``url, sidecar = await make(upstream, spec, **settings)``.
    ``sidecar.admission.stats()`` is the admission state, for assertions on gauges."""
    runners: list[Any] = []

    async def make(upstream: str, spec: dict[str, Any], **settings: Any) -> tuple[str, Sidecar]:
        sc = Sidecar(
            SidecarSettings(upstream=upstream, policy=parse_policy(policy_doc(spec)), **settings)
        )
        return await serve_sidecar(sc, runners), sc

    yield make
    for r in runners:
        await r.cleanup()


@pytest.fixture
def sidecar_process(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """Start the real ``kvgate-agent sidecar`` CLI as a child process:
    ``proc = start(upstream, spec, *extra_args)``; stopped (SIGTERM) at teardown."""
    procs: list[Proc] = []

    def start(upstream: str, spec: dict[str, Any], *extra: str) -> Proc:
        policy = tmp_path / f"policy-{len(procs)}.yaml"
        policy.write_text(yaml.safe_dump(policy_doc(spec)))
        port = free_port()
        p = start_sidecar(
            tmp_path / f"sidecar-{port}.log",
            *extra,
            upstream=upstream,
            policy=policy,
            port=port,
            status=None,
            timeout=15.0,
        )
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


def llmd_sim_binary() -> str | None:
    """Path of the llm-d inference simulator built by scripts/build-deps, if any."""
    path = os.environ.get("KVGATE_LLMD_SIM")
    if path and os.access(path, os.X_OK):
        return path
    cache = Path(os.environ.get("KVGATE_CACHE", Path.home() / ".cache" / "kvgate")) / "bin"
    found = sorted(cache.glob("llm-d-inference-sim-*"))
    return str(found[-1]) if found else None


@pytest.fixture
def llmd_sim(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """Start the real llm-d inference simulator: ``proc = start("--max-num-seqs", "4", ...)``.
    Model name ``test-model`` with the dummy tokenizer (never contacts a model hub). The test
    command builds it (scripts/build-deps); run without it, these tests fail loudly, never skip
    silently, unless KVGATE_ALLOW_SKIP_LLMD=1."""
    binary = llmd_sim_binary()
    if binary is None:
        if os.environ.get("KVGATE_ALLOW_SKIP_LLMD") == "1":
            pytest.skip("llm-d-inference-sim not built (run scripts/build-deps)")
        pytest.fail("llm-d-inference-sim not built: run scripts/build-deps or scripts/test")
    procs: list[Proc] = []

    def start(*extra: str) -> Proc:
        port = free_port()
        p = start_process(
            [binary, "--model", "test-model", "--port", str(port), "--force-dummy-tokenizer",
             *extra],
            tmp_path / f"llmd-{port}.log",
            url=f"http://127.0.0.1:{port}",
            ready="/health",
            timeout=15.0,
        )  # fmt: skip
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


def llama_paths() -> tuple[str, str] | None:
    """(llama-server binary, GGUF model) built and fetched by scripts/build-llama: from
    $KVGATE_LLAMA_SERVER and $KVGATE_LLAMA_MODEL, else the cache; None when either is missing.

    Raises (through pytest.fail): a preset path that is not usable."""
    cache = Path(os.environ.get("KVGATE_CACHE", Path.home() / ".cache" / "kvgate"))
    found: list[str | None] = []
    for var, pattern, ok in (
        ("KVGATE_LLAMA_SERVER", "bin/llama-server-*-*-*", lambda p: os.access(p, os.X_OK)),
        ("KVGATE_LLAMA_MODEL", "models/gemma3-270m*.gguf", os.path.isfile),
    ):
        preset = os.environ.get(var)
        if preset:
            if not ok(preset):
                pytest.fail(f"{var}={preset} is not usable (run scripts/build-llama)")
            found.append(preset)
        else:
            hits = sorted(cache.glob(pattern))
            found.append(str(hits[-1]) if hits else None)
    server, model = found
    return None if server is None or model is None else (server, model)


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Proc]]:
    """Start the real llama.cpp ``llama-server`` (Gemma 3 270M Q4_K_M on CPU, 2 threads) on a
    loopback port: ``proc = start(parallel=2, ctx=1024, *extra_flags)``, with ``--metrics``,
    ``--slots``, ``--no-kv-unified`` (each of the ``parallel`` slots holds ``ctx / parallel``
    tokens) and the alias :data:`LLAMA_MODEL`; ready once ``/health`` answers 200 (the model
    loaded). One module's servers are stopped at its end. The test command builds it
    (scripts/build-llama, run by scripts/test); without it these tests skip with that reason,
    except under CI (``$CI`` set), where they fail."""
    paths = llama_paths()
    if paths is None:
        why = "llama-server or its model not built: run scripts/build-llama (or scripts/test)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    binary, model = paths
    tmp = tmp_path_factory.mktemp("llama")
    procs: list[Proc] = []

    def start(parallel: int = 2, ctx: int = 1024, *extra: str) -> Proc:
        port = free_port()
        args = llama_args(binary, model, port, parallel, ctx, *extra)
        url = f"http://127.0.0.1:{port}"
        p = start_process(args, tmp / f"llama-{port}.log", url=url, ready="/health", timeout=15.0)
        procs.append(p)
        # Loading the 270M model takes about a second on a quiet machine; 120 s is for a busy one.
        wait_loaded(p.popen, p.url, p.log, 120.0)
        return p

    yield start
    for p in procs:
        p.stop()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    """A recording model-server stand-in on a free loopback port."""
    up = Upstream()
    async with serve_handler(up.handle, handler_cancellation=True, shutdown_timeout=0.5) as up.url:
        yield up


# ----------------------------------------------------------------------------------------------
# The local Kubernetes control plane (kube-apiserver + etcd from scripts/build-k8s).


def k8s_bin_dir() -> Path | None:
    """The directory with kube-apiserver and etcd (:func:`find_k8s_bin`); an unusable
    $KVGATE_K8S_BIN or $KUBEBUILDER_ASSETS fails the test."""
    try:
        return find_k8s_bin()
    except ValueError as e:
        pytest.fail(str(e))


#: Seconds a test may run (pytest-timeout) by folder; ``@pytest.mark.timeout(n)`` overrides.
#: Unit tests use fake clocks and no processes; repository checks run helm and hadolint;
#: integration tests start processes and a control plane.
TIMEOUT_S = {"unit": 10.0, "repo": 60.0, "integration": 180.0}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that uses the ``kube`` fixture is marked ``k8s`` (``-m "not k8s"`` skips
    them); every test without its own ``timeout`` mark gets its folder's :data:`TIMEOUT_S`."""
    tests_dir = Path(__file__).resolve().parent
    for item in items:
        if "kube" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.k8s)
        if item.get_closest_marker("timeout") is None:
            folder = item.path.resolve().relative_to(tests_dir).parts[0]
            if folder in TIMEOUT_S:
                item.add_marker(pytest.mark.timeout(TIMEOUT_S[folder]))


@pytest.fixture(scope="module")
def crds(kube: Any) -> Any:
    """The control plane with the repo's CRDs applied (server-side) and established."""
    kube.apply_crds(REPO / "crds")
    return kube


@pytest.fixture(scope="session")
def kube() -> Iterator[Any]:
    """A real kube-apiserver + etcd for the whole session (a
    ``kvgate_bench.kit.controlplane.ControlPlane``; a few
    seconds to start). Shared by all tests: use unique names, do not rely on deletion finishing.
    Without the binaries, tests using it fail loudly (build them with scripts/build-k8s, which
    scripts/test runs), unless KVGATE_ALLOW_SKIP_K8S=1, then they skip."""
    from kvgate_bench.kit.controlplane import ControlPlane

    bin_dir = k8s_bin_dir()
    if bin_dir is None:
        if os.environ.get("KVGATE_ALLOW_SKIP_K8S") == "1":
            pytest.skip("kube-apiserver/etcd not built (run scripts/build-k8s)")
        pytest.fail(
            "kube-apiserver/etcd not built: run scripts/build-k8s (or scripts/test), or point "
            "KVGATE_K8S_BIN at a directory holding them; KVGATE_ALLOW_SKIP_K8S=1 skips instead"
        )
    with ControlPlane(bin_dir) as cp:
        yield cp


@pytest.fixture
async def sim() -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """Start kvgate-sim servers in this process on free loopback ports (1 ms steps, no prefill
    time unless overridden: ``await sim(kv_capacity_tokens=...)``); returns their base URLs and
    stops them all at the end."""
    runners: list[web.AppRunner] = []

    async def start(**overrides: Any) -> str:
        cfg = SimConfig(**{"decode_ms": 1.0, "prefill_us_per_token": 0.0, **overrides})
        runner, port = await start_sim(cfg)
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start real ``redis-server`` processes on loopback ports in the test's temp dir:
    ``server = start(password=None, tls=None)`` (a
    :class:`~kvgate_bench.kit.redisserver.RedisServer`, which can be killed and restarted); stopped
    at teardown. Without the binary (scripts/
    install-redis, which scripts/test runs, or KVGATE_REDIS_SERVER), tests using it fail loudly,
    unless KVGATE_ALLOW_SKIP_REDIS=1, then they skip."""
    binary = find_redis_server()
    if binary is None:
        if os.environ.get("KVGATE_ALLOW_SKIP_REDIS") == "1":
            pytest.skip("redis-server not installed (run scripts/install-redis)")
        pytest.fail(
            "redis-server not found: run scripts/install-redis (or scripts/test), or set "
            "KVGATE_REDIS_SERVER; KVGATE_ALLOW_SKIP_REDIS=1 skips instead"
        )
    servers: list[RedisServer] = []

    def start(**kw: Any) -> RedisServer:
        server = RedisServer(binary, tmp_path / f"redis-{len(servers)}", **kw)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()
