"""The webhook's certificates: generation, rotation thresholds, the CA overlap in the bundle,
and the CertificateManager's decisions against a fake cluster (Secret, caBundle patches)."""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import ssl
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from kubernetes.client.exceptions import ApiException

from kvgate_bench.kit.toolkit import FakeUtcClock
from kvgate_operator.cert_issue import (
    CA_RENEW_BEFORE,
    DEFAULT_LIFETIMES,
    SERVING_RENEW_BEFORE,
    Lifetimes,
    WebhookCerts,
    ca_bundle_patch,
    new_ca,
    new_serving_cert,
    plan,
)
from kvgate_operator.certs import CertificateManager
from kvgate_operator.pki import CertificateError, KeyPair, sans, signed_by, split_pem_certs

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
HOSTS = ["kvgate-webhook.kvgate-system.svc", "127.0.0.1"]


def days(n: float) -> dt.timedelta:
    return dt.timedelta(days=n)


# ------------------------------------------------------------------------------ generation


def test_ca_is_a_p256_ca_valid_for_a_year() -> None:
    ca = new_ca(T0)
    cert = ca.cert
    key = cert.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey)
    assert isinstance(key.curve, ec.SECP256R1)
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.key_cert_sign and ku.crl_sign
    assert cert.not_valid_after_utc == T0 + days(365)
    assert cert.not_valid_before_utc <= T0
    ca.validate(ca=True)


def test_serving_cert_has_sans_server_auth_and_is_signed_by_the_ca() -> None:
    ca = new_ca(T0)
    srv = new_serving_cert(ca, HOSTS, T0)
    cert = srv.cert
    assert sans(cert) == set(HOSTS)
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ext.get_values_for_type(x509.DNSName) == ["kvgate-webhook.kvgate-system.svc"]
    assert ext.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert cert.not_valid_after_utc == T0 + days(90)
    assert signed_by(cert, ca.cert)
    assert not signed_by(cert, new_ca(T0).cert)
    srv.validate(ca=False)


def test_serving_cert_never_outlives_its_ca() -> None:
    ca = new_ca(T0)
    srv = new_serving_cert(ca, HOSTS, T0 + days(300))
    assert srv.not_after == ca.not_after


def test_a_real_tls_server_context_accepts_the_pair(tmp_path: Path) -> None:
    ca = new_ca(T0 - days(1), lifetime=days(365))
    srv = new_serving_cert(ca, ["127.0.0.1"], dt.datetime.now(dt.UTC))
    (tmp_path / "c").write_bytes(srv.cert_pem)
    (tmp_path / "k").write_bytes(srv.key_pem)
    ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH).load_cert_chain(
        tmp_path / "c", tmp_path / "k"
    )


def test_mismatched_key_is_rejected() -> None:
    a, b = new_ca(T0), new_ca(T0)
    with pytest.raises(CertificateError, match="does not match"):
        KeyPair(a.cert_pem, b.key_pem).validate(ca=True)
    srv = new_serving_cert(a, HOSTS, T0)
    with pytest.raises(CertificateError, match="not a CA"):
        srv.validate(ca=True)


# ------------------------------------------------------------------------------ rotation


def fresh() -> WebhookCerts:
    certs, reasons = plan(None, HOSTS, T0)
    assert reasons == ["created"]
    return certs


def test_nothing_changes_while_everything_is_fresh() -> None:
    certs = fresh()
    for at in (T0, T0 + days(59)):
        same, reasons = plan(certs, HOSTS, at)
        assert reasons == [] and same is certs


def test_serving_cert_rotates_when_fewer_than_30_days_remain() -> None:
    certs = fresh()
    due = certs.serving.not_after - SERVING_RENEW_BEFORE
    assert plan(certs, HOSTS, due - dt.timedelta(minutes=1))[1] == []
    new, reasons = plan(certs, HOSTS, due + dt.timedelta(minutes=1))
    assert reasons == ["serving_rotated"]
    assert new.ca == certs.ca  # same CA: no caBundle change
    assert new.serving != certs.serving and signed_by(new.serving.cert, certs.ca.cert)
    assert new.ca_bundle(due) == certs.ca_bundle(due)


def test_host_change_reissues_the_serving_cert() -> None:
    certs = fresh()
    new, reasons = plan(certs, ["other.ns.svc"], T0 + days(1))
    assert reasons == ["hosts_changed"] and sans(new.serving.cert) == {"other.ns.svc"}
    assert new.ca == certs.ca


