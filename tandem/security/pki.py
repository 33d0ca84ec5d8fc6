"""Certificates for Tandem's TLS: a throw-away cluster CA and the certificates it signs.

The local launcher (``tandem serve`` / ``tandem demo``) and ``tandem ray up``
create one CA per cluster and one *member* certificate signed by it, which every
process of the cluster (router and workers) presents, as server and as client.
A worker accepts a caller only if its certificate chains to the cluster CA
(mutual TLS), so a process without the member key cannot call ``Prefill`` or
``Decode`` or read ``Status``.

Members run on addresses known only at run time (ports the OS picks, Ray node
IPs), so clients check the name ``CLUSTER_SERVER_NAME`` in the certificate
instead of the address they dialled (gRPC's ``ssl_target_name_override``):
membership of the cluster CA is the identity that matters inside the cluster.

EC P-256 keys: fast to make (milliseconds), so a per-run CA costs nothing.
Operators who bring their own CA and certificates skip all of this.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass

CLUSTER_SERVER_NAME = "tandem-cluster"


@dataclass(frozen=True)
class KeyPair:
    cert: bytes  # PEM
    key: bytes  # PEM, unencrypted PKCS#8


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def make_ca(common_name: str = "Tandem cluster CA", days: int = 365) -> KeyPair:
    """A self-signed CA that may sign leaf certificates only (path length 0)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(_cert_pem(cert), _key_pem(key))


def issue(
    ca: KeyPair,
    common_name: str,
    dns_names: tuple[str, ...] = (),
    ip_addresses: tuple[str, ...] = (),
    days: int = 365,
) -> KeyPair:
    """A leaf certificate signed by ``ca``, valid for TLS servers and clients alike."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
    now = _now()
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return KeyPair(_cert_pem(cert), _key_pem(key))


def cluster_member(ca: KeyPair) -> KeyPair:
    """The certificate every process of one cluster presents (see the module docstring)."""
    return issue(
        ca,
        "tandem cluster member",
        dns_names=(CLUSTER_SERVER_NAME, "localhost"),
        ip_addresses=("127.0.0.1", "::1"),
    )


def _cert_pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
