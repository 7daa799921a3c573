"""serving/dns.py against a real DNS server (dnsmasq on loopback, tests/dnsmasq.py): A and AAAA records, names
that do not exist, answers too large for a datagram (TCP), a reload, and servers that refuse or are not there."""
from __future__ import annotations

import asyncio
import struct

import pytest

from dnsmasq import DOMAIN, Dnsmasq, needs_dnsmasq
from serving import dns
from serving.discovery import LookupFailed, server_resolver

pytestmark = needs_dnsmasq
NAME, MANY = f"pods.{DOMAIN}", f"many.{DOMAIN}"
MANY_IPS = [f"127.0.1.{i}" for i in range(1, 61)]  # 60 A records: about 1 kB, past a 512-byte UDP answer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = Dnsmasq(tmp_path_factory.mktemp("dns"), {NAME: ["127.0.0.2", "127.0.0.3", "::2"], MANY: MANY_IPS,
                                                 f"probe.{DOMAIN}": ["127.0.0.1"]})
    yield d
    d.stop()


def test_a_and_aaaa_records_whatever_the_case_of_the_name(server):
    at = ("127.0.0.1", server.port)
    assert sorted(asyncio.run(dns.resolve(at, NAME))) == ["127.0.0.2", "127.0.0.3", "::2"]
    assert sorted(asyncio.run(dns.resolve(at, NAME.upper() + "."))) == ["127.0.0.2", "127.0.0.3", "::2"]
    assert asyncio.run(dns.query(at, NAME, dns.TYPE_AAAA)) == ["::2"]


def test_a_name_without_records_is_an_empty_answer(server):
    at = ("127.0.0.1", server.port)
    assert asyncio.run(dns.resolve(at, f"nobody.{DOMAIN}")) == []  # NXDOMAIN
    assert asyncio.run(dns.query(at, f"probe.{DOMAIN}", dns.TYPE_AAAA)) == []  # the name has an A record only


def test_a_truncated_answer_is_asked_again_over_tcp(server):
    sent = []
    real = dns._tcp

    async def spy(*args):
        sent.append(args[0])
        return await real(*args)

    dns._tcp = spy
    try:
        assert sorted(asyncio.run(dns.query(("127.0.0.1", server.port), MANY, dns.TYPE_A))) == sorted(MANY_IPS)
    finally:
        dns._tcp = real
    assert sent == [("127.0.0.1", server.port)]


def test_a_reload_changes_the_answer(tmp_path):
    d = Dnsmasq(tmp_path, {NAME: ["127.0.0.2"], f"probe.{DOMAIN}": ["127.0.0.1"]})
    try:
        resolve = server_resolver(d.address)
        assert asyncio.run(resolve(NAME)) == ["127.0.0.2"]
        d.set({NAME: ["127.0.0.4", "127.0.0.5"], f"probe.{DOMAIN}": ["127.0.0.1"]})

        async def changed():
            for _ in range(400):  # dnsmasq rereads the file when it handles the signal
                if sorted(await resolve(NAME)) == ["127.0.0.4", "127.0.0.5"]:
                    return True
                await asyncio.sleep(0.05)
            return False

        assert asyncio.run(changed())
    finally:
        d.stop()


def test_errors_and_silence_fail_the_lookup(server):
    resolve = server_resolver(server.address)
    with pytest.raises(LookupFailed, match="REFUSED"):  # outside its local domain, with nothing to forward to
        asyncio.run(resolve("example.com"))
    with pytest.raises(dns.DnsError, match="refused|no answer"):  # nothing listens there
        asyncio.run(dns.resolve(("127.0.0.1", 9), NAME, timeout_s=0.5))


def test_answers_to_other_queries_are_ignored():
    q = dns.build_query(0x1234, "a.example", dns.TYPE_A)
    answer = bytearray(q)
    answer[2] |= 0x80  # QR: a response
    assert dns.parse_answer(bytes(answer), 0x1234, "a.example", dns.TYPE_A) == ([], False)
    assert dns.parse_answer(bytes(answer), 0x4321, "a.example", dns.TYPE_A) is None  # another id
    assert dns.parse_answer(bytes(answer), 0x1234, "b.example", dns.TYPE_A) is None  # another question
    assert dns.parse_answer(q, 0x1234, "a.example", dns.TYPE_A) is None  # a query, not an answer


def test_cname_chains_and_compression_loops():
    q = dns.build_query(1, "svc.example", dns.TYPE_A)
    header = bytearray(q[:12])
    header[2], header[7] = 0x81, 3  # QR + RD; 3 answers

    def rr(owner: bytes, rtype: int, rdata: bytes) -> bytes:
        return owner + struct.pack("!HHIH", rtype, 1, 0, len(rdata)) + rdata

    svc = b"\xc0\x0c"  # a pointer to the question's name
    pod = dns.encode_name("pod.example")
    body = (rr(dns.encode_name("other.example"), dns.TYPE_A, bytes([10, 0, 0, 9]))  # not on the chain
            + rr(pod, dns.TYPE_A, bytes([10, 0, 0, 1]))  # before the CNAME that leads to it
            + rr(svc, dns.TYPE_CNAME, pod))
    assert dns.parse_answer(bytes(header) + q[12:] + body, 1, "svc.example", dns.TYPE_A) == (["10.0.0.1"], False)
    looped = bytes(header[:7]) + b"\x01" + bytes(header[8:]) + q[12:] + b"\xc0" + bytes([len(q)])
    with pytest.raises(dns.DnsError, match="compression"):
        dns.parse_answer(looped, 1, "svc.example", dns.TYPE_A)