def test_ca_rotates_with_90_days_left_and_the_old_ca_stays_in_the_bundle() -> None:
    certs = fresh()
    due = certs.ca.not_after - CA_RENEW_BEFORE
    assert plan(certs, HOSTS, due - dt.timedelta(minutes=1))[1] == ["serving_rotated"]  # 275 d
    # Serving certs renew every ~60 days; follow them up to the CA's due date.
    at = T0
    while True:
        certs, _ = plan(certs, HOSTS, at)
        if at > due:
            break
        at += days(1)
    assert certs.ca.not_after > T0 + days(365)  # the new CA
    old_ca = x509.load_pem_x509_certificate(certs.previous_cas[0])
    assert old_ca.not_valid_after_utc == T0 + days(365)
    bundle = x509.load_pem_x509_certificates(certs.ca_bundle(at))
    assert [c.not_valid_after_utc for c in bundle] == [
        certs.ca.not_after,
        old_ca.not_valid_after_utc,
    ]
    # The serving certificate in use is signed by a CA in the bundle, whichever it is.
    assert any(signed_by(certs.serving.cert, c) for c in bundle)


def test_after_a_ca_rotation_the_serving_cert_is_kept_until_due_then_issued_by_the_new_ca() -> None:
    certs = fresh()
    ca_due = certs.ca.not_after - CA_RENEW_BEFORE + dt.timedelta(hours=1)
    # A serving certificate issued shortly before the CA falls due (still 80+ days valid).
    certs = WebhookCerts(certs.ca, new_serving_cert(certs.ca, HOSTS, ca_due - days(5)))
    rotated, reasons = plan(certs, HOSTS, ca_due)
    assert reasons == ["ca_rotated"]
    assert rotated.serving == certs.serving  # still served; its CA is still trusted
    assert signed_by(rotated.serving.cert, x509.load_pem_x509_certificate(rotated.previous_cas[0]))
    later = rotated.serving.not_after - SERVING_RENEW_BEFORE + dt.timedelta(hours=1)
    renewed, reasons = plan(rotated, HOSTS, later)
    assert reasons == ["serving_rotated"]
    assert signed_by(renewed.serving.cert, renewed.ca.cert)


def test_expired_old_cas_leave_the_bundle() -> None:
    certs = fresh()
    rotated, _ = plan(certs, HOSTS, certs.ca.not_after - days(10))
    assert len(rotated.previous_cas) == 1
    after, reasons = plan(rotated, HOSTS, certs.ca.not_after + days(1))
    assert "expired_ca_dropped" in reasons and after.previous_cas == ()
    assert len(split_pem_certs(after.ca_bundle(certs.ca.not_after + days(1)))) == 1


def test_a_serving_cert_from_an_untrusted_ca_is_reissued() -> None:
    certs = fresh()
    stranger = new_serving_cert(new_ca(T0), HOSTS, T0)
    new, reasons = plan(WebhookCerts(certs.ca, stranger), HOSTS, T0)
    assert reasons == ["untrusted_issuer"] and signed_by(new.serving.cert, certs.ca.cert)


def test_a_serving_cert_due_in_the_pass_that_rotates_the_ca_is_issued_by_the_old_ca() -> None:
    """The API server may verify with the caBundle it had before the patch for a moment: the
    first serving certificate after a CA rotation is still issued by the CA it already trusts;
    the next renewal is the new CA's."""
    certs = fresh()
    at = certs.ca.not_after - CA_RENEW_BEFORE + dt.timedelta(hours=1)  # both due (day 275)
    assert certs.serving.remaining(at) < SERVING_RENEW_BEFORE
    rotated, reasons = plan(certs, HOSTS, at)
    assert reasons == ["ca_rotated", "serving_rotated"]
    assert signed_by(rotated.serving.cert, certs.ca.cert)  # the old CA, already trusted
    assert rotated.serving.not_after == certs.ca.not_after  # capped at the old CA's end
    later = rotated.serving.not_after - SERVING_RENEW_BEFORE + dt.timedelta(hours=1)
    renewed, reasons = plan(rotated, HOSTS, later)
    assert reasons == ["serving_rotated"] and signed_by(renewed.serving.cert, renewed.ca.cert)
    # An old CA already expired cannot sign: the new one does at once.
    gone = certs.ca.not_after + days(1)
    fresh_ca, reasons = plan(certs, HOSTS, gone)
    assert reasons == ["ca_rotated", "serving_rotated"] and fresh_ca.previous_cas == ()
    assert signed_by(fresh_ca.serving.cert, fresh_ca.ca.cert)


