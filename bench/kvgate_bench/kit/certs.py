"""Test certificates over ``cryptography``: a CA, leaf certificates it signs, an RSA key pair.

The kit's own, so that it needs nothing of the operator (whose :mod:`kvgate_operator.pki` is the
product's, with its rotation rules): the local control plane's certificates
(:mod:`kvgate_bench.kit.kubefiles`) and a TLS ``redis-server``'s
(:mod:`kvgate_bench.kit.redisserver`). Keys are ECDSA P-256 (RSA 2048 for a service-account
key), signatures SHA-256, PEM throughout; every certificate starts an hour before ``now`` (a
child whose clock lags accepts it).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: Certificates start this long before ``now``.
BACKDATE = dt.timedelta(hours=1)


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, both PEM bytes."""

    cert_pem: bytes
    key_pem: bytes = field(repr=False)


def _key_pem(key: PrivateKeyTypes) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(host: str) -> x509.GeneralName:
    """An IP SAN for an IP address, else a DNS SAN."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


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


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey, now: dt.datetime
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
    )


def new_ca(now: dt.datetime, *, common_name: str, lifetime: dt.timedelta) -> KeyPair:
    """A self-signed CA that signs leaf certificates only, valid until ``now + lifetime``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        _builder(name, name, key, now)
        .not_valid_after(now + lifetime)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


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
    """A leaf certificate signed by ``ca`` (made by :func:`new_ca`), valid until ``now +
    lifetime``, with key usage and key identifiers as strict verifiers (OpenSSL's
    ``X509_STRICT``) ask: subject ``organizations`` (e.g. ``system:masters``) and ``common_name``,
    subject alternative names ``hosts`` (IPs or DNS names), extended key usages ``serverAuth``
    / ``clientAuth`` as asked."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
    subject.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    builder = (
        _builder(x509.Name(subject), ca_cert.subject, key, now)
        .not_valid_after(now + lifetime)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
    usages += [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if hosts:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False
        )
    cert = builder.sign(ca_key, hashes.SHA256())
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def new_rsa_key_pems(key_size: int = 2048) -> tuple[bytes, bytes]:
    """A new RSA key (``key_size`` bits) as ``(private PKCS#8 PEM, public SubjectPublicKeyInfo
    PEM)``: a service-account signing key."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=key_size)
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return _key_pem(key), public
