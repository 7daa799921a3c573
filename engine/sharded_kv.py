"""A tensor-parallel engine's KV cache as a KV transfer sees it: whole blocks, every KV head in them.

Rank r of a tensor-parallel engine holds KV heads [r * h, (r + 1) * h) of every block (engine/tp.py). A KV transfer
moves whole blocks between engines whose tensor-parallel sizes may differ (prefill tp=2 -> decode tp=1 and the
reverse), so both ends speak in full-head blocks: the sender's rank 0 gathers each run's heads from the ranks
(`read`), the receiver's rank 0 scatters each rank its own heads (`write`). Each rank's share of a block travels over
the engine's own process group (NCCL on GPUs, gloo on the CPU) in order with the steps (ModelRunner.gather_kv_blocks
and scatter_kv_blocks, which every rank runs). The layout both sides check (kv_transfer/layout.layout_of) is then the
model's: all of its KV heads, whatever either side's tensor-parallel size. (An int8 cache's (layer, K/V) regions
hold their values, then their scales, kernels/quant_int8.py: a rank's heads are two slices of each, which the gather
and scatter join and split, engine/collectives.py, so a full-head block is tp=1's bytes.)
"""
from __future__ import annotations

import torch


class ShardedKvCache:
    """Duck-types the parts of a KV cache tensor that kv_transfer/layout.layout_of reads (shape, dtype,
    element_size, device), with the shape of the whole model's cache; blocks move through read and write."""

    def __init__(self, runner):
        self._runner = runner
        n, layers, two, block_size, heads, row = runner.kv_cache.shape
        self.tensor_parallel_size = runner.tp_size
        self.shape = torch.Size((n, layers, two, block_size, heads * runner.tp_size, row))
        self.dtype = runner.kv_cache.dtype
        self.device = runner.kv_cache.device

    def element_size(self) -> int:
        return self._runner.kv_cache.element_size()

    def read(self, block_ids: list[int]) -> torch.Tensor:
        """Engine thread: blocks `block_ids`, [n, num_layers, 2, block_size, num_kv_heads, row], every head."""
        return self._runner.gather_kv_blocks(block_ids)

    def collective_rpc(self, fn, *args) -> list:
        """Engine thread: fn(runner, *args) on every rank, the results in rank order (ModelRunner.collective_rpc):
        what a transport that moves each rank's own heads runs (kv_transfer/nixl.py)."""
        return self._runner.collective_rpc(fn, args)

    def write(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Engine thread: cache[block_ids] = blocks (shaped as read returns them), each rank its own heads."""
        self._runner.scatter_kv_blocks(block_ids, blocks)
