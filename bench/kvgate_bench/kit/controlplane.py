"""A real, local Kubernetes API for tests: etcd + kube-apiserver as child processes, the way
controller-runtime's envtest runs them (no Docker, no kubelet, no scheduler, no controller-manager).

The binaries come from ``scripts/build-k8s`` (kube-apiserver, etcd, helm). Everything else is made
here, in a fresh temp dir:

- certificates (:mod:`kvgate_bench.kit.kubefiles`): a CA; a serving certificate for
  127.0.0.1/localhost; an admin client certificate (CN=kvgate-admin, O=system:masters); an RSA
  service-account key pair;
- etcd on free loopback ports (``--unsafe-no-fsync``);
- kube-apiserver on a free loopback port with RBAC authorization, the PodSecurity,
  MutatingAdmissionWebhook and ValidatingAdmissionPolicy admission plugins (the last two are on
  by default; named so a change of defaults cannot turn them off), and the ServiceAccount
  admission plugin disabled
  (nothing would create the default service accounts);
- a kubeconfig for the admin user.

This module runs the two processes; what a test does with them once they answer (kubectl, helm,
the Python client, CRDs) is :class:`~kvgate_bench.kit.kubeaccess.KubeAccess`'s, which
:class:`ControlPlane` is.

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

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

from kvgate_bench.kit.kubeaccess import KubeAccess
from kvgate_bench.kit.kubefiles import ADMIN_USER, ClusterCerts, write_kubeconfig
from kvgate_bench.kit.processes import stop
from kvgate_bench.kit.toolkit import free_port

#: The Services' ClusterIPs (the ``kubernetes`` Service's, 10.0.0.1, is in the serving
#: certificate: :data:`~kvgate_bench.kit.kubefiles.SERVING_HOSTS`).
SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"


class ControlPlaneError(RuntimeError):
    """The control plane did not start (the message carries the tails of its logs)."""


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


# ----------------------------------------------------------------------------------------------
# The control plane


class ControlPlane(KubeAccess):
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
    - ``certs``: the certificates and keys
      (:class:`~kvgate_bench.kit.kubefiles.ClusterCerts`: the CA, its file, the admin client
      certificate, CN=kvgate-admin, O=system:masters).
    - ``kubeconfig``: a kubeconfig file for the admin user (certificates embedded).
    - ``apiserver_log``, ``etcd_log``: the processes' combined stdout/stderr.
    - ``startup_seconds``: how long :meth:`start` took.

    Helpers (:class:`~kvgate_bench.kit.kubeaccess.KubeAccess`): :meth:`kubectl`, :meth:`helm`,
    :meth:`api_client`, :meth:`kubeconfig_for_token`, :meth:`wait_crd_established`,
    :meth:`get_json`, :attr:`env`.
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
            self.certs = ClusterCerts.write(self.dir / "pki")
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
            self.kubeconfig = write_kubeconfig(
                self.dir / "kubeconfig",
                self.url,
                self.certs.ca.cert_pem,
                self.certs.admin_user(),
                ADMIN_USER,
            )
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
                f"--tls-cert-file={self.certs.serving_cert_file}",
                f"--tls-private-key-file={self.certs.serving_key_file}",
                f"--client-ca-file={self.certs.ca_file}",
                "--authorization-mode=RBAC",
                "--enable-admission-plugins="
                "PodSecurity,MutatingAdmissionWebhook,ValidatingAdmissionPolicy",
                "--disable-admission-plugins=ServiceAccount",
                f"--service-account-issuer={self.url}",
                f"--service-account-key-file={self.certs.sa_pub_file}",
                f"--service-account-signing-key-file={self.certs.sa_key_file}",
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


class _PortRace(Exception):
    """A child could not bind the port picked for it."""
