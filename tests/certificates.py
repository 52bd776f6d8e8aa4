"""Certificates made at test time: a self-signed one, and a CA with server and client certificates
it signed (mutual TLS), all for 127.0.0.1 and localhost."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

HOSTS = x509.SubjectAlternativeName(
    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
)


@dataclass(frozen=True)
class Pem:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pem:
    pem = Pem(directory / f"{stem}.crt", directory / f"{stem}.key")
    pem.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return pem


def _builder(subject: str, issuer: str, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def self_signed(directory: Path, stem: str = "self-signed") -> Pem:
    """A self-signed server certificate for 127.0.0.1 and localhost."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder("pdserve-test", "pdserve-test", key)
        .add_extension(HOSTS, critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return _write(directory, stem, cert, key)


@dataclass(frozen=True)
class Authority:
    """A CA and one certificate it signed for both ends (server and client) of mutual TLS."""

    ca: Path
    service: Pem


def authority(directory: Path) -> Authority:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        _builder("pdserve-test-ca", "pdserve-test-ca", ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca = _write(directory, "ca", ca_cert, ca_key)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder("pdserve-service", "pdserve-test-ca", key)
        .add_extension(HOSTS, critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return Authority(ca.cert, _write(directory, "service", cert, key))
