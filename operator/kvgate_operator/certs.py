"""The webhook's TLS certificates: a self-signed CA and a serving certificate, kept in a Secret,
rotated before they expire, and the CA bundle kept in the MutatingWebhookConfiguration.

:func:`plan` decides what to renew (pure, the clock is an argument); :class:`CertificateManager`
applies it against the cluster through a :class:`~kvgate_operator.certstore.CertStore`.
Invariant: the ``caBundle`` trusts the CA of every serving certificate the operator serves: an
old CA stays in the bundle until it expires, and a changed bundle is patched before the
certificate that needs it is stored and served.
"""

from __future__ import annotations

import base64
import datetime as dt
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from kvgate_operator import pki
from kvgate_operator.certstore import CertStore
from kvgate_operator.pki import CertificateError, KeyPair

__all__ = [
    "CA_COMMON_NAME",
    "CA_LIFETIME",
    "CA_RENEW_BEFORE",
    "SERVING_LIFETIME",
    "SERVING_RENEW_BEFORE",
    "CertificateManager",
    "Lifetimes",
    "WebhookCerts",
    "ca_bundle_patch",
    "new_ca",
    "new_serving_cert",
    "plan",
]

log = logging.getLogger("kvgate.operator.certs")

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


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _describe(exc: ApiException) -> str:
    return f"{exc.status} {exc.reason}"