def test_short_lifetimes_rotate_both_and_every_served_cert_stays_trusted() -> None:
    """Lifetimes of seconds (the rotation test's settings): follow checks every half second
    for two minutes; the serving certificate is always signed by a CA in the bundle published
    one check earlier (what the API server may still hold)."""
    s = dt.timedelta(seconds=1)
    lt = Lifetimes(ca=22 * s, ca_renew_before=12 * s, serving=12 * s, serving_renew_before=9 * s)
    certs, _ = plan(None, HOSTS, T0, lt)
    at, seen = T0, {"ca_rotated": 0, "serving_rotated": 0}
    published = certs.ca_bundle(T0)
    while at < T0 + 120 * s:
        at += s / 2
        certs, reasons = plan(certs, HOSTS, at, lt)
        for r in reasons:
            seen[r] = seen.get(r, 0) + 1
        trusted = x509.load_pem_x509_certificates(published)
        assert any(signed_by(certs.serving.cert, c) for c in trusted), (at, reasons)
        assert certs.serving.remaining(at) > dt.timedelta(0)
        published = certs.ca_bundle(at)
    assert seen["ca_rotated"] >= 10 and seen["serving_rotated"] >= 30
    assert seen["expired_ca_dropped"] >= 9  # old CAs leave the bundle


@pytest.mark.parametrize(
    "bad",
    [
        {"serving_renew_before": days(90)},  # not below the lifetime
        {"ca_renew_before": days(0)},
        {"ca_renew_before": days(30)},  # below the serving lifetime (90 days)
    ],
)
def test_inconsistent_lifetimes_are_refused(bad: dict[str, dt.timedelta]) -> None:
    with pytest.raises(ValueError, match="renewal margin"):
        Lifetimes(**bad)


def test_settings_carry_the_lifetimes() -> None:
    from pydantic import ValidationError

    from kvgate_operator.settings import OperatorSettings

    assert OperatorSettings().webhook_lifetimes == Lifetimes()
    short = OperatorSettings(
        webhook_ca_lifetime_seconds=60,
        webhook_ca_renew_before_seconds=30,
        webhook_serving_lifetime_seconds=20,
        webhook_serving_renew_before_seconds=10,
    )
    assert short.webhook_lifetimes.serving == dt.timedelta(seconds=20)
    with pytest.raises(ValidationError, match="renewal margin"):
        OperatorSettings(webhook_serving_renew_before_seconds=days(100).total_seconds())


def test_secret_data_round_trips() -> None:
    certs = fresh()
    rotated, _ = plan(certs, HOSTS, certs.ca.not_after - days(10))
    back = WebhookCerts.from_secret_data(rotated.to_secret_data(T0))
    assert back == rotated
    with pytest.raises(CertificateError, match="missing"):
        WebhookCerts.from_secret_data({"tls.crt": b"x"})


# ------------------------------------------------------------------------------ the manager


class FakeCertObjects:
    """A Secret and a MutatingWebhookConfiguration in memory, with failure switches."""

    def __init__(self, webhooks: int = 2) -> None:
        self.secret: dict[str, bytes] | None = None
        self.rv = 0
        self.config: dict[str, Any] | None = {
            "metadata": {"name": "kvgate-sidecar-injector"},
            "webhooks": [
                {"name": f"wh{i}.inject.kvgate.io", "clientConfig": {"url": "https://x"}}
                for i in range(webhooks)
            ],
        }
        self.secret_error: int | None = None
        self.write_error: int | None = None
        self.secret_reads = 0
        self.secret_writes = 0
        self.patches: list[list[dict[str, Any]]] = []

    def read_secret(self, namespace: str, name: str) -> tuple[dict[str, bytes], str] | None:
        self.secret_reads += 1
        if self.secret_error:
            raise ApiException(status=self.secret_error, reason="boom")
        return None if self.secret is None else (dict(self.secret), str(self.rv))

    def write_secret(
        self, namespace: str, name: str, data: dict[str, bytes], resource_version: str | None
    ) -> str:
        if self.write_error or self.secret_error:
            raise ApiException(status=self.write_error or self.secret_error, reason="no")
        if (resource_version is None) != (self.secret is None) or (
            resource_version is not None and resource_version != str(self.rv)
        ):
            raise ApiException(status=409, reason="Conflict")
        self.secret_writes += 1
        self.secret = dict(data)
        self.rv += 1
        return str(self.rv)

    def read_webhook_config(self, name: str) -> dict[str, Any] | None:
        return self.config

    def patch_webhook_config(self, name: str, ops: list[dict[str, Any]]) -> None:
        assert self.config is not None
        self.patches.append(ops)
        for op in ops:
            parts = op["path"].strip("/").split("/")
            target: Any = self.config
            for p in parts[:-1]:
                target = target[int(p)] if isinstance(target, list) else target[p]
            if op["op"] == "test":
                assert target[parts[-1]] == op["value"]
            else:
                target[parts[-1]] = op["value"]

    def bundles(self) -> list[str | None]:
        assert self.config is not None
        return [w["clientConfig"].get("caBundle") for w in self.config["webhooks"]]


