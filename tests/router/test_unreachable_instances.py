"""A router whose instances never answer says so (router/instances.py): once at the first poll, then every
DOWN_LOG_EVERY_S, not at every poll."""
from __future__ import annotations

import asyncio
import logging


from router import instances


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: connections are refused


def test_an_instance_that_never_answers_is_logged_once_then_every_interval(caplog, monkeypatch):
    address = f"127.0.0.1:{_closed_port()}"

    async def main():
        pool = instances.InstancePool("decode", [address], poll_timeout_s=5.0)
        try:
            await pool.poll_once()
            await pool.poll_once()
            monkeypatch.setattr(instances, "DOWN_LOG_EVERY_S", 0.0)
            await pool.poll_once()
        finally:
            await pool.close()

    with caplog.at_level(logging.WARNING, logger="tandem.router.instances"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"decode {address} is unreachable: UNAVAILABLE (1 polls in a row)")
    assert "(3 polls in a row)" in lines[1]