class CertificateManager:
    """The operator's self-signed webhook certificates, persisted in a Secret.

    Where the Secret cannot be read or written (RBAC), the manager keeps its certificates in
    memory and says so in a warning; a restart then makes a new CA and patches the ``caBundle``
    again.

    Args:
        store: the cluster (:class:`~kvgate_operator.certstore.KubeCertStore`) or a fake.
        namespace: where the Secret lives (the operator's namespace); None keeps the
            certificates in memory only (local runs without a namespace).
        secret_name: the Secret's name.
        webhook_config_name: the MutatingWebhookConfiguration whose ``caBundle`` to keep in sync
            (None: none).
        hosts: the serving certificate's host names / IP addresses.
        clock: the current time (UTC, aware); injected by tests.
        sleep: how to wait between retries of transient errors at start (injected by tests).
        lifetimes: the certificates' lifetimes and renewal margins.
    """

    def __init__(
        self,
        store: CertStore,
        *,
        namespace: str | None,
        secret_name: str,
        webhook_config_name: str | None,
        hosts: Sequence[str],
        clock: Callable[[], dt.datetime] = _utcnow,
        sleep: Callable[[float], None] = time.sleep,
        lifetimes: Lifetimes = DEFAULT_LIFETIMES,
    ) -> None:
        self.store = store
        self.lifetimes = lifetimes
        self.namespace = namespace
        self.secret_name = secret_name
        self.webhook_config_name = webhook_config_name
        self.hosts = list(hosts)
        self.clock = clock
        self.sleep = sleep
        self.certs: WebhookCerts | None = None
        #: True while the certificates are stored in (and came from, or were written to) the
        #: Secret; False while they live only in this process.
        self.persistent = False
        self._rv: str | None = None
        self._config_missing_logged = False

    @property
    def where(self) -> str:
        return f"Secret {self.namespace}/{self.secret_name}"

    # -- start --------------------------------------------------------------------------------

    def ensure(self, start_retries: int = 5) -> list[str]:
        """At start: load the certificates from the Secret, or make them and store them there.
        Transient API errors are retried a few times (so a slow API server does not cost a new
        CA); access errors fall back to in-memory certificates at once. Returns the reasons
        the certificates changed (empty when the stored ones were used as they were)."""
        now = self.clock()
        loaded: WebhookCerts | None = None
        if self.namespace is None:
            log.warning(
                "webhook certificates: no namespace known (KVGATE_OPERATOR_POD_NAMESPACE unset), "
                "keeping them in memory only; a restart makes a new CA"
            )
        else:
            for attempt in range(start_retries + 1):
                try:
                    loaded = self._load()
                    self.persistent = True
                    break
                except ApiException as exc:
                    if exc.status in (401, 403) or attempt == start_retries:
                        log.warning(
                            "webhook certificates: cannot read %s (%s); keeping them in memory "
                            "only, a restart makes a new CA and patches the caBundle again",
                            self.where,
                            _describe(exc),
                        )
                        break
                    self.sleep(min(8.0, 0.5 * 2**attempt))
        certs, reasons = plan(loaded, self.hosts, now, self.lifetimes)
        self.certs = certs
        if reasons and self.persistent:
            self._store(now)
        if reasons:
            log.info("webhook certificates: %s", ", ".join(reasons))
        return reasons

    def follow(self) -> list[str]:
        """A follower's refresh (leader election: only the leader writes the Secret): adopt the
        certificates stored in the Secret when they differ from the current ones; never writes.
        Returns ``["adopted_stored"]`` when they changed, else [] (also when the Secret is
        missing or cannot be read, the API server answering with an error or not at all:
        the current ones stay)."""
        if self.namespace is None:
            return []
        try:
            stored = self._load()
        except ApiException as exc:
            log.warning("webhook certificates: cannot read %s (%s)", self.where, _describe(exc))
            return []
        except (OSError, HTTPError) as exc:  # urllib3's errors are not OSErrors
            log.warning("webhook certificates: cannot read %s (%s)", self.where, exc)
            return []
        if stored is None or stored == self.certs:
            return []
        self.certs, self.persistent = stored, True
        return ["adopted_stored"]

    def provisional(self) -> None:
        """In-memory certificates, not stored (a follower that found no Secret yet); replaced
        by :meth:`follow` once the leader stores some, or stored by :meth:`check` if this
        replica leads first."""
        self.certs, _ = plan(None, self.hosts, self.clock())
        self.persistent = False

    def _load(self) -> WebhookCerts | None:
        assert self.namespace is not None
        got = self.store.read_secret(self.namespace, self.secret_name)
        if got is None:
            self._rv = None
            return None
        data, self._rv = got
        try:
            return WebhookCerts.from_secret_data(data)
        except CertificateError as exc:
            log.warning("webhook certificates in %s are unusable (%s); replacing", self.where, exc)
            return None

    def _store(self, now: dt.datetime) -> bool:
        """Write the certificates to the Secret. On a conflict (written meanwhile by someone
        else) the stored ones are adopted when usable. Returns False when not stored."""
        assert self.certs is not None and self.namespace is not None
        try:
            self._rv = self.store.write_secret(
                self.namespace, self.secret_name, self.certs.to_secret_data(now), self._rv
            )
            self.persistent = True
            return True
        except ApiException as exc:
            if exc.status == 409 or (exc.status == 404 and self._rv is not None):
                # Someone else wrote (or deleted) it meanwhile: take theirs if usable.
                try:
                    theirs = self._load()
                except ApiException:
                    theirs = None
                if theirs is not None:
                    self.certs, _ = plan(theirs, self.hosts, now, self.lifetimes)
                    return True
                return False
            if self.persistent or exc.status not in (401, 403):
                log.warning(
                    "webhook certificates: cannot write %s (%s); keeping them in memory",
                    self.where,
                    _describe(exc),
                )
            self.persistent = False
            return False

    # -- periodic -----------------------------------------------------------------------------

    def check(self) -> list[str]:
        """Renew what is due (see :func:`plan`), patch the ``caBundle`` first when it changes,
        then store. Returns the reasons (empty when nothing changed). The caller reloads the
        serving certificate when the returned reasons are not empty."""
        now = self.clock()
        if self.certs is None:
            return self.ensure()
        adopted: list[str] = []
        if not self.persistent and self.namespace is not None:
            # Access may have been granted since: try to store ours (or adopt a stored one).
            try:
                stored = self._load()
            except ApiException:
                stored = None
            if stored is not None:
                if stored != self.certs:
                    adopted = ["adopted_stored"]
                self.certs = stored
                self.persistent = True
        before = self.certs.ca_bundle(now)
        certs, reasons = plan(self.certs, self.hosts, now, self.lifetimes)
        reasons = adopted + reasons
        self.certs = certs
        if certs.ca_bundle(now) != before:
            self.sync_ca_bundle()
        if reasons:
            log.info("webhook certificates: %s", ", ".join(reasons))
        if (reasons or not self.persistent) and self.namespace is not None:
            self._store(now)
        return reasons

    def sync_ca_bundle(self) -> bool:
        """Patch ``webhooks[*].clientConfig.caBundle`` of the configured
        MutatingWebhookConfiguration where it differs (read first; no write when all match).
        Returns True when it patched. API errors are logged, never raised: the next sync
        retries."""
        if self.webhook_config_name is None or self.certs is None:
            return False
        bundle = base64.b64encode(self.certs.ca_bundle(self.clock())).decode("ascii")
        try:
            config = self.store.read_webhook_config(self.webhook_config_name)
            if config is None:
                if not self._config_missing_logged:
                    log.warning(
                        "MutatingWebhookConfiguration %s not found; its caBundle will be set "
                        "once it exists",
                        self.webhook_config_name,
                    )
                    self._config_missing_logged = True
                return False
            self._config_missing_logged = False
            ops = ca_bundle_patch(config, bundle)
            if not ops:
                return False
            self.store.patch_webhook_config(self.webhook_config_name, ops)
        except ApiException as exc:
            log.warning(
                "caBundle of MutatingWebhookConfiguration %s not synced: %s",
                self.webhook_config_name,
                _describe(exc),
            )
            return False
        log.info("caBundle of MutatingWebhookConfiguration %s updated", self.webhook_config_name)
        return True

    def write_files(self, directory: Path) -> tuple[Path, Path]:
        """Write the serving certificate and key (0600) for the TLS server; atomically, so a
        reader sees either the old pair or the new one. Returns (certfile, keyfile)."""
        assert self.certs is not None
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        paths = (directory / "tls.crt", directory / "tls.key")
        for path, data in zip(
            paths, (self.certs.serving.cert_pem, self.certs.serving.key_pem), strict=True
        ):
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.")
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        return paths
