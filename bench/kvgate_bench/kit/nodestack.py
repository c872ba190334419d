"""One GPU node's worth of kvgate as local processes, on the local control plane.

:class:`NodeStack` starts, against a running :class:`~kvgate_bench.kit.controlplane.ControlPlane`:
the operator (``python -m kvgate_operator``), a node agent (``kvgate-agent node`` with the fake
GPU backend driven by a scenario file), ``kvgate-sim`` model servers, and one sidecar per model
pod (``kvgate-agent sidecar`` in agent mode). Each model pod is a real Pod object bound to the
fake node, made Ready through the status subresource (there is no kubelet), and each sidecar
proves who it is with a real pod-bound service-account token from the TokenRequest API
(audience ``kvgate-agent``), as the projected volume would give it.

Used by the integration tests (``tests/integration/test_node_agent.py``) and the propagation
benchmark (``kvgate_bench.bench_node``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvgate_agent.gpu.fake_scenario import write_scenario
from kvgate_bench.kit.controlplane import ControlPlane
from kvgate_bench.kit.processes import agent_argv, sidecar_argv, sim_argv, spawn, start, stop
from kvgate_bench.kit.toolkit import free_port, parse_samples, sample_value

REPO = Path(__file__).resolve().parents[3]
GiB = 1 << 30


def stop_process(
    proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM, timeout: float = 15
) -> None:
    """Send ``sig`` and reap; SIGKILL if it lingers past ``timeout`` seconds
    (:func:`kvgate_bench.kit.processes.stop`)."""
    stop(proc, timeout, sig)


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    """(status, body) of a GET; status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode(errors="replace")
    except OSError:
        return 0, ""


def chat(
    url: str, max_tokens: int = 16, tenant: str = "t1", timeout: float = 10
) -> tuple[int, dict[str, str], bytes]:
    """POST a small chat completion to a sidecar (model ``sim``, tenant header
    ``x-kvgate-tenant``): (status, headers lower-cased, body); status 0 when nothing answers."""
    body = json.dumps(
        {
            "model": "sim",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": max_tokens,
        }
    ).encode()
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", "x-kvgate-tenant": tenant},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return int(r.status), {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return int(e.code), {k.lower(): v for k, v in e.headers.items()}, e.read()
    except OSError:
        return 0, {}, b""


def clamped_to(url: str) -> int | None:
    """The max_tokens a sidecar clamps a 64-token request to (its ``x-kvgate-degraded``
    header); None when not clamped or not answered."""
    status, headers, _ = chat(url, max_tokens=64)
    m = re.fullmatch(r"max_tokens=(\d+)", headers.get("x-kvgate-degraded", ""))
    return int(m.group(1)) if status == 200 and m else None


def clamps_to(url: str, cap: int) -> Callable[[], bool]:
    """A condition for :func:`~kvgate_bench.kit.toolkit.wait_until`: the sidecar at ``url`` clamps
    to ``cap`` tokens (:func:`clamped_to`)."""
    return lambda: clamped_to(url) == cap


def thresholds_are(url: str, mode: str) -> Callable[[], bool]:
    """A condition: the sidecar at ``url`` answers with ``x-kvgate-thresholds: mode``."""
    return lambda: chat(url)[1].get("x-kvgate-thresholds") == mode


