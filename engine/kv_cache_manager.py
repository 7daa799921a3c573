"""Per-request block tables over the block pool, and prefix-cache lookups.

The manager is the only owner of block ids: the scheduler asks it for room (`allocate_slots`, which answers False
when the pool is full), the engine reads block tables from it, and `free` returns a request's blocks.

Besides each request's list of block ids, the manager keeps them as rows of one int32 array, zero past each row's
length, written as blocks are added: a step's padded block tables are one fancy index of it (`block_tables`), not a
numpy copy of every request's list, a cost that grows with the batch (measured: bench/host_overhead.py,
bench/RESULTS.md).

With a host tier (`--swap-space`, engine/host_kv.py) the manager also moves blocks between the two pools: a cached
block the pool evicts is copied to the host first; a prefix lookup that runs out of device hits goes on in the host
tier and copies those blocks into fresh device blocks (registered in the prefix cache, so they count as hits like any
other); `swap_out` / `swap_in` keep a preempted request's blocks on the host. Every method that records copies
issues them before it returns (`HostKVTier.flush`), so they are on the stream before anything the caller does next.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.block_pool import BlockHash, BlockPool, hash_block_tokens
from engine.config import CacheConfig
from engine.host_kv import HostKVTier
from engine.request import Request
from engine.utils import cdiv


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = CacheConfig.enable_prefix_caching,
                 host: HostKVTier | None = None):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.host = host
        if host is not None and enable_caching:
            self.pool.on_evict = host.store
        self.host_hits = 0  # prefix-cache hits served from the host tier, in tokens (also counted in prefix_hits)
        self.req_to_blocks: dict[str, list[int]] = {}
        self.req_to_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of the request registered in the cache
        self._row: dict[str, int] = {}  # request id -> its row of _table (requests that hold blocks)
        self._free_rows: list[int] = []
        self._num_rows = 0  # rows ever handed out
        self._table = np.zeros((64, 64), dtype=np.int32)  # [rows, blocks]: row r's block ids, then zeros
        self._len = np.zeros(64, dtype=np.int64)  # [rows]: how many blocks each row holds
        # Prefix-cache counters, in tokens (vLLM's prefix_cache_queries / prefix_cache_hits).
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def block_tables(self, request_ids: Sequence[str]) -> np.ndarray:
        """[len(request_ids), the most blocks any of them holds] int32: their block ids, zero-padded. Every request
        must hold at least one block (all scheduled ones do)."""
        rows = np.array([self._row[r] for r in request_ids], dtype=np.int64)
        width = int(self._len[rows].max())
        return self._table[rows, :width]

    def _store(self, request_id: str, start: int, block_ids: list[int]) -> None:
        """Writes block_ids into the request's row from column start (its blocks [start, start + len))."""
        row = self._row.get(request_id)
        if row is None:
            if self._free_rows:
                row = self._free_rows.pop()
            else:
                row, self._num_rows = self._num_rows, self._num_rows + 1
                if row == self._table.shape[0]:
                    self._table = np.concatenate([self._table, np.zeros_like(self._table)])
                    self._len = np.concatenate([self._len, np.zeros_like(self._len)])
            self._row[request_id] = row
        end = start + len(block_ids)
        if end > self._table.shape[1]:
            wider = np.zeros((self._table.shape[0], max(end, 2 * self._table.shape[1])), dtype=np.int32)
            wider[:, : self._table.shape[1]] = self._table
            self._table = wider
        self._table[row, start:end] = block_ids
        self._len[row] = end

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        hashes = self.req_to_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, request.token_slice(i * bs, (i + 1) * bs)))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of a request not yet started: (block ids, tokens). At least one token is left
        to compute, so that the step produces logits for it."""
        if not self.enable_caching or request.num_computed_tokens > 0:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        hashes = self._block_hashes(request, max_blocks)
        for h in hashes:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        if self.host is not None and len(hits) < max_blocks and self.host.has(hashes[len(hits)]):
            hits = self._load_from_host(hashes, hits)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def _load_from_host(self, hashes: list[BlockHash], hits: list[int]) -> list[int]:
        """hits (device blocks of hashes' leading blocks) continued with the following blocks the host tier holds
        (or the device, further on), each host one copied into a fresh device block registered under its hash and
        left free, as a cached block nobody references is: the caller takes them as it takes any hit."""
        pool, host = self.pool, self.host
        tail: list[BlockHash] = []  # hashes after hits: device-cached or on the host, in order
        for h in hashes[len(hits):]:
            if pool.get_cached_block(h) is None and not host.has(h):
                break
            tail.append(h)
        to_load = [h for h in tail if pool.get_cached_block(h) is None]
        # The device hits must survive the allocation below (free ones sit in the free queue, evictable).
        pool.touch(hits)
        new = pool.get_new_blocks(min(len(to_load), pool.num_free_blocks)) or []
        pool.free(hits)
        loaded = dict(zip(to_load, new))
        out = list(hits)
        for h in tail:
            b = pool.get_cached_block(h)
            if b is None:
                b = loaded.get(h)
                # No device block left for it, or the host dropped it to keep a block evicted just now: the hit
                # ends here.
                if b is None or not host.has(h):
                    break
                host.load(h, b)
                pool.cache_block(b, h)
                self.host_hits += self.block_size
            out.append(b)
        unused = [b for b in new if b not in out]
        pool.free([b for b in new if b in out] + unused)
        host.flush()
        return out

    def can_fit(self, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.block_size) <= self.pool.num_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: list[int] = ()) -> bool:
        """Makes room for num_new_tokens more tokens after the computed ones (and the prefix hits in
        new_computed_blocks). False, with nothing changed, when the pool lacks free blocks."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if not new_computed_blocks:  # the common case (every running request, every step): room already there?
            # (cdiv written out: this runs for every running request every step, where a call shows; measured:
            # bench/RESULTS.md)
            num_new_blocks = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - len(blocks)
            if num_new_blocks <= 0:
                return True
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(blocks) - len(new_computed_blocks)
        # Hit blocks nobody references sit in the free queue: taking them shrinks what is free.
        num_free_hits = sum(1 for b in new_computed_blocks if self.pool.ref_cnt[b] == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            return False
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            self._store(request.request_id, len(blocks), new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(blocks)
        if num_new_blocks > 0:
            new = self.pool.get_new_blocks(num_new_blocks)
            assert new is not None
            self._store(request.request_id, len(blocks), new)
            blocks.extend(new)
            if self.host is not None and self.host.pending:  # evicted cached blocks on their way to the host
                self.host.flush()
        return True

    # ---- swapping (a host tier only) -------------------------------------------------------------------------
    def swap_out(self, request: Request) -> bool:
        """Copies the blocks holding the request's computed tokens to the host tier and frees them on the device.
        False, with nothing changed, when the host cannot hold them."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid, [])[: cdiv(request.num_computed_tokens, self.block_size)]
        host_blocks = self.host.swap_out(blocks) if self.host is not None and blocks else None
        if host_blocks is None:
            return False
        self.host.flush()  # queued before any step that reuses the freed blocks
        self.free(request)
        request.swapped_blocks = host_blocks
        return True

    def swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Brings a swapped request's blocks back into fresh device blocks and makes room for num_new_tokens more.
        False, with nothing changed, when the pool lacks free blocks for both."""
        host_blocks = request.swapped_blocks
        num_total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        if max(num_total, len(host_blocks)) > self.pool.num_free_blocks:
            return False
        new = self.pool.get_new_blocks(len(host_blocks))
        self.host.swap_in(host_blocks, new)
        self.host.flush()
        request.swapped_blocks = None
        self._store(request.request_id, 0, new)
        self.req_to_blocks[request.request_id] = new
        self.num_cached_blocks[request.request_id] = 0
        return self.allocate_slots(request, num_new_tokens)

    def drop_swapped(self, request: Request) -> None:
        """A swapped request ends without coming back: its host blocks are free."""
        if request.swapped_blocks is not None:
            self.host.release(request.swapped_blocks)
            request.swapped_blocks = None

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Registers the request's blocks that are full and computed up to num_computed_tokens."""
        if not self.enable_caching:
            return
        rid = request.request_id
        start = self.num_cached_blocks.get(rid, 0)
        if num_computed_tokens // self.block_size <= start:  # no newly full block (most steps)
            return
        num_full = min(num_computed_tokens // self.block_size, len(self.req_to_blocks.get(rid, ())))
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        blocks = self.req_to_blocks[rid]
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        """Returns all of the request's blocks, tail first, so that its last blocks are evicted first."""
        rid = request.request_id
        if request.is_finished:
            self.drop_swapped(request)
        blocks = self.req_to_blocks.pop(rid, [])
        self.pool.free(reversed(blocks))
        row = self._row.pop(rid, None)
        if row is not None:
            self._table[row, : len(blocks)] = 0
            self._len[row] = 0
            self._free_rows.append(row)
        self.num_cached_blocks.pop(rid, None)
        # Keep the hashes of a preempted request: its tokens did not change.
        if request.is_finished:
            self.req_to_hashes.pop(rid, None)
