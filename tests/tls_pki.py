"""Throwaway certificates for the TLS tests (trustme makes the CAs)."""
from __future__ import annotations

from pathlib import Path

from serving.tls import TlsConfig


def write_identity(ca, directory: Path, name: str) -> TlsConfig:
    """A certificate for 127.0.0.1/localhost signed by `ca` (a trustme.CA), written as PEM files under directory,
    with the CA's certificate beside them."""
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    directory.mkdir(parents=True, exist_ok=True)
    cert, key, ca_path = directory / f"{name}.crt", directory / f"{name}.key", directory / "ca.crt"
    cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    key.write_bytes(leaf.private_key_pem.bytes())
    ca.cert_pem.write_to_path(str(ca_path))
    return TlsConfig(str(cert), str(key), str(ca_path))


def make_pki(root: Path) -> dict[str, TlsConfig]:
    """Two CAs: ours signs `server` and `client`; another signs `stranger`."""
    import trustme

    ours, theirs = trustme.CA(), trustme.CA()
    return {"server": write_identity(ours, root / "ours", "server"),
            "client": write_identity(ours, root / "ours", "client"),
            "stranger": write_identity(theirs, root / "theirs", "client")}
