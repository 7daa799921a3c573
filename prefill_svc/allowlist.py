"""`--decode-allowlist`: the decode instances a prefill instance may send KV to; a request naming another is refused
(INVALID_ARGUMENT) before anything dials it, so that a caller cannot make this worker connect anywhere.

Entries are host:port, as the router's `--decode` (serving/discovery.py): an IP literal is that address; a DNS name
(a headless service of the decode pods) allows every address it resolves to, looked up at start and every
--dns-refresh-interval after, in the background: a request's check is a set lookup. Two moments where the router
and this worker disagree, since each looks names up on its own clock:
- an address the router found before this worker did (a new pod): a request naming an address not in the set makes
  this worker look its names up again first, at most once per `MISS_REFRESH_S` (a caller naming addresses at random
  cannot make it query DNS more often), and it is refused only if it is still not there;
- an address this worker saw vanish while a router still sends requests there (a pod draining): it stays allowed for
  `LINGER_INTERVALS` refresh intervals after it vanished, about as long as the router takes to see the same.
"""
from __future__ import annotations

import asyncio

from serving.discovery import Discovery, DiscoveryConfig, Resolver, entry_host, is_ip

MISS_REFRESH_S = 1.0
LINGER_INTERVALS = 2


class DecodeAllowlist:
    def __init__(self, entries: list[str], config: DiscoveryConfig = DiscoveryConfig(),
                 resolver: Resolver | None = None):
        self.names = Discovery("--decode-allowlist", entries, config, resolver, self._changed)
        self._linger_s = LINGER_INTERVALS * config.refresh_interval_s
        self._vanished: dict[str, float] = {}  # address -> loop time until which it stays allowed
        self._known = set(self.names.addresses)

    async def start(self) -> None:
        await self.names.start()

    async def close(self) -> None:
        await self.names.close()

    def _changed(self, found: dict[str, str]) -> None:
        now = asyncio.get_running_loop().time()
        self._vanished = {a: t for a, t in self._vanished.items() if t > now and a not in found}
        for address in self._known - set(found):
            self._vanished[address] = now + self._linger_s
        self._known = set(found)

    def _allows(self, address: str) -> bool:
        if address in self.names.addresses:
            return True
        until = self._vanished.get(address)
        return until is not None and until > asyncio.get_running_loop().time()

    async def check(self, address: str) -> None:
        """ValueError naming the field when `address` is not a decode instance this worker may send KV to."""
        if self._allows(address):
            return
        if self.names.dynamic:
            await self.names.refresh_if_older(MISS_REFRESH_S)
            if self._allows(address):
                return
        raise ValueError(f"decode_address={address!r}: not a decode instance this prefill may send KV to "
                         f"(--decode-allowlist: {', '.join(self.names.entries)}"
                         f"{' = ' + ', '.join(sorted(self.names.addresses)) if self.names.dynamic else ''})")

    def server_name(self, address: str) -> str | None:
        """The DNS name `address` was resolved from (what TLS checks its certificate against), or None."""
        entry = self.names.addresses.get(address)
        if entry is None:
            return None
        host = entry_host(entry)
        return None if is_ip(host) else host
