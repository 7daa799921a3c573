"""prefill_svc/allowlist.py with a resolver the test controls: names allow the addresses they resolve to, looked up
in the background (not per request); an address not yet seen makes one lookup, at most once per MISS_REFRESH_S; a
vanished address stays allowed for a while (the router may not have seen it go)."""
from __future__ import annotations

import asyncio

import pytest

from fake_dns import FakeDns
from prefill_svc import allowlist
from prefill_svc.allowlist import DecodeAllowlist
from serving.discovery import DiscoveryConfig


def test_ip_literals_and_names_and_nothing_else():
    dns = FakeDns(decode=["10.0.0.1", "10.0.0.2"])

    async def go():
        allow = DecodeAllowlist(["127.0.0.1:7", "decode:50061"], DiscoveryConfig(refresh_interval_s=0), dns)
        await allow.start()
        for address in ("127.0.0.1:7", "10.0.0.1:50061", "10.0.0.2:50061"):
            await allow.check(address)  # no lookup: they are in the set
        lookups = dns.lookups
        with pytest.raises(ValueError) as e:
            await allow.check("10.0.0.3:50061")
        names = allow.server_name("10.0.0.1:50061"), allow.server_name("127.0.0.1:7")
        await allow.close()
        return lookups, str(e.value), names

    lookups, error, names = asyncio.run(go())
    assert lookups == 1
    assert error == ("decode_address='10.0.0.3:50061': not a decode instance this prefill may send KV to "
                     "(--decode-allowlist: 127.0.0.1:7, decode:50061 = 10.0.0.1:50061, 10.0.0.2:50061, "
                     "127.0.0.1:7)")
    assert names == ("decode", None)  # TLS checks a resolved address's certificate against its name


def test_a_new_address_is_looked_up_on_a_miss_at_most_once_a_second(monkeypatch):
    monkeypatch.setattr(allowlist, "MISS_REFRESH_S", 3600.0)
    dns = FakeDns(decode=["10.0.0.1"])

    async def go():
        allow = DecodeAllowlist(["decode:1"], DiscoveryConfig(refresh_interval_s=0), dns)
        await allow.start()
        allow.names.last_refresh = float("-inf")  # the start's lookup is long ago
        dns.records["decode"] = ["10.0.0.1", "10.0.0.2"]  # a pod the router found first
        await allow.check("10.0.0.2:1")
        refused = 0
        for i in range(20):  # a caller naming addresses at random: no lookup for each
            try:
                await allow.check(f"10.9.0.{i}:1")
            except ValueError:
                refused += 1
        return refused

    assert asyncio.run(go()) == 20 and dns.lookups == 2


def test_a_vanished_address_lingers_for_two_refresh_intervals():
    dns = FakeDns(decode=["10.0.0.1", "10.0.0.2"])

    async def go():
        allow = DecodeAllowlist(["decode:1"], DiscoveryConfig(refresh_interval_s=30), dns)
        await allow.names.refresh()
        dns.records["decode"] = ["10.0.0.1"]
        await allow.names.refresh()
        await allow.check("10.0.0.2:1")  # gone from DNS a moment ago: the router may still send it requests
        allow._vanished["10.0.0.2:1"] = asyncio.get_running_loop().time() - 1  # as if 60 s had passed
        allow.names.last_refresh = asyncio.get_running_loop().time()  # (no lookup on this miss)
        with pytest.raises(ValueError, match="10.0.0.2:1"):
            await allow.check("10.0.0.2:1")

    asyncio.run(go())
