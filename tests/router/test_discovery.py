"""router/instances.py's rotation under DNS discovery, with a resolver the test controls (no DNS server, nothing
listening: no poll succeeds; one TLS server): addresses that appear join, vanished ones leave the rotation but keep their channel
while this router has calls there, and come back as they were; each change of an instance's state is logged once;
tandem:router_instances counts them; TLS checks a resolved address against its name."""
from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from prometheus_client import REGISTRY

from fake_dns import FakeDns
from router.instances import InstancePool
from serving import health as health_codec
from serving.metrics import Metrics
from serving.rpc import add_health_and_reflection, add_port, new_server, set_serving
from serving.tls import TlsConfig


def _gauge(role: str, state: str) -> float | None:
    return REGISTRY.get_sample_value("tandem:router_instances", {"model_name": "disc", "role": "router",
                                                                 "instance_role": role, "state": state})


def _pool(dns, entries, poll_timeout_s: float = 0.5, **kw) -> InstancePool:
    return InstancePool("decode", entries, resolver=dns, metrics=Metrics("disc", "router"),
                        poll_timeout_s=poll_timeout_s, **kw)


def test_addresses_join_and_leave_the_rotation():
    dns = FakeDns(decode=["127.0.0.2", "127.0.0.3"])

    async def go():
        pool = _pool(dns, ["decode:9", "127.0.0.1:9"])
        static = [i.address for i in pool.instances]  # IP literals: there before any lookup
        await pool.resolve()
        joined = [i.address for i in pool.instances]
        for inst in pool.instances:
            inst.healthy = True
        first = {i.address: i for i in pool.instances}
        dns.records["decode"] = ["127.0.0.3", "127.0.0.4"]
        await pool.names.refresh()
        after = [i.address for i in pool.instances]
        kept = first["127.0.0.3:9"] in pool.instances  # the same instance, its load and prefix index with it
        healthy = [i.address for i in pool.ordered()]
        await pool.close()
        return static, joined, after, kept, healthy

    static, joined, after, kept, healthy = asyncio.run(go())
    assert static == ["127.0.0.1:9"]
    assert joined == ["127.0.0.1:9", "127.0.0.2:9", "127.0.0.3:9"]
    assert after == ["127.0.0.1:9", "127.0.0.3:9", "127.0.0.4:9"] and kept
    assert healthy == ["127.0.0.1:9", "127.0.0.3:9"]  # the new one waits for its first good poll


def test_a_vanished_instance_keeps_its_channel_while_streams_run_and_can_come_back():
    dns = FakeDns(decode=["127.0.0.2", "127.0.0.3"])

    async def go():
        pool = _pool(dns, ["decode:9"])
        await pool.resolve()
        a, b = pool.instances
        lost = []
        a.streams.add(lost.append)  # a stream this router follows on a
        dns.records["decode"] = ["127.0.0.3"]
        await pool.names.refresh()
        state = (pool.instances == [b], pool.leaving == [a], a.leaving, _gauge("decode", "leaving"))
        await pool.poll_once()  # a is polled still (unreachable here, once: not lost yet) and stays
        polled = (a.state, pool.leaving == [a], lost)
        dns.records["decode"] = ["127.0.0.2", "127.0.0.3"]
        await pool.names.refresh()
        back = (pool.instances == [b, a], pool.leaving, a.leaving)
        dns.records["decode"] = ["127.0.0.3"]
        await pool.names.refresh()
        a.streams.clear()  # its stream finished
        await pool.poll_once()
        reaped = (pool.leaving, _gauge("decode", "leaving"), _gauge("decode", "unhealthy"))
        await pool.close()
        return state, polled, back, reaped, a.channel

    state, polled, back, reaped, channel = asyncio.run(go())
    assert state == (True, True, True, 1.0)
    assert polled == ("unreachable", True, [])
    assert back == (True, [], False)
    assert reaped == ([], 0.0, 1.0)


