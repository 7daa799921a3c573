"""TLS for every Tandem port, one set of flags for all roles (`--tls-cert`, `--tls-key`, `--tls-ca`).

- Internal hops (router -> prefill/decode, prefill -> decode) are mutual TLS: each worker's gRPC server asks every
  client for a certificate signed by `--tls-ca` and refuses the handshake otherwise (a plaintext client, or one
  whose certificate another CA signed); each client presents its own `--tls-cert` and checks the server's
  certificate against the same CA and the address it dialled (so certificates name the hosts others use: the
  compose service names, 127.0.0.1 for `tandem up`).
- The router's public fronts (the OpenAI HTTP API and the tandem.v1.Generate gRPC API) serve TLS with the same
  certificate; clients are not asked for one (they authenticate with an API key, not a certificate).
- The workers' Prometheus ports stay plain HTTP (scrapers inside the mesh; see docs/operations.md).

Without the three flags everything is plaintext, as before. Giving some of them but not all is an error at start-up,
so a half-configured process never falls back to plaintext silently.
"""
from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsConfig:
    cert: str
    """PEM certificate chain of this process (server and client certificate alike)."""
    key: str
    """PEM private key of `cert`."""
    ca: str
    """PEM certificates of the CA that signs every Tandem process's certificate (peers are checked against it)."""

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            path = Path(getattr(self, name))
            if not path.is_file():
                raise ValueError(f"--tls-{name}={str(path)!r}: no such file")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> TlsConfig | None:
        """The flags' TLS config; None when none of them is given. ValueError names the flags missing."""
        given = {n: getattr(ns, f"tls_{n}", None) for n in ("cert", "key", "ca")}
        if not any(given.values()):
            return None
        missing = [f"--tls-{n}" for n, v in given.items() if not v]
        if missing:
            raise ValueError(f"{', '.join(missing)}: TLS needs --tls-cert, --tls-key and --tls-ca together "
                             "(mutual TLS between Tandem processes)")
        return cls(**given)

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return Path(self.cert).read_bytes(), Path(self.key).read_bytes(), Path(self.ca).read_bytes()

    def server_credentials(self, require_client_auth: bool = True) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=require_client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def client_ssl_context(self) -> ssl.SSLContext:
        """An HTTPS client context trusting the CA and presenting this process's certificate."""
        ctx = ssl.create_default_context(cafile=self.ca)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx


def add_tls_args(p: argparse.ArgumentParser) -> None:
    """The TLS flags of every role (declared once, here)."""
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="this process's certificate: TLS on its ports, and its client certificate for mutual TLS "
                        "to other Tandem processes (with --tls-key and --tls-ca; default: plaintext)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="the CA that signs every Tandem process's certificate: peers are checked against it")


def tls_flags(ns: argparse.Namespace) -> list[str]:
    """The TLS flags as given, to pass on to child processes (`tandem up`)."""
    out = []
    for name in ("cert", "key", "ca"):
        value = getattr(ns, f"tls_{name}", None)
        if value:
            out += [f"--tls-{name}", str(Path(value).resolve())]
    return out
