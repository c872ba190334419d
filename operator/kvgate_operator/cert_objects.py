"""The Kubernetes objects of the webhook's certificates: the TLS Secret they are kept in and the
MutatingWebhookConfiguration whose ``caBundle`` trusts them, behind the small
:class:`CertObjects` protocol (unit tests pass a fake).

Invariant: a replaced Secret keeps the type it was read or created with (a Secret's type is
immutable).
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError


class CertObjects(Protocol):
    """Where certificates live and where the ``caBundle`` goes. Methods raise the kubernetes
    client's ``ApiException`` on API errors (status 0: no answer at all)."""

    def read_secret(self, namespace: str, name: str) -> tuple[dict[str, bytes], str] | None:
        """The Secret's data (decoded) and its resourceVersion; None when it does not exist."""
        ...

    def write_secret(
        self, namespace: str, name: str, data: dict[str, bytes], resource_version: str | None
    ) -> str:
        """Create (``resource_version`` None) or replace the Secret; its new resourceVersion."""
        ...

    def read_webhook_config(self, name: str) -> dict[str, Any] | None:
        """The MutatingWebhookConfiguration as a dict; None when it does not exist."""
        ...

    def patch_webhook_config(self, name: str, ops: list[dict[str, Any]]) -> None:
        """Apply a JSON patch (RFC 6902) to the MutatingWebhookConfiguration."""
        ...


@contextlib.contextmanager
def _answered() -> Iterator[None]:
    """No answer from the API server (refused, reset, timed out: urllib3's errors, which are
    not OSErrors, and socket errors) as an ``ApiException`` with status 0, so that callers
    handle it as any other transient API error."""
    try:
        yield
    except (HTTPError, OSError) as exc:
        raise ApiException(status=0, reason=f"no answer from the API server: {exc}") from exc


class KubeCertObjects:
    """:class:`CertObjects` through the kubernetes client (``api``: a
    ``kubernetes.client.ApiClient``; ``timeout``: seconds per request)."""

    def __init__(self, api: Any, timeout: float = 10.0) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api)
        self.admission = client.AdmissionregistrationV1Api(api)
        self.api = api
        self.timeout = timeout
        self._types: dict[tuple[str, str], str] = {}  # a Secret's type is immutable: keep it

    def read_secret(self, namespace: str, name: str) -> tuple[dict[str, bytes], str] | None:
        try:
            with _answered():
                s = self.core.read_namespaced_secret(name, namespace, _request_timeout=self.timeout)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        data = {k: base64.b64decode(v) for k, v in (s.data or {}).items()}
        self._types[(namespace, name)] = s.type or "Opaque"
        return data, str(s.metadata.resource_version if s.metadata else "")

    def write_secret(
        self, namespace: str, name: str, data: dict[str, bytes], resource_version: str | None
    ) -> str:
        from kubernetes import client

        body = client.V1Secret(
            metadata=client.V1ObjectMeta(
                name=name,
                namespace=namespace,
                resource_version=resource_version,
                labels={"app.kubernetes.io/managed-by": "kvgate-operator"},
            ),
            type="kubernetes.io/tls",
            data={k: base64.b64encode(v).decode("ascii") for k, v in data.items()},
        )
        with _answered():
            if resource_version is None:
                s = self.core.create_namespaced_secret(
                    namespace, body, _request_timeout=self.timeout
                )
            else:
                # A replace must repeat the existing Secret's type: it is immutable, and an
                # unset type defaults to Opaque, which the API server refuses for a TLS one.
                body.type = self._types.get((namespace, name), "kubernetes.io/tls")
                s = self.core.replace_namespaced_secret(
                    name, namespace, body, _request_timeout=self.timeout
                )
        self._types[(namespace, name)] = str(s.type or body.type or "Opaque")
        return str(s.metadata.resource_version if s.metadata else "")

    def read_webhook_config(self, name: str) -> dict[str, Any] | None:
        try:
            with _answered():
                obj = self.admission.read_mutating_webhook_configuration(
                    name, _request_timeout=self.timeout
                )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        result: dict[str, Any] = self.api.sanitize_for_serialization(obj)
        return result

    def patch_webhook_config(self, name: str, ops: list[dict[str, Any]]) -> None:
        with _answered():
            self.admission.patch_mutating_webhook_configuration(
                name,
                ops,
                _request_timeout=self.timeout,
                _content_type="application/json-patch+json",
            )