def test_a_vanished_instance_that_is_lost_moves_its_streams():
    dns = FakeDns(decode=["127.0.0.2"])

    async def go():
        pool = _pool(dns, ["decode:9", "127.0.0.1:9"])
        await pool.resolve()
        a = pool.instances[1]
        moved = []
        a.streams.add(moved.append)
        dns.records["decode"] = []
        await pool.names.refresh()
        await pool.poll_once()
        await pool.poll_once()  # LOST_AFTER_POLLS unanswered polls: its streams are told
        await pool.close()
        return moved

    (why,) = asyncio.run(go())
    assert "2 health polls unanswered" in why


def test_unreachable_instances_are_logged_once_until_they_change(caplog):
    caplog.set_level(logging.INFO, "tandem.router.instances")

    async def go():
        # (a refused connect is UNAVAILABLE at once; a poll timeout a busy machine could outlast would make it
        # DEADLINE_EXCEEDED instead, and the lines below name the code)
        pool = _pool(FakeDns(), ["127.0.0.1:9", "127.0.0.1:10"], poll_timeout_s=5.0)
        for _ in range(3):
            await pool.poll_once()
        up = (_gauge("decode", "healthy"), _gauge("decode", "unhealthy"))
        await pool.close()
        return up

    assert asyncio.run(go()) == (0.0, 2.0)
    lines = sorted(r.message for r in caplog.records if "unreachable" in r.message)
    assert lines == ["decode 127.0.0.1:10 is unreachable: UNAVAILABLE (1 polls in a row)",
                     "decode 127.0.0.1:9 is unreachable: UNAVAILABLE (1 polls in a row)"]
    assert all(r.levelno == logging.WARNING for r in caplog.records if "unreachable" in r.message)


def test_tls_checks_a_resolved_address_against_the_name_it_came_from(tmp_path):
    """A pod's certificate names its service, not its address: the router dials 127.0.0.1 for the name and the
    handshake checks the name; the same address given as an IP literal is checked as the IP (and refused here)."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server_tls = _identity(ca, tmp_path, "server", "decode.tandem.test")
    client_tls = _identity(ca, tmp_path, "client", "router.tandem.test")

    async def go():
        server = new_server()
        hs = add_health_and_reflection(server, [])
        port = add_port(server, "127.0.0.1:0", server_tls)
        await server.start()
        await set_serving(hs, [], True)
        by_name = _pool(FakeDns(**{"decode.tandem.test": ["127.0.0.1"]}), [f"decode.tandem.test:{port}"],
                        tls=client_tls)
        by_ip = _pool(FakeDns(), [f"127.0.0.1:{port}"], tls=client_tls)
        await by_name.resolve()
        try:
            named = await by_name.instances[0].health("", timeout=5)
            try:
                await by_ip.instances[0].health("", timeout=5)
                ip = "SERVING"
            except grpc.aio.AioRpcError as e:
                ip = e.code()
            return named, ip
        finally:
            await by_name.close()
            await by_ip.close()
            await server.stop(0)

    assert asyncio.run(go()) == (health_codec.SERVING, grpc.StatusCode.UNAVAILABLE)


def _identity(ca, directory, name: str, host: str) -> TlsConfig:
    leaf = ca.issue_cert(host)
    cert, key, ca_path = directory / f"{name}.crt", directory / f"{name}.key", directory / "ca.crt"
    cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    key.write_bytes(leaf.private_key_pem.bytes())
    ca.cert_pem.write_to_path(str(ca_path))
    return TlsConfig(str(cert), str(key), str(ca_path))


def test_the_router_flags_take_names_and_check_the_dns_flags(capsys):
    from router.server import ENV_DECODE, main, parse_addresses

    assert parse_addresses("tandem-decode:50061,10.0.0.5:7000", ENV_DECODE) == ["tandem-decode:50061",
                                                                                "10.0.0.5:7000"]
    for argv, error in ((["--dns-server", "dns.local:53"], "--dns-server='dns.local:53': the host must be an IP"),
                        (["--dns-refresh-interval", "-1"], "--dns-refresh-interval=-1.0: must be >= 0"),
                        (["--decode", "bad_label..x:1"], "--decode='bad_label..x:1': host name")):
        with pytest.raises(SystemExit):
            main(["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", *argv])
        assert error in capsys.readouterr().err