def manager(
    objects: FakeCertObjects,
    clock: FakeUtcClock,
    namespace: str | None = "kvgate-system",
    lifetimes: Lifetimes = DEFAULT_LIFETIMES,
) -> Any:
    return CertificateManager(
        objects,
        namespace=namespace,
        secret_name="kvgate-webhook-tls",
        webhook_config_name="kvgate-sidecar-injector",
        hosts=HOSTS,
        clock=clock,
        sleep=lambda _: None,
        lifetimes=lifetimes,
    )


def test_first_start_creates_and_stores_then_a_restart_reuses_the_same_ca() -> None:
    objects, clock = FakeCertObjects(), FakeUtcClock(T0)
    m1 = manager(objects, clock)
    assert m1.ensure() == ["created"] and m1.persistent
    assert objects.secret is not None and objects.secret_writes == 1
    assert m1.sync_ca_bundle() is True
    bundle = objects.bundles()
    assert bundle[0] == bundle[1] == base64.b64encode(m1.certs.ca_bundle(T0)).decode()
    # Restart: same CA and serving certificate, nothing written, nothing patched.
    clock.now = T0 + days(3)
    m2 = manager(objects, clock)
    assert m2.ensure() == []
    assert m2.certs == m1.certs
    assert m2.sync_ca_bundle() is False
    assert objects.secret_writes == 1 and len(objects.patches) == 1


def test_ca_bundle_is_patched_only_where_it_differs() -> None:
    objects, clock = FakeCertObjects(webhooks=3), FakeUtcClock(T0)
    m = manager(objects, clock)
    m.ensure()
    want = base64.b64encode(m.certs.ca_bundle(T0)).decode()
    assert objects.config is not None
    objects.config["webhooks"][1]["clientConfig"]["caBundle"] = want
    assert m.sync_ca_bundle() is True
    paths = [op["path"] for op in objects.patches[0]]
    assert paths == [
        "/webhooks/0/name",
        "/webhooks/0/clientConfig/caBundle",
        "/webhooks/2/name",
        "/webhooks/2/clientConfig/caBundle",
    ]
    assert objects.bundles() == [want] * 3
    assert m.sync_ca_bundle() is False and len(objects.patches) == 1
    # A Helm upgrade resets one: only that one is patched back.
    objects.config["webhooks"][2]["clientConfig"]["caBundle"] = ""
    assert m.sync_ca_bundle() is True
    assert [op["path"] for op in objects.patches[1]] == [
        "/webhooks/2/name",
        "/webhooks/2/clientConfig/caBundle",
    ]


def test_ca_bundle_patch_adds_a_missing_client_config() -> None:
    ops = ca_bundle_patch({"webhooks": [{"name": "a"}]}, "Zm9v")
    assert ops == [
        {"op": "test", "path": "/webhooks/0/name", "value": "a"},
        {"op": "add", "path": "/webhooks/0/clientConfig", "value": {}},
        {"op": "add", "path": "/webhooks/0/clientConfig/caBundle", "value": "Zm9v"},
    ]
    assert (
        ca_bundle_patch({"webhooks": [{"name": "a", "clientConfig": {"caBundle": "x"}}]}, "x") == []
    )


def test_missing_configuration_is_not_an_error() -> None:
    objects, clock = FakeCertObjects(), FakeUtcClock(T0)
    objects.config = None
    m = manager(objects, clock)
    m.ensure()
    assert m.sync_ca_bundle() is False


