"""What the front doors share to keep strangers out: the API key check and the TLS certificate.

    bearer_matches("bearer s3cret", "s3cret") -> True   (RFC 7235: the scheme is case-insensitive)
    tls = load_tls(Path("cert.pem"), Path("key.pem"))   # TlsError naming the file when it cannot be used
    tls.grpc_credentials()                               # for grpc.aio.Server.add_secure_port
    tls.ssl_context()                                    # for the WebSocket server (wss://)
"""

from __future__ import annotations

import argparse
import hmac
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

BEARER = "bearer"


def bearer_matches(header: str | None, key: str) -> bool:
    """Whether an Authorization value is `Bearer KEY` (the scheme in any case). The key is compared in constant
    time, so the time an answer takes says nothing about how much of a guess was right."""
    scheme, _, token = (header or "").strip().partition(" ")
    given = token.strip().encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, key.encode("utf-8")) and scheme.lower() == BEARER


class TlsError(ValueError):
    """A certificate or key that cannot be used; the message names the file."""


@dataclass(frozen=True)
class Tls:
    """A PEM certificate chain and its private key, read and checked to belong together."""

    cert: Path
    key: Path
    cert_pem: bytes
    key_pem: bytes

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)])

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert, self.key)
        return context


def load_tls(cert: Path | None, key: Path | None) -> Tls | None:
    """The pair `--tls-cert` and `--tls-key` name (None when neither is given); TlsError when only one is, or when
    they cannot be read or do not match, before any server starts."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise TlsError("--tls-cert and --tls-key go together: give the certificate (PEM) and its private key")
    pems = {}
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        try:
            pems[flag] = Path(path).read_bytes()
        except OSError as exc:
            raise TlsError(f"{flag} {path}: {exc.strerror or exc}") from None
    tls = Tls(Path(cert), Path(key), pems["--tls-cert"], pems["--tls-key"])
    try:
        tls.ssl_context()
    except ssl.SSLError as exc:
        raise TlsError(f"--tls-cert {cert} with --tls-key {key}: not a PEM certificate and its private key "
                       f"({exc.reason or exc})") from None
    return tls


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    """--tls-cert and --tls-key: the front doors (gRPC and WebSocket) speak TLS with this certificate."""
    parser.add_argument("--tls-cert", type=Path, default=None, metavar="PEM",
                        help="serve the gRPC and WebSocket front doors over TLS with this certificate chain (PEM; "
                             "with --tls-key)")
    parser.add_argument("--tls-key", type=Path, default=None, metavar="PEM", help="the certificate's private key")
