"""The decode process keeps at most max_peers prefill NIXL agents (real agents in this process, UCX on the CPU): the
least recently used goes first, a transfer's open counts as a use, a dropped agent is removed from NIXL too and
its next open is refused (FAILED_PRECONDITION: shake hands again), and the agents kept still read the right
blocks. Skipped when nixl_cu12 cannot be imported or its UCX backend does not initialise."""
from __future__ import annotations

import asyncio
import itertools
import time

import grpc
import pytest
import torch

from kv_transfer import nixl
from protos.tandem.v1 import kv_transfer_pb2 as kv
from serving.errors import ServiceError

SHAPE = (6, 1, 2, 16, 1, 8)  # [blocks, layers, k/v, block_size, kv heads, head_dim] float32: 1 KiB blocks
_names = itertools.count()


def _refusal() -> str | None:
    reason = nixl.import_error()
    if reason is None:
        try:
            nixl.NixlCache(torch.zeros(SHAPE), f"tandem-peers-probe-{time.monotonic_ns()}")
        except Exception as exc:  # noqa: BLE001
            reason = f"nixl's UCX backend did not initialise: {type(exc).__name__}: {exc}"
    return reason


pytestmark = pytest.mark.skipif(_refusal() is not None, reason=str(_refusal()))


class Decode:
    """A decode process's NixlPeers over its own cache, its engine-thread calls made inline."""

    def __init__(self, max_peers: int):
        self.cache = torch.zeros(SHAPE)

        async def on_engine(fn):
            return fn(self.cache)

        self.peers = nixl.NixlPeers(f"tandem-peers-decode-{next(_names)}-{time.monotonic_ns()}", on_engine,
                                    max_peers=max_peers)

    def add(self, prefill: nixl.NixlCache) -> None:
        asyncio.run(self.peers.add(prefill.offer(), prefill.block_bytes))

    def read(self, prefill: nixl.NixlCache, src: list[int], dst: list[int]) -> None:
        peer = self.peers.peers[prefill.name]
        self.peers.read(self.cache, dst, peer, src, time.monotonic() + 10)


def prefill(seed: int) -> tuple[nixl.NixlCache, torch.Tensor]:
    cache = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))
    return nixl.NixlCache(cache, f"tandem-peers-prefill-{next(_names)}-{time.monotonic_ns()}"), cache


def test_the_least_recently_used_agent_goes_and_the_kept_ones_still_read():
    d = Decode(max_peers=2)
    (a, a_kv), (b, b_kv), (c, c_kv) = prefill(1), prefill(2), prefill(3)
    d.add(a)
    d.add(b)
    d.peers.touch(a.name)  # a transfer from a opened after b's handshake: b is now the least recently used
    d.add(c)
    assert sorted(d.peers.peers) == sorted([a.name, c.name]) and b.name not in d.peers.last_used
    d.read(a, [4, 1], [0, 1])
    d.read(c, [2], [2])
    for dst, (src_kv, src) in enumerate([(a_kv, 4), (a_kv, 1), (c_kv, 2)]):
        assert torch.equal(d.cache[dst], src_kv[src])
    # b's agent is gone from NIXL too: a read naming it fails there, not only in our table
    gone = kv.NixlCache()
    gone.CopyFrom(b.offer(with_metadata=False))
    with pytest.raises(ServiceError):
        d.peers.read(d.cache, [3], gone, [0], time.monotonic() + 5)


def test_a_dropped_prefill_is_told_to_shake_hands_again_and_can():
    d = Decode(max_peers=1)
    (a, a_kv), (b, _) = prefill(4), prefill(5)
    d.add(a)
    d.add(b)
    assert list(d.peers.peers) == [b.name]

    class Side:  # what NixlReceiver reads of its KvReceiver
        layout = kv.KvLayout(block_bytes=a.block_bytes)
        nixl = d.peers

    op = kv.KvTransferOpen(request_id="r", nixl=a.offer(with_metadata=False), deadline_ms=5000,
                           path=kv.KV_TRANSFER_PATH_NIXL)
    with pytest.raises(ServiceError) as ei:
        asyncio.run(nixl.NixlReceiver(Side()).open(op))
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION and "shake hands first" in ei.value.message
    d.add(a)  # its next handshake: back in (b goes), and it reads again
    assert list(d.peers.peers) == [a.name]
    d.read(a, [5], [0])
    assert torch.equal(d.cache[0], a_kv[5])
