"""serving/discovery.py with a resolver the test controls: IP literals need no lookup, names become one address per
record, an empty answer empties them, a failed lookup keeps the last good set, and each change of state is logged
once, not at every refresh."""
from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from fake_dns import FakeDns
from serving.discovery import Discovery, DiscoveryConfig, LookupFailed, split_host_port, system_resolver


def _run(coro):
    return asyncio.run(coro)


def test_ip_literals_are_static_and_names_are_one_address_per_record():
    dns = FakeDns(decode=["10.0.0.2", "10.0.0.1", "fd00::5"])
    seen = []

    async def go():
        d = Discovery("decode", ["127.0.0.1:7000", "decode:50061", "[::1]:7001"], resolver=dns, on_change=seen.append)
        before = dict(d.addresses)
        assert await d.refresh()
        assert not await d.refresh()  # the same answer: no change
        return before, d.addresses

    before, after = _run(go())
    assert before == {"127.0.0.1:7000": "127.0.0.1:7000", "[::1]:7001": "[::1]:7001"}
    assert after == {"127.0.0.1:7000": "127.0.0.1:7000", "[::1]:7001": "[::1]:7001", "10.0.0.1:50061": "decode:50061",
                     "10.0.0.2:50061": "decode:50061", "[fd00::5]:50061": "decode:50061"}
    assert seen == [after] and dns.lookups == 2


def test_only_ip_literals_never_look_anything_up():
    dns = FakeDns()

    async def go():
        d = Discovery("decode", ["127.0.0.1:7000"], DiscoveryConfig(refresh_interval_s=0.01), resolver=dns)
        await d.start()
        await asyncio.sleep(0.05)
        await d.close()
        return d

    d = _run(go())
    assert not d.dynamic and dns.lookups == 0 and list(d.addresses) == ["127.0.0.1:7000"]


def test_failures_keep_the_last_good_set_and_are_logged_once_per_change(caplog):
    dns = FakeDns(decode=["10.0.0.1", "10.0.0.2"])
    caplog.set_level(logging.INFO, "tandem.discovery")

    async def go():
        d = Discovery("decode", ["decode:1"], resolver=dns)
        await d.refresh()
        dns.records["decode"] = LookupFailed("SERVFAIL")
        for _ in range(3):
            assert not await d.refresh()
        kept = dict(d.addresses)
        dns.records["decode"] = ["10.0.0.2"]
        assert await d.refresh()
        return kept, d.addresses

    kept, after = _run(go())
    assert list(kept) == ["10.0.0.1:1", "10.0.0.2:1"] and list(after) == ["10.0.0.2:1"]
    failed = [r for r in caplog.records if "lookup failed" in r.message]
    assert len(failed) == 1 and failed[0].levelno == logging.WARNING, caplog.text
    assert "SERVFAIL" in failed[0].message and "keeping its last 2 address(es)" in failed[0].message
    assert sum("lookups work again" in r.message for r in caplog.records) == 1


def test_an_empty_answer_means_no_instances_logged_once(caplog):
    dns = FakeDns(decode=["10.0.0.1"])
    caplog.set_level(logging.INFO, "tandem.discovery")

    async def go():
        d = Discovery("decode", ["decode:1", "10.9.9.9:2"], resolver=dns)
        await d.refresh()
        dns.records["decode"] = []
        assert await d.refresh()
        assert not await d.refresh()
        return d.addresses

    assert list(_run(go())) == ["10.9.9.9:2"]
    assert sum("no addresses" in r.message for r in caplog.records) == 1


def test_a_hung_lookup_counts_as_failed_and_refreshes_run_one_at_a_time(monkeypatch):
    import serving.discovery as discovery

    monkeypatch.setattr(discovery, "LOOKUP_TIMEOUT_S", 0.05)
    calls = []

    async def hangs(name):
        calls.append(name)
        await asyncio.sleep(3600)

    async def go():
        d = Discovery("decode", ["decode:1"], resolver=hangs)
        await asyncio.gather(d.refresh(), d.refresh(), d.refresh_if_older(60))
        return d

    d = _run(go())
    assert calls == ["decode"] and d._names[0].failing and d.addresses == {}


def test_the_background_refresh_follows_the_records():
    dns = FakeDns(decode=["10.0.0.1"])

    async def go():
        d = Discovery("decode", ["decode:1"], DiscoveryConfig(refresh_interval_s=0.01), resolver=dns)
        await d.start()
        dns.records["decode"] = ["10.0.0.3"]
        for _ in range(1000):
            if list(d.addresses) == ["10.0.0.3:1"]:
                break
            await asyncio.sleep(0.01)
        await d.close()
        return d.addresses

    assert list(_run(go())) == ["10.0.0.3:1"]


@pytest.mark.parametrize("entry, error", [
    ("decode", "must be host:port"), ("decode:0", "must be host:port"), ("decode:http", "must be host:port"),
    ("a..b:1", "label must be 1 to 63 bytes"), ("x" * 64 + ".svc:1", "label must be 1 to 63 bytes")])
def test_bad_entries_name_the_flag(entry, error):
    with pytest.raises(ValueError, match=rf"^--decode={entry!r}: .*{error}"):
        split_host_port(entry, "--decode")


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="--dns-refresh-interval=-1: must be >= 0"):
        DiscoveryConfig(refresh_interval_s=-1)
    with pytest.raises(ValueError, match="--dns-server='dns.local:53': the host must be an IP address"):
        DiscoveryConfig(dns_server="dns.local:53")


def test_the_system_resolver_answers_localhost_and_names_nothing_for_an_unknown_name():
    assert "127.0.0.1" in _run(system_resolver("localhost"))
    try:
        socket.getaddrinfo("nobody.invalid", None)
    except socket.gaierror as e:
        if e.errno != socket.EAI_NONAME:
            pytest.skip(f"this machine's resolver cannot say NXDOMAIN here: {e}")
    assert _run(system_resolver("nobody.invalid")) == []
