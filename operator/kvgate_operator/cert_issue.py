"""Issuing the webhook's TLS certificates: a self-signed CA and a serving certificate, when
each is due for renewal, and the ``caBundle`` that trusts them.

Pure: no I/O, no kopf, no Kubernetes client (x509 through :mod:`kvgate_operator.pki`); the
clock is an argument. :func:`plan` decides what to renew; :class:`WebhookCerts` is the set of
certificates and its Secret data; :func:`ca_bundle_patch` the JSON patch of a
MutatingWebhookConfiguration's ``caBundle``. :class:`~kvgate_operator.certs.CertificateManager`
applies them against the cluster.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from kvgate_operator import pki
from kvgate_operator.pki import CertificateError, KeyPair

__all__ = [
    "CA_COMMON_NAME",
    "CA_LIFETIME",
    "CA_RENEW_BEFORE",
    "DEFAULT_LIFETIMES",
    "SERVING_LIFETIME",
    "SERVING_RENEW_BEFORE",
    "Lifetimes",
    "WebhookCerts",
    "ca_bundle_patch",
    "new_ca",
    "new_serving_cert",
    "plan",
]

CA_LIFETIME = dt.timedelta(days=365)
CA_RENEW_BEFORE = dt.timedelta(days=90)
"""The CA is renewed when fewer than this remain; the old one stays in the bundle until it
expires, so certificates it signed keep working during the overlap."""
SERVING_LIFETIME = dt.timedelta(days=90)
SERVING_RENEW_BEFORE = dt.timedelta(days=30)
"""The serving certificate is renewed when fewer than this remain, when the webhook's host names
change, or when no trusted CA signed it."""
CA_COMMON_NAME = "kvgate-webhook-ca"


@dataclass(frozen=True)
class Lifetimes:
    """How long the CA and the serving certificate are valid, and how long before their end
    they are renewed (the defaults above; shorter ones rotate often, e.g. in tests).

    Raises:
        ValueError: a renewal margin is not in ``(0, lifetime)``, or the CA's margin is below
            the serving lifetime (a serving certificate would then be cut short by its CA's end
            and renewed at every check).
    """

    ca: dt.timedelta = CA_LIFETIME
    ca_renew_before: dt.timedelta = CA_RENEW_BEFORE
    serving: dt.timedelta = SERVING_LIFETIME
    serving_renew_before: dt.timedelta = SERVING_RENEW_BEFORE

    def __post_init__(self) -> None:
        zero = dt.timedelta(0)
        for what, life, before in (
            ("CA", self.ca, self.ca_renew_before),
            ("serving", self.serving, self.serving_renew_before),
        ):
            if not zero < before < life:
                raise ValueError(f"the {what} renewal margin must be in (0, lifetime)")
        if self.ca_renew_before < self.serving:
            raise ValueError("the CA's renewal margin must be at least the serving lifetime")


DEFAULT_LIFETIMES = Lifetimes()


def new_ca(
    now: dt.datetime, *, common_name: str = CA_COMMON_NAME, lifetime: dt.timedelta = CA_LIFETIME
) -> KeyPair:
    """The webhook's self-signed CA, valid from ``now`` (backdated an hour) for ``lifetime``."""
    return pki.new_ca(now, common_name=common_name, lifetime=lifetime)


def new_serving_cert(
    ca: KeyPair,
    hosts: Sequence[str],
    now: dt.datetime,
    *,
    lifetime: dt.timedelta = SERVING_LIFETIME,
) -> KeyPair:
    """A TLS server certificate for ``hosts`` (IP addresses become IP SANs, anything else DNS
    SANs; the CN is the first DNS name, else the first host), signed by ``ca``, valid for
    ``lifetime`` but never past the CA's own end.

    Raises:
        ValueError: ``hosts`` is empty.
        CertificateError: ``ca``'s key is not an ECDSA key.
    """
    if not hosts:
        raise ValueError("a serving certificate needs at least one host name")
    dns = [h for h in hosts if not isinstance(pki.san(h), x509.IPAddress)]
    common_name = (dns or list(hosts))[0][:64]
    return pki.issue(ca, now, lifetime, common_name=common_name, hosts=hosts, server=True)


