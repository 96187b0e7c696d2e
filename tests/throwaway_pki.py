"""A throwaway PKI for TLS tests: a CA (and an unrelated second one) that issue leaf
certificates for servers and clients alike, written as PEM files into a folder; and a
health check over given TLS settings."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.grpc_server import open_sync_channel
from common.tls import TlsSettings


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _save(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _builder(subject: str, issuer: x509.Name, key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


@dataclass(frozen=True)
class Authority:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    path: Path  # the CA certificate's PEM file

    @classmethod
    def create(cls, folder: Path, name: str) -> Authority:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            _builder(name, _name(name), key)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        _save(folder / name, key, cert)
        return cls(key, cert, folder / f"{name}.pem")

    def issue(
        self, folder: Path, name: str, sans: list[x509.GeneralName] | None = None
    ) -> tuple[str, str]:
        """A leaf for servers and clients alike; returns (cert file, key file)."""
        key = ec.generate_private_key(ec.SECP256R1())
        if sans is None:
            sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        cert = (
            _builder(name, self.cert.subject, key)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        _save(folder / name, key, cert)
        return str(folder / f"{name}.pem"), str(folder / f"{name}.key")


@dataclass(frozen=True)
class Pki:
    ca: Authority
    other_ca: Authority
    service: tuple[str, str]  # every Tandem process
    client: tuple[str, str]  # the test's clients
    rogue: tuple[str, str]  # issued by the other CA

    def tls(self, identity: tuple[str, str] | None, ca: Authority | None = None) -> TlsSettings:
        cert, key = identity or (None, None)
        return TlsSettings(cert_file=cert, key_file=key, ca_file=str((ca or self.ca).path))

    def env(self) -> dict[str, str]:
        return {
            "TANDEM_TLS_CERT": self.service[0],
            "TANDEM_TLS_KEY": self.service[1],
            "TANDEM_TLS_CA": str(self.ca.path),
            "TANDEM_TLS_CLIENT_AUTH": "1",
        }


def make_pki(folder: Path) -> Pki:
    """Both CAs and the service, client and rogue (other CA) identities, in `folder`."""
    ca = Authority.create(folder, "ca")
    other = Authority.create(folder, "other-ca")
    return Pki(
        ca=ca,
        other_ca=other,
        service=ca.issue(folder, "service"),
        client=ca.issue(folder, "client"),
        rogue=other.issue(folder, "rogue"),
    )


def check_health(address: str, tls: TlsSettings) -> str:
    """The Health status over `tls`, or the gRPC status code's name when the call fails."""
    try:
        with open_sync_channel(address, tls) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as exc:
        return exc.code().name
