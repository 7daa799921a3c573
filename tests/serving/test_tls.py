"""TLS on Tandem's gRPC ports with real certificates (trustme makes a throwaway CA): mutual TLS refuses plaintext
clients, clients without a certificate and clients whose certificate another CA signed; the public mode asks for no
client certificate; a half-given set of flags is an error, never a silent fallback to plaintext."""
from __future__ import annotations

import argparse
import asyncio
import socket

import grpc
import pytest

from serving import health
from serving.rpc import add_health_and_reflection, add_port, channel, new_server, set_serving
from serving.tls import TlsConfig, add_tls_args, tls_flags
from tls_pki import make_pki

trustme = pytest.importorskip("trustme")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _check(address: str, ch: grpc.aio.Channel) -> int | grpc.StatusCode:
    try:
        return await health.check_callable(ch)("", timeout=5)
    except grpc.aio.AioRpcError as e:
        return e.code()


def _serve_and_check(server_tls: TlsConfig, require_client_auth: bool, clients: dict) -> dict:
    """Starts a health-serving gRPC server with server_tls; returns what each client's Check got."""
    async def main():
        address = f"127.0.0.1:{_free_port()}"
        server = new_server()
        hs = add_health_and_reflection(server, [])
        add_port(server, address, server_tls, require_client_auth)
        await server.start()
        await set_serving(hs, [], True)
        try:
            out = {}
            for name, make in clients.items():
                async with make(address) as ch:
                    out[name] = await _check(address, ch)
            return out
        finally:
            await server.stop(0)
    return asyncio.run(main())


def _tls_without_client_cert(tls: TlsConfig):
    ca = open(tls.ca, "rb").read()
    return lambda address: grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca))


def test_mutual_tls_admits_our_clients_only(pki):
    got = _serve_and_check(pki["server"], True, {
        "ours": lambda a: channel(a, pki["client"]),
        "plaintext": lambda a: channel(a),
        "no client certificate": _tls_without_client_cert(pki["client"]),
        "another CA's client": lambda a: channel(a, pki["stranger"]),
    })
    assert got["ours"] == health.SERVING, got
    for name in ("plaintext", "no client certificate", "another CA's client"):
        assert got[name] == grpc.StatusCode.UNAVAILABLE, (name, got)


def test_public_tls_asks_no_client_certificate(pki):
    got = _serve_and_check(pki["server"], False, {
        "no client certificate": _tls_without_client_cert(pki["client"]),
        "plaintext": lambda a: channel(a),
    })
    assert got == {"no client certificate": health.SERVING, "plaintext": grpc.StatusCode.UNAVAILABLE}, got


def test_a_client_refuses_a_server_another_ca_signed(pki):
    got = _serve_and_check(pki["stranger"], False, {"ours": lambda a: channel(a, pki["client"])})
    assert got == {"ours": grpc.StatusCode.UNAVAILABLE}, got


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_tls_args(p)
    return p.parse_args(list(argv))


def test_flags_all_or_none(pki, tmp_path):
    c = pki["client"]
    assert TlsConfig.from_cli_args(_parse()) is None
    assert TlsConfig.from_cli_args(_parse("--tls-cert", c.cert, "--tls-key", c.key, "--tls-ca", c.ca)) == c
    with pytest.raises(ValueError, match=r"--tls-key, --tls-ca: TLS needs"):
        TlsConfig.from_cli_args(_parse("--tls-cert", c.cert))
    with pytest.raises(ValueError, match=r"--tls-ca=.*nope.pem.*: no such file"):
        TlsConfig.from_cli_args(_parse("--tls-cert", c.cert, "--tls-key", c.key, "--tls-ca", str(tmp_path / "nope.pem")))
    flags = tls_flags(_parse("--tls-cert", c.cert, "--tls-key", c.key, "--tls-ca", c.ca))
    assert flags == ["--tls-cert", c.cert, "--tls-key", c.key, "--tls-ca", c.ca]
