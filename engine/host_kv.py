"""The host KV tier (`--swap-space GiB`): a second pool of KV blocks in host memory, pinned on CUDA.

It holds two kinds of block:
- prefix blocks: a block evicted from the device's prefix cache (its hash known, its contents about to be
  overwritten) is copied here first, keyed by the same hash; a later prompt with that prefix finds it here when the
  device no longer has it, and it is copied back into a fresh device block instead of being recomputed (LMCache's and
  SGLang HiCache's idea). These are least-recently-used and may be dropped whenever room is needed.
- swapped requests' blocks: a preempted request whose KV is cheaper to copy out and back than to recompute
  (engine/scheduler.py says when) keeps its blocks here, owned, until it runs again.

Copies are recorded as the block manager hands blocks out and are issued by `flush()` before the manager returns to
its caller, in the order recorded, on the current stream (as the KV transports issue theirs): a device block's copy
out is queued before anything that step writes into it, a copy in before the step that reads it, and a host block
reused for another copy out is written only after the copy in that read it, with no host wait. On the CPU device the
host tier is a second CPU tensor and the copies are plain ones.

With tensor parallelism every rank holds a host tier of the same blocks for its own KV heads: rank 0 keeps the
bookkeeping here and `flush()` hands the same copies to `replicate` (the engine sends them to the workers, whose
runners apply them with `apply_copies`, in order with the steps), so block ids mean the same on every rank's host as
on its device.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from engine.block_pool import BlockHash

OUT, IN = 0, 1  # device -> host, host -> device


def host_tensors_for(device_tensors: Sequence[torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    """Host blocks for each of device_tensors (pinned when they are on CUDA)."""
    pin = device_tensors[0].device.type == "cuda"
    return [torch.empty((num_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in device_tensors]


def apply_copies(ops: list[tuple[int, int, int]], device_tensors: Sequence[torch.Tensor],
                 host_tensors: Sequence[torch.Tensor]) -> None:
    """Issues copies (direction, source block, destination block) in order on the current stream; runs of
    consecutive blocks in one direction are one copy each."""
    i = 0
    while i < len(ops):
        d, s, t = ops[i]
        n = 1
        while i + n < len(ops) and ops[i + n] == (d, s + n, t + n):
            n += 1
        for dev, host in zip(device_tensors, host_tensors):
            if d == OUT:
                host[t: t + n].copy_(dev[s: s + n], non_blocking=True)
            else:
                dev[t: t + n].copy_(host[s: s + n], non_blocking=True)
        i += n


class HostKVTier:
    def __init__(self, device_tensors: Sequence[torch.Tensor], num_blocks: int,
                 replicate: Callable[[list[tuple[int, int, int]]], None] | None = None):
        """device_tensors: every tensor indexed by device block id in dim 0 (the KV cache; per-block scales if
        any); num_blocks: host blocks; replicate: called with each flush's copies before they are issued here (the
        other tensor-parallel ranks issue the same on theirs)."""
        assert num_blocks >= 1
        self.device_tensors = list(device_tensors)
        self.host_tensors = host_tensors_for(self.device_tensors, num_blocks)
        self.replicate = replicate
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives the lowest first
        self.prefix: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> host block, least recently used first
        self.owned = 0  # blocks held by swapped requests
        self._ops: list[tuple[int, int, int]] = []  # (direction, source block, destination block), in order
        # Counters, in blocks (the engine turns them into metrics).
        self.stored = 0
        self.loaded = 0
        self.swapped_out = 0
        self.swapped_in = 0

    @classmethod
    def blocks_for(cls, swap_space_gib: float, bytes_per_block: int) -> int:
        return int(swap_space_gib * (1 << 30) // bytes_per_block)

    # ---- room -------------------------------------------------------------------------------------------------
    def num_available(self) -> int:
        """Blocks a swap-out could take: free ones and prefix blocks (which are dropped for it)."""
        return len(self.free) + len(self.prefix)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def _take(self) -> int | None:
        if self.free:
            return self.free.pop()
        if self.prefix:
            _, block = self.prefix.popitem(last=False)
            return block
        return None

    # ---- prefix blocks ----------------------------------------------------------------------------------------
    def store(self, device_block: int, block_hash: BlockHash) -> None:
        """The device is about to reuse device_block, which holds the prefix block_hash: keep a copy (if the host
        has it already, only its recency changes). Dropped when the host has no room."""
        if block_hash in self.prefix:
            self.prefix.move_to_end(block_hash)
            return
        host = self._take()
        if host is None:
            return
        self._ops.append((OUT, device_block, host))
        self.prefix[block_hash] = host
        self.stored += 1

    def has(self, block_hash: BlockHash) -> bool:
        return block_hash in self.prefix

    def load(self, block_hash: BlockHash, device_block: int) -> None:
        """Copies the prefix block block_hash into device_block (a fresh block the caller registers under the same
        hash). The host keeps its copy."""
        host = self.prefix[block_hash]
        self.prefix.move_to_end(block_hash)
        self._ops.append((IN, host, device_block))
        self.loaded += 1

    # ---- swapped requests -------------------------------------------------------------------------------------
    def swap_out(self, device_blocks: Sequence[int]) -> list[int] | None:
        """Host blocks holding copies of device_blocks (owned until swap_in), or None (nothing taken) when the host
        cannot hold them all."""
        if len(device_blocks) > self.num_available():
            return None
        host = [self._take() for _ in device_blocks]
        self._ops.extend((OUT, d, h) for d, h in zip(device_blocks, host))
        self.owned += len(host)
        self.swapped_out += len(host)
        return host

    def swap_in(self, host_blocks: Sequence[int], device_blocks: Sequence[int]) -> None:
        """Copies a swapped request's blocks back and frees them on the host (a later copy out into one of them is
        queued after this copy in)."""
        self._ops.extend((IN, h, d) for h, d in zip(host_blocks, device_blocks))
        self.release(host_blocks)
        self.swapped_in += len(host_blocks)

    def release(self, host_blocks: Sequence[int]) -> None:
        """A swapped request ended (or was aborted) without coming back: its host blocks are free."""
        self.free.extend(host_blocks)
        self.owned -= len(host_blocks)

    # ---- copies -----------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Issues the recorded copies, in order; runs of consecutive blocks in one direction are one copy each."""
        ops, self._ops = self._ops, []
        if ops and self.replicate is not None:
            self.replicate(ops)
        apply_copies(ops, self.device_tensors, self.host_tensors)

    @property
    def pending(self) -> int:
        return len(self._ops)
