"""Test certificates made in the test (the `cryptography` package): one CA, a server
certificate for 127.0.0.1/localhost, and a client certificate, as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _cert(subject: str, key, issuer_name, issuer_key, *, ca: bool, usage=None, sans=()):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert=None, key=None) -> Path:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return path


def make_certs(directory: Path) -> CertFiles:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("stepahead test CA", ca_key, _name("stepahead test CA"), ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _cert("localhost", server_key, ca.subject, ca_key, ca=False, usage=ExtendedKeyUsageOID.SERVER_AUTH,
                   sans=(x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))))
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _cert("stepahead client", client_key, ca.subject, ca_key, ca=False,
                   usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    return CertFiles(
        ca=_write(directory / "ca.pem", ca),
        server_cert=_write(directory / "server.pem", server), server_key=_write(directory / "server.key", key=server_key),
        client_cert=_write(directory / "client.pem", client), client_key=_write(directory / "client.key", key=client_key),
    )