def test_rotation_stores_and_patches_the_bundle_before_serving_the_new_ca() -> None:
    objects, clock = FakeCertObjects(), FakeUtcClock(T0)
    m = manager(objects, clock)
    m.ensure()
    m.sync_ca_bundle()
    first_ca = m.certs.ca
    # Walk through a year and a half of daily checks.
    served_by_untrusted = 0
    for _ in range(540):
        clock.now += days(1)
        m.check()
        bundle = x509.load_pem_x509_certificates(base64.b64decode(objects.bundles()[0] or ""))
        if not any(signed_by(m.certs.serving.cert, c) for c in bundle):
            served_by_untrusted += 1
    assert served_by_untrusted == 0
    assert m.certs.ca != first_ca
    stored = WebhookCerts.from_secret_data(objects.secret or {})
    assert stored == m.certs
    # The bundle was patched exactly at CA rotations and expiries, never otherwise.
    assert 1 < len(objects.patches) <= 5


def test_forbidden_secret_falls_back_to_memory_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    objects, clock = FakeCertObjects(), FakeUtcClock(T0)
    objects.secret_error = 403
    m = manager(objects, clock)
    assert m.ensure() == ["created"]
    assert not m.persistent and objects.secret_writes == 0 and objects.secret_reads == 1
    assert "keeping them in memory" in caplog.text
    assert m.sync_ca_bundle() is True  # the caBundle still gets our CA
    # Access granted later: the next check stores ours.
    objects.secret_error = None
    clock.now += days(1)
    m.check()
    assert m.persistent and objects.secret is not None
    assert WebhookCerts.from_secret_data(objects.secret) == m.certs


def test_transient_errors_at_start_are_retried_before_giving_up_on_the_secret() -> None:
    objects, clock = FakeCertObjects(), FakeUtcClock(T0)
    existing = manager(objects, clock)
    existing.ensure()
    calls = {"n": 0}
    real = objects.read_secret

    def flaky(namespace: str, name: str) -> Any:
        calls["n"] += 1
        if calls["n"] < 3:
            raise ApiException(status=503, reason="Unavailable")
        return real(namespace, name)

    objects.read_secret = flaky  # type: ignore[method-assign]
    m = manager(objects, clock)
    assert m.ensure() == [] and m.certs == existing.certs and m.persistent


def test_write_forbidden_keeps_memory_certificates(caplog: pytest.LogCaptureFixture) -> None:
    objects, clock = FakeCertObjects(), FakeUtcClock(T0)
    objects.write_error = 403
    m = manager(objects, clock)
    assert m.ensure() == ["created"]
    assert not m.persistent and objects.secret is None
    assert "cannot write" in caplog.text


def test_unusable_secret_is_replaced(caplog: pytest.LogCaptureFixture) -> None:
    objects, clock = FakeCertObjects(), FakeUtcClock(T0)
    objects.secret = {"tls.crt": b"garbage", "tls.key": b"x", "ca.crt": b"y", "ca.key": b"z"}
    m = manager(objects, clock)
    assert m.ensure() == ["created"]
    assert "unusable" in caplog.text
    assert WebhookCerts.from_secret_data(objects.secret or {}) == m.certs


def test_no_namespace_means_memory_only() -> None:
    objects, clock = FakeCertObjects(), FakeUtcClock(T0)
    m = manager(objects, clock, namespace=None)
    assert m.ensure() == ["created"] and not m.persistent and objects.secret_reads == 0
    clock.now += days(70)
    assert m.check() == ["serving_rotated"] and objects.secret_reads == 0


def test_conflict_on_create_adopts_the_stored_certificates() -> None:
    objects, clock = FakeCertObjects(), FakeUtcClock(T0)
    other = manager(objects, clock)
    m = manager(objects, clock)
    objects.secret_error = None
    # m reads "absent", then other creates, then m's create conflicts.
    real = objects.read_secret
    first = {"done": False}

    def racing(namespace: str, name: str) -> Any:
        if not first["done"]:
            first["done"] = True
            got = real(namespace, name)
            other.ensure()
            return got
        return real(namespace, name)

    objects.read_secret = racing  # type: ignore[method-assign]
    m.ensure()
    assert m.certs == other.certs and objects.secret_writes == 1