@dataclass(frozen=True)
class WebhookCerts:
    """Everything the webhook's TLS needs: the current CA, the serving certificate and the old
    CAs still trusted during a CA rotation (PEM certificates, newest first)."""

    ca: KeyPair
    serving: KeyPair
    previous_cas: tuple[bytes, ...] = ()

    def trusted(self, now: dt.datetime) -> list[x509.Certificate]:
        """The CAs a client should trust: the current one and every previous one not expired."""
        old = [x509.load_pem_x509_certificate(p) for p in self.previous_cas]
        return [self.ca.cert] + [c for c in old if c.not_valid_after_utc > now]

    def ca_bundle(self, now: dt.datetime) -> bytes:
        """The ``caBundle`` (PEM, current CA first)."""
        return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in self.trusted(now))

    def to_secret_data(self, now: dt.datetime) -> dict[str, bytes]:
        """The Secret's data (raw bytes; the store base64-encodes): ``tls.crt`` / ``tls.key``
        (serving), ``ca.crt`` / ``ca.key`` (the current CA, so a restart issues from the same
        CA and the ``caBundle`` does not churn) and ``ca-bundle.crt`` (every CA still trusted,
        current first)."""
        return {
            "tls.crt": self.serving.cert_pem,
            "tls.key": self.serving.key_pem,
            "ca.crt": self.ca.cert_pem,
            "ca.key": self.ca.key_pem,
            "ca-bundle.crt": self.ca_bundle(now),
        }

    @classmethod
    def from_secret_data(cls, data: dict[str, bytes]) -> WebhookCerts:
        """Parse a Secret's data; :class:`CertificateError` when anything is missing or bad."""
        missing = [k for k in ("tls.crt", "tls.key", "ca.crt", "ca.key") if not data.get(k)]
        if missing:
            raise CertificateError(f"missing keys: {', '.join(missing)}")
        ca = KeyPair(data["ca.crt"], data["ca.key"])
        serving = KeyPair(data["tls.crt"], data["tls.key"])
        ca.validate(ca=True)
        serving.validate(ca=False)
        try:
            bundle = pki.split_pem_certs(data.get("ca-bundle.crt") or b"")
        except ValueError as exc:
            raise CertificateError(f"unparseable ca-bundle.crt: {exc}") from exc
        current = ca.cert.public_bytes(serialization.Encoding.PEM)
        return cls(ca, serving, tuple(p for p in bundle if p != current))


def plan(
    certs: WebhookCerts | None,
    hosts: Sequence[str],
    now: dt.datetime,
    lifetimes: Lifetimes = DEFAULT_LIFETIMES,
) -> tuple[WebhookCerts, list[str]]:
    """What the certificates should be at ``now``: ``(certs, reasons)``; ``reasons`` is empty
    when nothing changes (then ``certs`` is the same object). Reasons: ``created``,
    ``ca_rotated``, ``serving_rotated``, ``hosts_changed``, ``untrusted_issuer``,
    ``expired_ca_dropped``.

    A serving certificate is issued by the current CA, except in the pass that rotates the CA:
    the API server may still verify with the ``caBundle`` it had before the patch for a moment,
    so a serving certificate due then is issued by the old CA while that one is valid (and
    renewed by the new CA once due again). After a CA rotation the existing serving
    certificate (signed by the old CA, still in the bundle) is kept until it is due."""
    lt = lifetimes
    if certs is None:
        ca = new_ca(now, lifetime=lt.ca)
        return WebhookCerts(ca, new_serving_cert(ca, hosts, now, lifetime=lt.serving)), ["created"]
    reasons: list[str] = []
    out = certs
    # Drop previous CAs that expired.
    alive = tuple(
        p for p in out.previous_cas if x509.load_pem_x509_certificate(p).not_valid_after_utc > now
    )
    if alive != out.previous_cas:
        out = replace(out, previous_cas=alive)
        reasons.append("expired_ca_dropped")
    signer = out.ca
    if out.ca.remaining(now) < lt.ca_renew_before:
        old = out.ca
        keep = (old.cert_pem,) if old.not_after > now else ()
        out = replace(out, ca=new_ca(now, lifetime=lt.ca), previous_cas=keep + out.previous_cas)
        reasons.append("ca_rotated")
        signer = old if keep else out.ca
    serving = out.serving.cert
    renew = None
    if out.serving.remaining(now) < lt.serving_renew_before:
        renew = "serving_rotated"
    elif pki.sans(serving) != pki.normalised_hosts(hosts):
        renew = "hosts_changed"
    elif not any(pki.signed_by(serving, ca) for ca in out.trusted(now)):
        renew = "untrusted_issuer"
    if renew:
        out = replace(out, serving=new_serving_cert(signer, hosts, now, lifetime=lt.serving))
        reasons.append(renew)
    return (out if reasons else certs), reasons


def ca_bundle_patch(config: dict[str, Any], bundle_b64: str) -> list[dict[str, Any]]:
    """JSON patch ops that set ``caBundle`` on every webhook of ``config`` whose bundle differs
    (each guarded by a ``test`` of the webhook's name, so a concurrent reordering fails the
    patch instead of patching the wrong entry); empty when all match. Webhooks that call a URL
    or a Service alike get it: the bundle is what the API server verifies the operator with."""
    ops: list[dict[str, Any]] = []
    for i, wh in enumerate(config.get("webhooks") or []):
        cc = wh.get("clientConfig") or {}
        if cc.get("caBundle") == bundle_b64:
            continue
        ops.append({"op": "test", "path": f"/webhooks/{i}/name", "value": wh.get("name")})
        if "clientConfig" not in wh:
            ops.append({"op": "add", "path": f"/webhooks/{i}/clientConfig", "value": {}})
        ops.append(
            {"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": bundle_b64}
        )
    return ops
