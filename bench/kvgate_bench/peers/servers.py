"""The servers of ``kvgate_bench.peers``, configured and pinned (what they need is installed
by :mod:`kvgate_bench.peers.tools`).

Every server runs pinned to the servers' CPU (``taskset -c``; ``taskset`` execs the program,
so the child's pid is the server's own):

* ``direct``: nginx answering every path with ``return 200`` and a small OpenAI chat response
  (``/metrics`` is 404, so the sidecar's engine-usage poll finds no engine metrics);
* ``nginx``: nginx proxying to ``direct`` over keep-alive upstream connections (HTTP/1.1,
  ``keepalive 512``), response buffering off (``proxy_buffering off``: each chunk is relayed as
  it comes); the request body is read whole first (nginx's default
  ``proxy_request_buffering on``): unbuffered, nginx resets the client's connection when the
  upstream answers before the whole body was sent, as ``return 200`` does (wrk counts read
  errors on 200 KB bodies). More server blocks proxy to the llm-d simulators for the streaming
  comparison;
* ``litellm``: ``litellm --config`` (one worker, no database, ``master_key`` unset) with one
  model entry pointing at ``direct``;
* ``kvgate``: the sidecar (``python -m kvgate_agent sidecar``, the checkout's code) enforcing
  :data:`POLICY_YAML`; ``kvgate pass-through`` is the same process on an allowlisted path
  (``--passthrough-path /bench/chat``), forwarded without admission or body parsing.

nginx runs one worker process (``worker_processes 1``): one core, like the others.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvgate_agent.contract.api import API_VERSION
from kvgate_bench.kit import processes
from kvgate_bench.kit.toolkit import cpu_seconds, free_port
from kvgate_bench.peers.load import MODEL, TENANT
from kvgate_bench.peers.tools import clean_env

PASSTHROUGH_PATH = "/bench/chat"
CHAT_PATH = "/v1/chat/completions"

#: The upstream's answer (a complete OpenAI chat completion with usage, as vLLM sends it).
RESPONSE_JSON = (
    '{"id":"chatcmpl-peers","object":"chat.completion","created":1700000000,'
    f'"model":"{MODEL}","choices":[{{"index":0,"message":{{"role":"assistant",'
    '"content":"Hello from the upstream."},"finish_reason":"stop"}],'
    '"usage":{"prompt_tokens":42,"completion_tokens":6,"total_tokens":48}}'
)

#: The sidecar's policy: what a Llama-3.1-8B pod would run (tenants by header, a per-tenant
#: and a pod-wide rate limit, a concurrency cap, KV reservation of prompt + predicted output,
#: a queue), with budgets large enough that every request of the load is admitted: the cost
#: measured is that of the decision and the accounting, not of refusals. maxModelLen is the
#: model's real 128k context, so the 200 KB bodies (~50k prompt tokens) fit; the KV pool is
#: sized so that 256 of them in flight fit too.
POLICY_YAML = (
    f"apiVersion: {API_VERSION}\n"
    + """\
kind: RateLimitPolicy
metadata:
  name: bench-peers
spec:
  model: {numLayers: 32, numKVHeads: 8, headDim: 128, kvCacheDtype: bf16, blockSize: 16,
          maxModelLen: 131072}
  capacity: {kvCacheTokens: 33554432, reservation: Predicted, reservationQuantile: 0.9}
  concurrency: {maxRequests: 1024}
  tenants: {header: x-kvgate-tenant, defaultMaxTokens: 512, maxTokensCap: 4096}
  rateLimits:
    - {name: per-tenant, per: Tenant, requestsPerMinute: 100000000,
       tokensPerMinute: 100000000000, burstTokens: 1000000000}
    - {name: pod, per: Pod, requestsPerMinute: 100000000, tokensPerMinute: 100000000000,
       burstTokens: 1000000000}
  cost: {perRequest: 16, promptTokenWeight: 1, outputTokenWeight: 1}
  queue: {maxLength: 256, maxWaitSeconds: 10, order: ShortestFirst}
  overload: {actions: [Degrade, Queue, Reject], degrade: {minMaxTokens: 128}}
  failureMode: FailOpen
