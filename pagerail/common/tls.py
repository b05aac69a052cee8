"""TLS material: mutual trust for the head-to-worker gRPC link, and the public gRPC port's certificate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

_PEM_MARKER = b"-----BEGIN "


def _read_pem(path: str | Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read TLS {what} from {path}: {error.strerror or error}") from error
    if _PEM_MARKER not in data:
        raise ValueError(f"TLS {what} at {path} is not PEM (no '-----BEGIN' line)")
    return data


@dataclass(frozen=True)
class TlsConfig:
    """PEM bytes (not paths) so the config can be shipped to a worker on another node unchanged."""

    cert_chain: bytes
    private_key: bytes
    # The CA that signed the peers' certificates; a server uses it to check the clients' ones too.
    root_certificates: bytes

    def __post_init__(self) -> None:
        for name in ("cert_chain", "private_key", "root_certificates"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or _PEM_MARKER not in value:
                raise ValueError(f"TlsConfig.{name} must be PEM bytes, got {type(value).__name__}")

    def __repr__(self) -> str:
        # Never print the private key, not even in a traceback or a log line.
        return (
            f"TlsConfig(cert_chain=<{len(self.cert_chain)} bytes>, private_key=<hidden>, "
            f"root_certificates=<{len(self.root_certificates)} bytes>)"
        )

    @classmethod
    def from_files(cls, cert: str | Path, key: str | Path, ca: str | Path) -> TlsConfig:
        """Read a certificate chain, its private key and the peers' CA from PEM files."""
        return cls(
            cert_chain=_read_pem(cert, "certificate"),
            private_key=_read_pem(key, "private key"),
            root_certificates=_read_pem(ca, "CA certificate"),
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials for a worker's server; its clients authenticate with the bearer token."""
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)], root_certificates=self.root_certificates
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for a client that trusts servers signed by `root_certificates` and presents its own cert."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.cert_chain,
        )


@dataclass(frozen=True)
class ServerTls:
    """TLS of a public server (the frontend's gRPC port): its certificate chain and key, as PEM bytes so the
    settings can travel to the process that serves, and optionally the CA that client certificates must chain to
    (then every client must present one)."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None

    def __post_init__(self) -> None:
        for name in ("cert_chain", "private_key", "client_ca"):
            value = getattr(self, name)
            if value is None and name == "client_ca":
                continue
            if not isinstance(value, bytes) or _PEM_MARKER not in value:
                raise ValueError(f"ServerTls.{name} must be PEM bytes, got {type(value).__name__}")

    def __repr__(self) -> str:
        client_ca = "None" if self.client_ca is None else f"<{len(self.client_ca)} bytes>"
        return f"ServerTls(cert_chain=<{len(self.cert_chain)} bytes>, private_key=<hidden>, client_ca={client_ca})"

    @classmethod
    def from_files(cls, cert: str | Path, key: str | Path, client_ca: str | Path | None = None) -> ServerTls:
        """Read the certificate chain, its private key and, when given, the clients' CA from PEM files."""
        return cls(
            cert_chain=_read_pem(cert, "certificate"),
            private_key=_read_pem(key, "private key"),
            client_ca=None if client_ca is None else _read_pem(client_ca, "client CA certificate"),
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )
