"""The KV block pool: fixed-size blocks with reference counts, an LRU free queue, and the prefix-cache map.

A block is cached once it is full and its KV is computed: it is keyed by a hash chained over its tokens and its
parent block's hash, so equal hashes mean equal prefixes. A cached block whose reference count drops to zero stays
in the free queue with its contents; it is reused by a prefix hit, or evicted (least recently freed first) when a
new block is needed.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from array import array

from engine.config import CacheConfig

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """A collision-resistant chained hash (builtin hash() of int tuples is easy to collide on purpose)."""
    h = hashlib.blake2b(parent_hash or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = CacheConfig.enable_prefix_caching):
        assert num_blocks >= 1
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # Blocks with ref_cnt == 0, oldest first: the front is evicted first.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        # Called with (block id, its hash) when a cached block's contents are about to be overwritten (the host KV
        # tier keeps a copy: engine/host_kv.py).
        self.on_evict: Callable[[int, BlockHash], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[int] | None:
        """n blocks with ref_cnt 1, evicting cached contents LRU-first; None if fewer than n are free."""
        if n > len(self.free_queue):
            return None
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Takes a reference on blocks found in the prefix cache (pulling free ones out of the free queue)."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference each, in the given order: blocks reaching zero join the back of the free queue."""
        for b in block_ids:
            assert self.ref_cnt[b] > 0, f"double free of block {b}"
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                if self.enable_caching and self.block_hash[b] is not None:
                    self.free_queue[b] = None
                else:
                    self._evict(b)
                    # Blocks without reusable contents go to the front: evict them before cached ones.
                    self.free_queue[b] = None
                    self.free_queue.move_to_end(b, last=False)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Registers a full, computed block. If the same prefix is already cached, the existing block keeps the key."""
        if not self.enable_caching or self.block_hash[block_id] is not None:
            return
        if block_hash in self.cached:
            return
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id

    def _evict(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            if self.cached.get(h) == block_id:
                del self.cached[h]
                if self.on_evict is not None:
                    self.on_evict(block_id, h)
            self.block_hash[block_id] = None