"""
)

_NGINX_HEAD = """\
worker_processes 1;
daemon off;
pid {dir}/{name}.pid;
error_log {dir}/{name}-error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {dir}/{name}-tmp/body;
  proxy_temp_path {dir}/{name}-tmp/proxy;
  fastcgi_temp_path {dir}/{name}-tmp/fastcgi;
  uwsgi_temp_path {dir}/{name}-tmp/uwsgi;
  scgi_temp_path {dir}/{name}-tmp/scgi;
  keepalive_requests 10000000;
  keepalive_timeout 300s;
  client_max_body_size 16m;
  client_body_buffer_size 1m;
"""

_PROXY_LOCATION = """\
    location / {{
      proxy_pass http://{upstream};
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
"""


def nginx_direct_conf(workdir: Path, port: int) -> str:
    """nginx answering ``return 200`` with :data:`RESPONSE_JSON` on every path but /metrics."""
    return (
        _NGINX_HEAD.format(dir=workdir, name="direct")
        + f"""\
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    default_type application/json;
    location = /metrics {{ return 404; }}
    location / {{ return 200 '{RESPONSE_JSON}'; }}
  }}
}}
"""
    )


def nginx_proxy_conf(workdir: Path, routes: dict[int, int]) -> str:
    """nginx proxying each ``listen port -> upstream port`` of ``routes`` (keep-alive upstream,
    buffering off)."""
    text = _NGINX_HEAD.format(dir=workdir, name="proxy")
    for i, (listen, upstream) in enumerate(routes.items()):
        name = f"up{i}"
        text += f"  upstream {name} {{ server 127.0.0.1:{upstream}; keepalive 512; }}\n"
        text += f"  server {{\n    listen 127.0.0.1:{listen} backlog=4096;\n"
        text += _PROXY_LOCATION.format(upstream=name) + "  }\n"
    return text + "}\n"


def litellm_config(upstream_port: int) -> str:
    """LiteLLM's proxy configuration: one model, the OpenAI provider at ``direct``; no
    ``master_key`` (no auth), no ``database_url`` (no database)."""
    return f"""\
model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: http://127.0.0.1:{upstream_port}/v1
      api_key: unused
litellm_settings:
  telemetry: false
  drop_params: true
