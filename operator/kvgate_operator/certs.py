"""The webhook's TLS certificates kept in a Secret: loaded or created at start, rotated before
they expire, adopted from the Secret by followers, and the CA bundle kept in the
MutatingWebhookConfiguration.

:func:`~kvgate_operator.cert_issue.plan` decides what to renew (pure, the clock is an
argument); :class:`CertificateManager` applies it against the cluster through a
:class:`~kvgate_operator.cert_objects.CertObjects`. Invariant: the ``caBundle`` trusts the CA
of every serving certificate the operator serves: an old CA stays in the bundle until it
expires, and a changed bundle is patched before the certificate that needs it is stored and
served.
"""

from __future__ import annotations

import base64
import datetime as dt
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from kvgate_operator.cert_issue import (
    DEFAULT_LIFETIMES,
    Lifetimes,
    WebhookCerts,
    ca_bundle_patch,
    plan,
)
from kvgate_operator.cert_objects import CertObjects
from kvgate_operator.pki import CertificateError

__all__ = ["CertificateManager"]

log = logging.getLogger("kvgate.operator.certs")


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
        objects: the Secret and the MutatingWebhookConfiguration
            (:class:`~kvgate_operator.cert_objects.KubeCertObjects`) or a fake.
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
        objects: CertObjects,
        *,
        namespace: str | None,
        secret_name: str,
        webhook_config_name: str | None,
        hosts: Sequence[str],
        clock: Callable[[], dt.datetime] = _utcnow,
        sleep: Callable[[float], None] = time.sleep,
        lifetimes: Lifetimes = DEFAULT_LIFETIMES,
    ) -> None:
        self.objects = objects
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
            self._save(now)
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
        replica leads first. They have the configured lifetimes, as stored ones would: a
        follower that comes to lead renews them on the configured schedule."""
        self.certs, _ = plan(None, self.hosts, self.clock(), self.lifetimes)
        self.persistent = False

    def _load(self) -> WebhookCerts | None:
        assert self.namespace is not None
        got = self.objects.read_secret(self.namespace, self.secret_name)
        if got is None:
            self._rv = None
            return None
        data, self._rv = got
        try:
            return WebhookCerts.from_secret_data(data)
        except CertificateError as exc:
            log.warning("webhook certificates in %s are unusable (%s); replacing", self.where, exc)
            return None

    def _save(self, now: dt.datetime) -> bool:
        """Write the certificates to the Secret. On a conflict (written meanwhile by someone
        else) the stored ones are adopted when usable. Returns False when not stored."""
        assert self.certs is not None and self.namespace is not None
        try:
            self._rv = self.objects.write_secret(
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
            self._save(now)
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
            config = self.objects.read_webhook_config(self.webhook_config_name)
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
            self.objects.patch_webhook_config(self.webhook_config_name, ops)
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
