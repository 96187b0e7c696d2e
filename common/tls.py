"""TLS and mutual TLS for every Tandem connection, configured by environment variables that
every process reads the same way:

- `TANDEM_TLS_CERT`, `TANDEM_TLS_KEY`: this process's PEM certificate (chain) and private
  key. Servers serve TLS with them; clients present them as their identity under mTLS.
- `TANDEM_TLS_CA`: PEM CA bundle that peers' certificates are checked against (clients
  check servers with it; servers check clients with it under client auth). Unset: clients
  trust the system's roots.
- `TANDEM_TLS_CLIENT_AUTH`: true = mutual TLS, servers require a client certificate
  signed by `TANDEM_TLS_CA` (and clients present theirs).
- `TANDEM_TLS_SERVER_NAME`: the name clients check servers' certificates against instead
  of the host they dial (for certificates that do not list the address).

Nothing set: plaintext, the default. `TlsSettings` validates the combination and the files
(readable, PEM, the key matching the certificate) up front and raises ValueError naming the
variable; it then hands out grpc credentials and `ssl` contexts.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc

CERT_ENV = "TANDEM_TLS_CERT"
KEY_ENV = "TANDEM_TLS_KEY"
CA_ENV = "TANDEM_TLS_CA"
CLIENT_AUTH_ENV = "TANDEM_TLS_CLIENT_AUTH"
SERVER_NAME_ENV = "TANDEM_TLS_SERVER_NAME"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _read(path: str, variable: str) -> bytes:
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as exc:
        raise ValueError(f"{variable}: cannot read {path!r}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{variable}: {path!r} is not a PEM file")
    return data


def _no_password() -> bytes:
    raise ValueError("encrypted private keys are not supported")


@dataclass(frozen=True)
class TlsSettings:
    """Paths of this process's TLS material; all None = plaintext."""

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    client_auth: bool = False
    server_name: str | None = None
    # The files' contents, read (and checked) once by __post_init__.
    _pem: dict[str, bytes] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.cert_file and not self.key_file:
            raise ValueError(f"{CERT_ENV} is set but {KEY_ENV} is not: a certificate needs its key")
        if self.key_file and not self.cert_file:
            raise ValueError(f"{KEY_ENV} is set but {CERT_ENV} is not: a key needs its certificate")
        if self.client_auth and not self.ca_file:
            raise ValueError(
                f"{CLIENT_AUTH_ENV} needs {CA_ENV}: the CA that client certificates must be "
                "signed by"
            )
        if self.client_auth and not self.cert_file:
            raise ValueError(
                f"{CLIENT_AUTH_ENV} needs {CERT_ENV} and {KEY_ENV}: under mutual TLS every "
                "process presents its own certificate"
            )
        if self.server_name is not None and not self.server_name.strip():
            raise ValueError(f"{SERVER_NAME_ENV} must not be blank")
        if self.server_name and not self.enabled:
            raise ValueError(
                f"{SERVER_NAME_ENV} is set but TLS is off: set {CA_ENV} or {CERT_ENV}/{KEY_ENV}"
            )
        if self.cert_file:
            self._pem["cert"] = _read(self.cert_file, CERT_ENV)
            self._pem["key"] = _read(self.key_file, KEY_ENV)
            try:
                ssl.create_default_context().load_cert_chain(
                    self.cert_file, self.key_file, password=_no_password
                )
            except (ssl.SSLError, ValueError) as exc:
                raise ValueError(
                    f"{CERT_ENV}/{KEY_ENV}: {self.cert_file!r} and {self.key_file!r} are not a "
                    f"PEM certificate and its unencrypted private key ({exc})"
                ) from None
        if self.ca_file:
            self._pem["ca"] = _read(self.ca_file, CA_ENV)
            try:
                ssl.create_default_context(cafile=self.ca_file)
            except ssl.SSLError as exc:
                raise ValueError(
                    f"{CA_ENV}: {self.ca_file!r} holds no usable PEM CA certificate ({exc})"
                ) from None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TlsSettings:
        """The settings in `env` (default: this process's environment); empty = unset."""
        env = os.environ if env is None else env
        raw_auth = env.get(CLIENT_AUTH_ENV, "").strip().lower()
        if raw_auth not in _TRUE + _FALSE:
            raise ValueError(
                f"{CLIENT_AUTH_ENV} must be true or false, got {env[CLIENT_AUTH_ENV]!r}"
            )
        return cls(
            cert_file=env.get(CERT_ENV) or None,
            key_file=env.get(KEY_ENV) or None,
            ca_file=env.get(CA_ENV) or None,
            client_auth=raw_auth in _TRUE,
            server_name=env.get(SERVER_NAME_ENV) or None,
        )

    @property
    def enabled(self) -> bool:
        """Whether connections use TLS (clients: a CA or an identity is configured)."""
        return bool(self.cert_file or self.ca_file)

    @property
    def can_serve(self) -> bool:
        return bool(self.cert_file)

    def _require_server_identity(self) -> None:
        if not self.can_serve:
            raise ValueError(
                f"TLS is on ({CA_ENV} is set) but {CERT_ENV}/{KEY_ENV} are not: a server "
                "needs its own certificate and key"
            )

    def server_credentials(self) -> grpc.ServerCredentials:
        """For `grpc.aio.Server.add_secure_port`: this certificate, and under client auth
        a required client certificate signed by the CA."""
        self._require_server_identity()
        return grpc.ssl_server_credentials(
            [(self._pem["key"], self._pem["cert"])],
            root_certificates=self._pem.get("ca") if self.client_auth else None,
            require_client_auth=self.client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Servers checked against the CA (the system's roots without one); this process's
        certificate presented as its identity when it has one."""
        return grpc.ssl_channel_credentials(
            root_certificates=self._pem.get("ca"),
            private_key=self._pem.get("key"),
            certificate_chain=self._pem.get("cert"),
        )

    def channel_options(self) -> tuple[tuple[str, str], ...]:
        if self.server_name:
            return (("grpc.ssl_target_name_override", self.server_name),)
        return ()

    def client_ssl_context(self) -> ssl.SSLContext:
        """An `ssl` client context with the same rules (HTTPS probes and clients)."""
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context


def tls_from_env() -> TlsSettings:
    """This process's TLS settings (ValueError on a bad combination or file)."""
    return TlsSettings.from_env()
