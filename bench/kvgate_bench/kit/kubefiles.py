"""The local control plane's files: its certificates and its kubeconfigs.

:meth:`ClusterCerts.write` makes, in a fresh ``pki`` directory (mode 0700), a CA; a serving
certificate for kube-apiserver (127.0.0.1, localhost and the ``kubernetes`` Service's names and
ClusterIP); an admin client certificate (CN :data:`ADMIN_USER`, O ``system:masters``); an RSA
service-account key pair. :func:`write_kubeconfig` writes a kubeconfig (mode 0600) for one user
of an API server, the CA embedded. Certificates come from :mod:`kvgate_bench.kit.certs`.
"""

from __future__ import annotations

import base64
import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvgate_bench.kit import certs

#: The admin user: its client certificate's CN, and its kubeconfig's user and context name.
ADMIN_USER = "kvgate-admin"
#: Lifetime of the test CA and of every certificate it issues.
CERT_LIFETIME = datetime.timedelta(days=7)
#: The API server's names in its serving certificate: loopback, and the ``kubernetes`` Service's
#: (10.0.0.1 is its ClusterIP in the control plane's service range 10.0.0.0/24).
SERVING_HOSTS = (
    "127.0.0.1",
    "localhost",
    "10.0.0.1",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
)


@dataclass(frozen=True)
class ClusterCerts:
    """The control plane's PEM files (all in one directory) and its CA.

    Attributes:
        ca: the CA that signed the serving and admin certificates (:func:`certs.issue` with it
            makes more, e.g. for a webhook server).
        ca_file: the CA's certificate (a webhook ``caBundle`` is its base64).
        serving_cert_file, serving_key_file: kube-apiserver's serving certificate and key.
        admin_cert_file, admin_key_file: the admin client certificate and key.
        sa_key_file, sa_pub_file: the service-account signing key (PKCS#8) and its public key.
    """

    ca: certs.KeyPair
    ca_file: Path
    serving_cert_file: Path
    serving_key_file: Path
    admin_cert_file: Path
    admin_key_file: Path
    sa_key_file: Path
    sa_pub_file: Path

    @classmethod
    def write(cls, directory: Path) -> ClusterCerts:
        """Make every certificate and key, valid from now for :data:`CERT_LIFETIME`, and write
        them into ``directory`` (created, mode 0700; it must not exist)."""
        directory.mkdir(mode=0o700)
        now = datetime.datetime.now(datetime.UTC)
        ca = certs.new_ca(now, common_name="kvgate-test-ca", lifetime=CERT_LIFETIME)
        serving = certs.issue(
            ca, now, CERT_LIFETIME, common_name="kube-apiserver", hosts=SERVING_HOSTS, server=True
        )
        admin = certs.issue(
            ca,
            now,
            CERT_LIFETIME,
            common_name=ADMIN_USER,
            organizations=["system:masters"],
            client=True,
        )
        sa_key, sa_pub = certs.new_rsa_key_pems()
        files = {
            "ca.crt": ca.cert_pem,
            "serving.crt": serving.cert_pem,
            "serving.key": serving.key_pem,
            "admin.crt": admin.cert_pem,
            "admin.key": admin.key_pem,
            "sa.key": sa_key,
            "sa.pub": sa_pub,
        }
        for name, pem in files.items():
            (directory / name).write_bytes(pem)
        return cls(ca, *(directory / name for name in files))

    def admin_user(self) -> dict[str, str]:
        """The kubeconfig ``user`` entry of the admin (its certificate and key embedded)."""
        return {
            "client-certificate-data": _b64(self.admin_cert_file.read_bytes()),
            "client-key-data": _b64(self.admin_key_file.read_bytes()),
        }


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def write_kubeconfig(
    path: Path, server: str, ca_pem: bytes, user: dict[str, Any], user_name: str
) -> Path:
    """Write a kubeconfig (mode 0600) whose one context is ``user_name`` on ``server`` (an
    ``https://`` URL trusted through ``ca_pem``); ``user`` is its kubeconfig user entry
    (certificate data, or ``{"token": ...}``). Returns ``path``."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "kvgate-test",
                "cluster": {"server": server, "certificate-authority-data": _b64(ca_pem)},
            }
        ],
        "users": [{"name": user_name, "user": user}],
        "contexts": [{"name": user_name, "context": {"cluster": "kvgate-test", "user": user_name}}],
        "current-context": user_name,
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path