def test_write_files_are_private_and_complete(tmp_path: Path) -> None:
    objects, clock = FakeCertObjects(), FakeUtcClock(T0)
    m = manager(objects, clock)
    m.ensure()
    cert, key = m.write_files(tmp_path / "tls")
    assert cert.read_bytes() == m.certs.serving.cert_pem
    assert key.read_bytes() == m.certs.serving.key_pem
    assert (tmp_path / "tls").stat().st_mode & 0o077 == 0
    assert key.stat().st_mode & 0o077 == 0


def test_a_follower_serves_the_leaders_certificates_and_writes_nothing() -> None:
    """Leader election: a follower reads the Secret only (never writes it nor the caBundle),
    serves in-memory certificates until the leader stored some, then adopts each rotation."""
    objects, clock = FakeCertObjects(), FakeUtcClock(T0)
    follower = manager(objects, clock)
    assert follower.follow() == [] and follower.certs is None  # no Secret yet
    follower.provisional()
    assert follower.certs is not None and not follower.persistent
    leader = manager(objects, clock)
    assert leader.ensure() == ["created"]
    assert follower.follow() == ["adopted_stored"] and follower.certs == leader.certs
    assert follower.follow() == []  # unchanged
    clock.now = T0 + days(61)  # the serving certificate is due: the leader renews it
    assert leader.check() == ["serving_rotated"]
    assert follower.follow() == ["adopted_stored"] and follower.certs == leader.certs
    assert objects.secret_writes == 2 and len(objects.patches) == 0  # all by the leader


def test_a_follower_that_comes_to_lead_renews_its_provisional_certificates_on_schedule() -> None:
    """A follower that found no Secret serves provisional certificates; they have the configured
    lifetimes (not the defaults), so once it leads it rotates them when they are due."""
    s = dt.timedelta(seconds=1)
    lt = Lifetimes(ca=14 * s, ca_renew_before=8 * s, serving=8 * s, serving_renew_before=6 * s)
    objects, clock = FakeCertObjects(), FakeUtcClock(T0)
    m = manager(objects, clock, lifetimes=lt)
    assert m.follow() == []
    m.provisional()
    assert m.certs.serving.remaining(T0) == 8 * s and m.certs.ca.remaining(T0) == 14 * s
    assert m.check() == []  # comes to lead: stores them, nothing due yet
    assert objects.secret_writes == 1
    clock.now = T0 + 3 * s  # 5 s left on the serving certificate: due
    assert "serving_rotated" in m.check()


def test_a_follower_keeps_its_certificates_when_the_api_server_does_not_answer() -> None:
    """urllib3's own errors (not OSErrors, not wrapped by the kubernetes client) reach
    ``follow``: they keep the current certificates, as an error answer does."""
    from urllib3.exceptions import MaxRetryError, ReadTimeoutError

    objects, clock = FakeCertObjects(), FakeUtcClock(T0)
    leader, follower = manager(objects, clock), manager(objects, clock)
    leader.ensure()
    assert follower.follow() == ["adopted_stored"]
    kept = follower.certs
    for exc in (
        MaxRetryError(None, "/api", reason=ConnectionRefusedError()),  # type: ignore[arg-type]
        ReadTimeoutError(None, "/api", "read timed out"),  # type: ignore[arg-type]
        ConnectionResetError(),
    ):

        def fail(namespace: str, name: str, exc: Exception = exc) -> None:
            raise exc

        objects.read_secret = fail  # type: ignore[method-assign]
        assert follower.follow() == [] and follower.certs is kept


def test_no_api_server_at_start_leaves_in_memory_certificates_not_a_crash(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The real KubeCertObjects against a port where nothing listens (connections refused: urllib3's
    MaxRetryError): the leader's start retries, then serves in-memory certificates; the
    caBundle sync and a follower's refresh log and return."""
    from kubernetes import client

    from kvgate_operator.cert_objects import KubeCertObjects

    api = client.ApiClient(client.Configuration(host="https://127.0.0.1:1"))
    objects = KubeCertObjects(api, timeout=2)
    with pytest.raises(ApiException) as no_answer:
        objects.read_secret("kvgate-system", "kvgate-webhook-tls")
    assert no_answer.value.status == 0
    m = manager(objects, FakeUtcClock(T0))  # type: ignore[arg-type]
    assert m.ensure(start_retries=1) == ["created"]
    assert m.certs is not None and not m.persistent
    assert not m.sync_ca_bundle()
    assert m.follow() == []
    assert "no answer from the API server" in caplog.text
