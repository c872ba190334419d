"""What the injected sidecar gets for verified tenants (the chart's ``injector.apiKeysSecret``
and ``injector.jwksSecret`` values): the API keys file and the JWKS file, each a key of a Secret
mounted read-only, and ``KVGATE_API_KEYS_FILE`` / ``KVGATE_JWKS_FILE`` naming it.

The Secrets are mounted from the model pod's own namespace (a pod can mount no other), so they
must exist in every namespace whose pods are injected. The whole volume is mounted (no
``subPath``): the kubelet then updates the files when the Secret changes (an atomic swap of the
``..data`` symlink), and the sidecar re-reads them. Pure: no Kubernetes client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Volume, mount directory and variable of each file.
API_KEYS_VOLUME = "kvgate-api-keys"
API_KEYS_DIR = "/var/run/secrets/kvgate-api-keys"
JWKS_VOLUME = "kvgate-jwks"
JWKS_DIR = "/var/run/secrets/kvgate-jwks"
#: A Secret's data key (Kubernetes: ``[-._a-zA-Z0-9]+``), here also the file's name.
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"


@dataclass(frozen=True, slots=True)
class SecretFile:
    """One key of a Secret, mounted as ``<directory>/<key>`` and named to the sidecar by
    ``variable``."""

    variable: str
    volume: str
    directory: str
    secret: str
    key: str

    def env(self) -> dict[str, Any]:
        """The sidecar's variable naming the file."""
        return {"name": self.variable, "value": f"{self.directory}/{self.key}"}

    def mount(self) -> dict[str, Any]:
        """The sidecar's read-only mount of the volume (the directory: updates reach it)."""
        return {"name": self.volume, "mountPath": self.directory, "readOnly": True}

    def pod_volume(self) -> dict[str, Any]:
        """The pod's volume: only the key used, mode 0440."""
        return {
            "name": self.volume,
            "secret": {
                "secretName": self.secret,
                "items": [{"key": self.key, "path": self.key}],
                "defaultMode": 0o440,
            },
        }


def identity_files(
    api_keys_secret: str | None, api_keys_key: str, jwks_secret: str | None, jwks_key: str
) -> list[SecretFile]:
    """The files of the Secrets given (none: an empty list)."""
    files = []
    if api_keys_secret is not None:
        files.append(
            SecretFile(
                "KVGATE_API_KEYS_FILE", API_KEYS_VOLUME, API_KEYS_DIR, api_keys_secret, api_keys_key
            )
        )
    if jwks_secret is not None:
        files.append(SecretFile("KVGATE_JWKS_FILE", JWKS_VOLUME, JWKS_DIR, jwks_secret, jwks_key))
    return files
