"""X.509 building and checking over ``cryptography``: CAs, leaf certificates, key encoding.

Pure: no I/O, the clock is an argument. Invariant: every key is new and every certificate
starts :data:`BACKDATE` before ``now`` (so a client whose clock lags accepts it) and never
outlives the CA that signed it. Certificate keys are ECDSA P-256, signatures SHA-256.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes, PublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

BACKDATE = dt.timedelta(hours=1)
"""Certificates start this long before ``now``."""


class CertificateError(ValueError):
    """Certificate material that cannot be used (unparseable, mismatched, not a CA)."""


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, both PEM."""

    cert_pem: bytes
    key_pem: bytes = field(repr=False)

    @cached_property
    def cert(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)

    @property
    def not_after(self) -> dt.datetime:
        """The end of the certificate's validity (UTC, aware)."""
        return self.cert.not_valid_after_utc

    def remaining(self, now: dt.datetime) -> dt.timedelta:
        return self.not_after - now

    def validate(self, *, ca: bool) -> None:
        """Raise :class:`CertificateError` unless the key matches the certificate (and the
        certificate is a CA when ``ca``)."""
        try:
            key = serialization.load_pem_private_key(self.key_pem, password=None)
            cert = self.cert
        except ValueError as exc:
            raise CertificateError(f"unparseable certificate or key: {exc}") from exc
        if _spki(key.public_key()) != _spki(cert.public_key()):
            raise CertificateError("the private key does not match the certificate")
        if ca:
            try:
                bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
            except x509.ExtensionNotFound:
                bc = None
            if bc is None or not bc.ca:
                raise CertificateError("the CA certificate is not a CA")


def _spki(public_key: PublicKeyTypes) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def private_key_pem(key: PrivateKeyTypes) -> bytes:
    """``key`` as unencrypted PKCS#8 PEM."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def new_rsa_key_pems(key_size: int = 2048) -> tuple[bytes, bytes]:
    """A new RSA key (``key_size`` bits) as ``(private PKCS#8 PEM, public SubjectPublicKeyInfo
    PEM)``, e.g. a service-account signing key."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=key_size)
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return private_key_pem(key), public


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def san(host: str) -> x509.GeneralName:
    """``host`` as a subject alternative name: an IP SAN for an IP address, else a DNS SAN."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def new_ca(now: dt.datetime, *, common_name: str, lifetime: dt.timedelta) -> KeyPair:
    """A self-signed CA (``path_length`` 0: it signs leaf certificates only) valid from
    ``now - BACKDATE`` to ``now + lifetime``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + lifetime)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), private_key_pem(key))


def issue(
    ca: KeyPair,
    now: dt.datetime,
    lifetime: dt.timedelta,
    *,
    common_name: str,
    organizations: Sequence[str] = (),
    hosts: Sequence[str] = (),
    server: bool = False,
    client: bool = False,
) -> KeyPair:
    """A leaf certificate signed by ``ca``, valid from ``now - BACKDATE`` for ``lifetime`` but
    never past the CA's own end.

    Args:
        common_name: the subject's CN (at most 64 characters).
        organizations: the subject's O attributes (e.g. ``system:masters`` for a Kubernetes
            client certificate), before the CN.
        hosts: subject alternative names (see :func:`san`); none: no SAN extension.
        server, client: the extended key usages ``serverAuth`` / ``clientAuth``; neither: no
            extended key usage extension.

    Raises:
        CertificateError: ``ca``'s key is not an ECDSA key.
    """
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise CertificateError("the CA key is not an ECDSA key")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
    subject.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
    usages += [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(subject))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(min(now + lifetime, ca.not_after))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
    )
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if hosts:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([san(h) for h in hosts]), critical=False
        )
    cert = builder.add_extension(
        x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
    ).sign(ca_key, hashes.SHA256())
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), private_key_pem(key))


def sans(cert: x509.Certificate) -> set[str]:
    """A certificate's subject alternative names as strings (IPs normalised)."""
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(n) for n in ext.get_values_for_type(x509.IPAddress)} | set(
        ext.get_values_for_type(x509.DNSName)
    )


def normalised_hosts(hosts: Iterable[str]) -> set[str]:
    """``hosts`` as :func:`sans` would give them back from a certificate."""
    out = set()
    for h in hosts:
        name = san(h)
        out.add(str(name.value) if isinstance(name, x509.IPAddress) else h)
    return out


def signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    """Whether ``ca`` issued ``cert`` (issuer name and signature)."""
    if cert.issuer != ca.subject:
        return False
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def split_pem_certs(data: bytes) -> list[bytes]:
    """Each certificate of a PEM bundle, as its own PEM.

    Raises:
        ValueError: ``data`` is not blank and is not a bundle of parseable certificates.
    """
    out = []
    for cert in x509.load_pem_x509_certificates(data) if data.strip() else []:
        out.append(cert.public_bytes(serialization.Encoding.PEM))
    return out
