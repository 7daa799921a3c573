"""A small DNS client: the A and AAAA records of one name, asked of one server (`--dns-server host:port`).

The system resolver (getaddrinfo) is what production uses (serving/discovery.py); this client exists for a server
that is not the system's: a test's dnsmasq on a free loopback port, or a setup whose service registry answers DNS on
its own port (glibc's resolver only asks port 53). What it does, after RFC 1035:
1. One query per record type (A, AAAA), recursion desired, a random id, over UDP. An answer counts only if it comes
   from the server, carries the query's id and repeats its question; anything else on the socket is ignored. No
   answer within the timeout: the query goes out again, `attempts` times in all.
2. An answer with the TC bit (truncated: more records than a datagram holds) is asked again over TCP.
3. RCODE NXDOMAIN is an empty answer (the name has no addresses); any other error RCODE raises DnsError. The
   addresses are those of the name's records and of the CNAME chain that starts at it, in the answer's order.
"""
from __future__ import annotations

import asyncio
import ipaddress
import secrets
import struct

TYPE_A, TYPE_CNAME, TYPE_AAAA = 1, 5, 28
CLASS_IN = 1
_RCODES = {1: "FORMERR", 2: "SERVFAIL", 4: "NOTIMP", 5: "REFUSED"}
_NXDOMAIN = 3
_MAX_POINTERS = 64  # compression pointers followed in one name: more is a loop
TIMEOUT_S = 2.0


class DnsError(Exception):
    """The server did not answer, or answered an error (SERVFAIL, REFUSED, a malformed message)."""


def encode_name(name: str) -> bytes:
    labels = name.rstrip(".").split(".")
    out = b""
    for label in labels:
        raw = label.encode("idna") if not label.isascii() else label.encode()
        if not 1 <= len(raw) <= 63:
            raise ValueError(f"host name {name!r}: each dot-separated label must be 1 to 63 bytes")
        out += bytes([len(raw)]) + raw
    if len(out) + 1 > 255:
        raise ValueError(f"host name {name!r}: longer than 253 characters")
    return out + b"\0"


def build_query(qid: int, name: str, qtype: int) -> bytes:
    # header: id, flags (RD: recursion desired), 1 question, 0 answers, 0 authority, 0 additional
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + encode_name(name) + struct.pack("!HH", qtype, CLASS_IN)


def _read_name(msg: bytes, at: int) -> tuple[str, int]:
    """The (lower-case) name at offset `at` and the offset after it, following compression pointers."""
    labels, end, jumps = [], None, 0
    while True:
        if at >= len(msg):
            raise DnsError("malformed answer: a name runs past the end")
        n = msg[at]
        if n & 0xC0 == 0xC0:
            if at + 1 >= len(msg) or (jumps := jumps + 1) > _MAX_POINTERS:
                raise DnsError("malformed answer: bad compression pointer")
            end = at + 2 if end is None else end
            at = ((n & 0x3F) << 8) | msg[at + 1]
            continue
        if n & 0xC0:
            raise DnsError("malformed answer: unknown label type")
        if n == 0:
            return ".".join(labels).lower(), at + 1 if end is None else end
        labels.append(msg[at + 1:at + 1 + n].decode("ascii", "replace"))
        at += 1 + n