"""


@dataclass
class Server:
    """A pinned child process and its port (``pid`` is the server's own, see the module)."""

    name: str
    port: int
    proc: subprocess.Popen[bytes]
    children: list[int] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        """The process and its children (nginx's worker), for CPU accounting."""
        return [self.proc.pid, *_children(self.proc.pid)]

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the process and its children now."""
        return sum(cpu_seconds(p) for p in self.pids)


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
        return [int(x) for x in text.split()]
    return []


class Fleet:
    """Starts servers pinned to ``cpu``; :meth:`close` stops them all (SIGTERM, then SIGKILL)."""

    def __init__(self, workdir: Path, cpu: int) -> None:
        self.workdir, self.cpu = workdir, cpu
        self.servers: list[Server] = []
        #: Where the sidecars import kvgate_agent from first (a compiled overlay), or None:
        #: this checkout's sources.
        self.agent_path: Path | None = None

    def start(
        self,
        name: str,
        cmd: list[str],
        port: int,
        *,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> Server:
        """Start ``cmd`` under ``taskset`` and wait until ``port`` accepts connections."""
        env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
        log = self.workdir / f"{name}.log"
        taskset = ["taskset", "-c", str(self.cpu), *cmd]
        proc = processes.start(taskset, log, env=env, port=port, timeout=timeout, what=name)
        server = Server(name, port, proc.popen)
        self.servers.append(server)
        return server

    def stop(self, server: Server) -> None:
        """Stop one server (SIGTERM, SIGKILL after 10 s)."""
        processes.stop(server.proc)
        if server in self.servers:
            self.servers.remove(server)

    def close(self) -> None:
        """Stop every server still running."""
        for server in list(self.servers):
            self.stop(server)

    def nginx(self, binary: str, name: str, conf: str, port: int) -> Server:
        """Write ``conf`` and start nginx on it."""
        tmp = self.workdir / f"{name}-tmp"
        tmp.mkdir(exist_ok=True)
        os.chmod(tmp, 0o777)  # the worker runs as nobody when the master runs as root
        path = self.workdir / f"{name}.conf"
        path.write_text(conf)
        return self.start(name, [binary, "-c", str(path), "-p", str(self.workdir)], port)

    def sidecar(self, name: str, upstream_port: int, *flags: str) -> Server:
        """The kvgate sidecar of this checkout in front of ``upstream_port`` (``flags`` added
        to its command line)."""
        policy = self.workdir / "policy.yaml"
        policy.write_text(POLICY_YAML)
        port = free_port()
        cmd = processes.sidecar_argv(
            "--log-level", "WARNING", "--passthrough-path", PASSTHROUGH_PATH, *flags,
            upstream=f"http://127.0.0.1:{upstream_port}", policy=policy, port=port,
        )  # fmt: skip
        env = None
        if self.agent_path is not None:
            path = os.environ.get("PYTHONPATH")
            env = {
                **os.environ,
                "PYTHONPATH": f"{self.agent_path}:{path}" if path else str(self.agent_path),
            }
        return self.start(name, cmd, port, env=env)

    def litellm(self, binary: str, upstream_port: int) -> Server:
        """LiteLLM's proxy, one worker, in front of ``upstream_port``; waits for an answer."""
        cfg = self.workdir / "litellm.yaml"
        cfg.write_text(litellm_config(upstream_port))
        port = free_port()
        env = clean_env()
        env.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at start
        env.setdefault("LITELLM_LOG", "ERROR")
        # LiteLLM >= 1.108 refuses to start without a master key unless told this is local
        # development; the benchmark measures the proxy without auth, on loopback only.
        env.setdefault("LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY", "true")
        cmd = [binary, "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port),
               "--num_workers", "1"]  # fmt: skip
        server = self.start("litellm", cmd, port, timeout=180.0, env=env)
        wait_answer(f"http://127.0.0.1:{port}{CHAT_PATH}", server.proc, timeout=60.0)
        return server

    def llmd_sim(self, binary: str, itl_ms: float, *, port: int) -> Server:
        """The llm-d simulator on ``port``, streaming one token per ``itl_ms`` milliseconds."""
        cmd = [binary, "--model", MODEL, "--port", str(port), "--force-dummy-tokenizer",
               "--max-num-seqs", "1024", "--max-model-len", "131072",
               "--inter-token-latency", f"{itl_ms:g}ms"]  # fmt: skip
        return self.start(f"llmd-sim-itl{itl_ms:g}", cmd, port)


def wait_answer(url: str, proc: subprocess.Popen[bytes], *, timeout: float) -> None:
    """POST a small chat request to ``url`` until it answers 200.

    Raises:
        RuntimeError: ``proc`` exited, or no 200 within ``timeout`` seconds (the last error).
    """
    body = (
        f'{{"model":"{MODEL}","max_tokens":4,"messages":[{{"role":"user","content":"hi"}}]}}'
    ).encode()
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        req = urllib.request.Request(
            url, body, {"Content-Type": "application/json", "x-kvgate-tenant": TENANT}
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:
            last = f"{e.code} {e.read()[:300]!r}"
        except OSError as e:
            last = str(e)
        time.sleep(0.5)
    raise RuntimeError(f"{url} gave no 200 within {timeout:g} s: {last}")


@contextlib.contextmanager
def fleet(workdir: Path, cpu: int) -> Iterator[Fleet]:
    """A :class:`Fleet` whose servers are all stopped on exit."""
    f = Fleet(workdir, cpu)
    try:
        yield f
    finally:
        f.close()


def version(cmd: list[str]) -> str:
    """The first line ``cmd`` prints (its version), or ``unknown``."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (done.stdout + done.stderr).strip().splitlines()[0] if done.stdout + done.stderr else "?"


def commit(repo: Path) -> str:
    """``repo``'s commit, in backticks, and whether it has uncommitted changes."""
    rev = version(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return f"`{rev}`" + (" plus uncommitted changes" if dirty else "")