def metric_value(url: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` whose labels include ``labels`` in the Prometheus
    exposition at ``url``; None when absent or nothing answers."""
    _, text = http_get(url)
    return sample_value(parse_samples(text), name, **labels)


def fake_gpus(
    n: int = 1, free_bytes: int = 40 * GiB, total_bytes: int = 80 * GiB
) -> dict[str, Any]:
    """A fake GPU scenario (see ``kvgate_agent.gpu.fake_scenario``) with ``n`` GPUs."""
    return {
        "init_error": None,
        "gpus": [
            {
                "uuid": f"GPU-{i:08d}-0000-0000-0000-000000000000",
                "index": i,
                "name": "Fake H100 80GB",
                "total_bytes": total_bytes,
                "used_bytes": total_bytes - free_bytes,
                "utilization": 50,
                "processes": [],
            }
            for i in range(n)
        ],
    }


@dataclass
class ModelPod:
    """One model pod: its Pod object, its simulator and its sidecar process."""

    namespace: str
    name: str
    uid: str
    upstream: str
    port: int
    token_file: Path
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    @property
    def url(self) -> str:
        """The sidecar's base URL."""
        return f"http://127.0.0.1:{self.port}"


@dataclass
class NodeStack:
    """A node (``node_name``) with an agent, model pods and their sidecars; and the operator.

    Args:
        cp: a started control plane (CRDs are applied here).
        work: a directory for logs, token files and the GPU scenario.
        namespace: where model pods and policies live (created).
        node_name: the fake node (created as a Node object).
        agent_args: extra ``kvgate-agent node`` flags.
        sync_interval: how often sidecars sync, seconds (the agent tells them; 1 in production,
            shorter in tests).
        sidecar_env: extra environment for every sidecar.
        kubeconfig: the kubeconfig the operator and the agent use (default: the control
            plane's admin one), e.g. one whose server is a fault-injecting proxy.
        operator_env: extra environment for the operator (over the test defaults).
    """

    cp: ControlPlane
    work: Path
    namespace: str
    node_name: str = "gpu-node-1"
    agent_args: list[str] = field(default_factory=list)
    sync_interval: float = 0.25
    sidecar_env: dict[str, str] = field(default_factory=dict)
    kubeconfig: Path | None = None
    operator_env: dict[str, str] = field(default_factory=dict)
    operator: subprocess.Popen[bytes] | None = None
    agent: subprocess.Popen[bytes] | None = None
    agent_port: int = 0
    sims: list[subprocess.Popen[bytes]] = field(default_factory=list)
    pods: list[ModelPod] = field(default_factory=list)

    @property
    def scenario(self) -> Path:
        """The fake GPU scenario file the agent reads."""
        return self.work / "gpus.json"

    @property
    def agent_url(self) -> str:
        return f"http://127.0.0.1:{self.agent_port}"

    # ------------------------------------------------------------------ cluster objects

    def setup_cluster(self) -> None:
        """CRDs, the namespace, the model service account and the Node."""
        cp = self.cp
        cp.apply_crds(REPO / "crds")
        self.apply(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace}},
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": "model", "namespace": self.namespace},
            },
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node_name}},
        )

    def apply(self, *objs: dict[str, Any]) -> None:
        """``kubectl apply`` the objects."""
        self.cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))

    def create_pod(self, name: str, labels: dict[str, str]) -> str:
        """Create a Ready model pod on the node; returns its uid."""
        self.apply(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": self.namespace, "labels": labels},
                "spec": {
                    "nodeName": self.node_name,
                    "serviceAccountName": "model",
                    "containers": [{"name": "vllm", "image": "vllm/vllm-openai"}],
                },
            }
        )
        status = {
            "status": {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "conditions": [{"type": "Ready", "status": "True"}],
            }
        }
        self.cp.kubectl(
            "patch",
            "pod",
            name,
            "-n",
            self.namespace,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps(status),
        )
        got = json.loads(
            self.cp.kubectl("get", "pod", name, "-n", self.namespace, "-o", "json").stdout
        )
        return str(got["metadata"]["uid"])

    def pod_token(self, name: str, uid: str, service_account: str = "model") -> str:
        """A pod-bound token for audience ``kvgate-agent`` (what the projected volume holds)."""
        out = self.cp.kubectl(
            "create",
            "token",
            service_account,
            "-n",
            self.namespace,
            "--audience",
            "kvgate-agent",
            "--duration",
            "2h",
            "--bound-object-kind",
            "Pod",
            "--bound-object-name",
            name,
            "--bound-object-uid",
            uid,
        )
        return out.stdout.strip()

    def node_admission(self) -> dict[str, Any] | None:
        """This node's NodeAdmission object, or None."""
        res = self.cp.kubectl("get", "nodeadmission", self.node_name, "-o", "json", check=False)
        return json.loads(res.stdout) if res.returncode == 0 else None

    # ------------------------------------------------------------------ processes

    def start_operator(self) -> None:
        env = {
            **self.cp.env,
            "KVGATE_OPERATOR_LIVENESS_PORT": str(free_port()),
            "KVGATE_OPERATOR_DEBOUNCE_SECONDS": "0.05",
            "KVGATE_OPERATOR_RESYNC_SECONDS": "30",
            "KVGATE_OPERATOR_WEBHOOK_ENABLED": "false",  # no injection in these tests
            **self.operator_env,
        }
        if self.kubeconfig is not None:
            env["KUBECONFIG"] = str(self.kubeconfig)
        self.operator = spawn(
            [sys.executable, "-m", "kvgate_operator"],
            self.work / "operator.log",
            env,
            append=True,
            new_session=True,
        )

    def start_agent(self, gpus: dict[str, Any] | None = None) -> None:
        """Start (or restart) the node agent; waits for ``/healthz``."""
        if gpus is not None or not self.scenario.exists():
            write_scenario(self.scenario, gpus or fake_gpus())
        self.agent_port = self.agent_port or free_port()
        args = agent_argv(
            "--node-name",
            self.node_name,
            "--listen",
            f"127.0.0.1:{self.agent_port}",
            "--gpu-backend",
            f"fake:{self.scenario}",
            "--kubeconfig",
            str(self.kubeconfig or self.cp.kubeconfig),
            "--gpu-poll-seconds",
            "0.25",
            "--scrape-seconds",
            "0.5",
            "--status-min-interval",
            "0.5",
            "--heartbeat-seconds",
            "10",
            "--sync-interval",
            str(self.sync_interval),
            *self.agent_args,
        )
        self.agent = self._start(
            args,
            self.work / "agent.log",
            {**os.environ, "KVGATE_PROC_ROOT": str(self.work / "proc")},
            self.agent_url,
            "/healthz",
        )

    def kill_agent(self, sig: int = signal.SIGKILL) -> None:
        stop_process(self.agent, sig)

    def start_sim(self, **flags: Any) -> str:
        """Start a ``kvgate-sim``; returns its base URL once it answers."""
        port = free_port()
        args = sim_argv("--port", str(port))
        for k, v in {"model": "sim", "decode-ms": 2, "kv-capacity-tokens": 65536, **flags}.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        url = f"http://127.0.0.1:{port}"
        self.sims.append(self._start(args, self.work / f"sim-{port}.log", None, url, "/health"))
        return url

    def add_model_pod(
        self,
        name: str,
        upstream: str,
        labels: dict[str, str] | None = None,
        failure_mode: str | None = None,
        start: bool = True,
    ) -> ModelPod:
        """Create the Pod, its token file and (``start``) its sidecar in agent mode."""
        uid = self.create_pod(name, labels or {"app": "llm"})
        token_file = self.work / f"token-{name}"
        token_file.write_text(self.pod_token(name, uid))
        mp = ModelPod(self.namespace, name, uid, upstream, free_port(), token_file)
        self.pods.append(mp)
        if start:
            self.start_sidecar(mp, failure_mode)
        return mp

    def sidecar_env_for(self, mp: ModelPod, failure_mode: str | None = None) -> dict[str, str]:
        """The environment the injected sidecar gets (downward API and agent settings)."""
        env = {
            **os.environ,
            "KVGATE_UPSTREAM": mp.upstream,
            "KVGATE_LISTEN": f"127.0.0.1:{mp.port}",
            "KVGATE_AGENT_URL": self.agent_url,
            "KVGATE_TOKEN_FILE": str(mp.token_file),
            "KVGATE_POD_NAMESPACE": mp.namespace,
            "KVGATE_POD_NAME": mp.name,
            "KVGATE_POD_UID": mp.uid,
            "KVGATE_POD_IP": "127.0.0.1",
            **self.sidecar_env,
        }
        if failure_mode is not None:
            env["KVGATE_FAILURE_MODE"] = failure_mode
        return env

    def start_sidecar(self, mp: ModelPod, failure_mode: str | None = None) -> None:
        mp.log = self.work / f"sidecar-{mp.name}.log"
        # The port is the environment's KVGATE_LISTEN (as the webhook injects it).
        mp.proc = self._start(
            sidecar_argv(), mp.log, self.sidecar_env_for(mp, failure_mode), mp.url, "/healthz"
        )

    def _start(
        self, args: list[str], log: Path, env: dict[str, str] | None, url: str, ready: str
    ) -> subprocess.Popen[bytes]:
        """:func:`kvgate_bench.kit.processes.start` (log appended, a session of its own), ready once
        ``url + ready`` answers 200 within 30 s; else RuntimeError with every log's tail."""
        try:
            return start(
                args, log, env=env, url=url, ready=ready, status=200, append=True, new_session=True
            ).popen
        except RuntimeError as e:
            logs = sorted(self.work.glob("*.log"))
            tail = "\n".join(
                f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                for p in logs
            )
            raise RuntimeError(f"{str(e).split(chr(10), 1)[0]}\n{tail}") from None

    def stop(self) -> None:
        """Stop every process (sidecars first, so they can drain)."""
        for mp in self.pods:
            stop_process(mp.proc)
        stop_process(self.agent)
        stop_process(self.operator)
        for s in self.sims:
            stop_process(s)

    def __enter__(self) -> NodeStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