def parse_answer(msg: bytes, qid: int, name: str, qtype: int) -> tuple[list[str], bool] | None:
    """(addresses, truncated) of an answer to query (qid, name, qtype); None when it answers another query."""
    if len(msg) < 12:
        return None
    rid, flags, qd, an, _, _ = struct.unpack_from("!HHHHHH", msg)
    if rid != qid or not flags & 0x8000 or qd != 1:
        return None
    qname, at = _read_name(msg, 12)
    if at + 4 > len(msg) or qname != name.rstrip(".").lower():
        return None
    if struct.unpack_from("!HH", msg, at) != (qtype, CLASS_IN):
        return None
    at += 4
    truncated = bool(flags & 0x0200)
    rcode = flags & 0xF
    if rcode == _NXDOMAIN:
        return [], truncated
    if rcode:
        raise DnsError(f"server answered {_RCODES.get(rcode, f'RCODE {rcode}')}")
    records = []
    for _ in range(an):
        owner, at = _read_name(msg, at)
        if at + 10 > len(msg):
            raise DnsError("malformed answer: a record runs past the end")
        rtype, rclass, _ttl, rdlen = struct.unpack_from("!HHIH", msg, at)
        at += 10
        if at + rdlen > len(msg):
            raise DnsError("malformed answer: record data runs past the end")
        rdata = _read_name(msg, at)[0] if rtype == TYPE_CNAME else msg[at:at + rdlen]
        at += rdlen
        if rclass == CLASS_IN:
            records.append((owner, rtype, rdata))
    aliases = {qname}
    while True:  # the CNAME chain from the name, whatever order its records come in
        more = {r for o, t, r in records if t == TYPE_CNAME and o in aliases} - aliases
        if not more:
            break
        aliases |= more
    size = 4 if qtype == TYPE_A else 16
    addrs = [str(ipaddress.ip_address(r)) for o, t, r in records if t == qtype and o in aliases and len(r) == size]
    return list(dict.fromkeys(addrs)), truncated


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, accept):
        self.accept = accept  # bytes -> result or None (not ours)
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr) -> None:
        if self.done.done():
            return
        try:
            result = self.accept(data)
        except Exception as e:  # noqa: BLE001 - a malformed answer to our query fails the query
            self.done.set_exception(e)
            return
        if result is not None:
            self.done.set_result(result)

    def error_received(self, exc: Exception) -> None:  # e.g. ICMP port unreachable: nothing listens there
        if not self.done.done():
            self.done.set_exception(DnsError(f"{exc.strerror or exc}"))


async def _udp(server: tuple[str, int], query: bytes, accept, timeout_s: float, attempts: int):
    loop = asyncio.get_running_loop()
    last = "no answer"
    for _ in range(attempts):
        transport, proto = await loop.create_datagram_endpoint(lambda: _Udp(accept), remote_addr=server)
        try:
            transport.sendto(query)
            return await asyncio.wait_for(proto.done, timeout_s)
        except TimeoutError:
            last = f"no answer within {timeout_s:g} s"
        except DnsError as e:
            last = str(e)
        finally:
            transport.close()
    raise DnsError(f"{server[0]}:{server[1]}: {last} ({attempts} tries)")


async def _tcp(server: tuple[str, int], query: bytes, accept, timeout_s: float):
    async def ask():
        reader, writer = await asyncio.open_connection(*server)
        try:
            writer.write(struct.pack("!H", len(query)) + query)
            (n,) = struct.unpack("!H", await reader.readexactly(2))
            return accept(await reader.readexactly(n))
        finally:
            writer.close()

    try:
        result = await asyncio.wait_for(ask(), timeout_s)
    except (OSError, asyncio.IncompleteReadError, TimeoutError) as e:
        raise DnsError(f"{server[0]}:{server[1]} over TCP: {e or type(e).__name__}") from None
    if result is None:
        raise DnsError(f"{server[0]}:{server[1]} over TCP: the answer is not for our query")
    return result


async def query(server: tuple[str, int], name: str, qtype: int, timeout_s: float = TIMEOUT_S,
                attempts: int = 2) -> list[str]:
    """The addresses of `name`'s records of qtype (TYPE_A or TYPE_AAAA), asked of server (host, port)."""
    qid = secrets.randbelow(1 << 16)
    msg = build_query(qid, name, qtype)

    def accept(data: bytes):
        return parse_answer(data, qid, name, qtype)

    addrs, truncated = await _udp(server, msg, accept, timeout_s, attempts)
    if truncated:
        addrs, _ = await _tcp(server, msg, accept, timeout_s)
    return addrs


async def resolve(server: tuple[str, int], name: str, timeout_s: float = TIMEOUT_S) -> list[str]:
    """The IPv4 then IPv6 addresses of name; [] when it has none (NXDOMAIN, no records). DnsError when a query
    failed: then nothing is known about the name."""
    v4, v6 = await asyncio.gather(query(server, name, TYPE_A, timeout_s), query(server, name, TYPE_AAAA, timeout_s))
    return v4 + v6
