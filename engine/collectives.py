"""The collectives every tensor-parallel rank runs, in the same order (engine/tp_worker.py tells the life of a step).

One process group per engine: NCCL on CUDA (rank r on cuda:base+r), gloo on the CPU, joined through a file
rendezvous. Rank 0 (engine/tp_executor.py) and the workers (engine/tp_worker.py) call these; the model runner calls
min_over_ranks, share_tokens, gather_heads and scatter_heads without knowing which side of the group it is on.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from kernels.quant_int8 import int8_join_heads, int8_split_heads


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or the group broke: this engine cannot run another step."""


class RankError(RuntimeError):
    """A collective_rpc function raised on one rank (the group is well: only that call failed). `code` is the
    exception's own `code` attribute where it had one (a ServiceError's status)."""

    def __init__(self, rank: int, kind: str, message: str, code=None):
        super().__init__(f"rank {rank}: {kind}: {message}")
        self.rank, self.kind, self.message, self.code = rank, kind, message, code

    @classmethod
    def of(cls, rank: int, e: BaseException) -> "RankError":
        return cls(rank, type(e).__name__, str(e), getattr(e, "code", None))

    def __reduce__(self):  # (sent between ranks by gather_object)
        return RankError, (self.rank, self.kind, self.message, self.code)


# How long a rank waits on the engine's gloo group, e.g. for rank 0's next message with ranks on several hosts: an
# idle engine sends none, so this is no deadline (a peer that dies closes its connections, which ends a wait at once).
CPU_GROUP_TIMEOUT = timedelta(days=365)


def init_group(rank: int, world: int, device: torch.device, init_method: str):
    """Joins the engine's process group, and returns a gloo group of the same ranks for host objects: rank 0's
    messages with ranks on several hosts (send_message / receive_message), collective_rpc's results."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world)
    return dist.new_group(backend="gloo", timeout=CPU_GROUP_TIMEOUT)


def send_message(msg: bytes, group) -> None:
    """Rank 0: one message to every rank of the gloo group (its length, then its bytes)."""
    dist.broadcast(torch.tensor([len(msg)], dtype=torch.int64), 0, group=group)
    dist.broadcast(torch.frombuffer(bytearray(msg), dtype=torch.uint8), 0, group=group)


def receive_message(group) -> bytearray:
    """A worker: rank 0's next message on the gloo group."""
    n = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(n, 0, group=group)
    buf = bytearray(int(n.item()))
    dist.broadcast(torch.frombuffer(buf, dtype=torch.uint8), 0, group=group)
    return buf


def barrier(device: torch.device) -> None:
    """An all-reduce every rank waits for (dist.barrier on NCCL guesses the device)."""
    t = torch.zeros(1, device=device)
    dist.all_reduce(t)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def min_over_ranks(n: int, device: torch.device) -> int:
    """The smallest of every rank's n (the KV blocks each rank's budget holds: block ids mean the same on all)."""
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def share_tokens(token_ids: torch.Tensor) -> None:
    """Rank 0: sends a step's sampled tokens [num_sampled] int64 to the workers (receive_tokens on each)."""
    assert token_ids.dtype == torch.int64 and token_ids.is_contiguous(), (token_ids.dtype, token_ids.stride())
    dist.broadcast(token_ids, 0)


def receive_tokens(num_sampled: int, device: torch.device) -> torch.Tensor:
    """A worker: rank 0's sampled tokens of this step, [num_sampled] int64 on `device`."""
    tokens = torch.empty(num_sampled, dtype=torch.int64, device=device)
    dist.broadcast(tokens, 0)
    return tokens


def gather_heads(local: torch.Tensor, rank: int, world: int) -> torch.Tensor | None:
    """KV blocks [n, layers, 2, block_size, heads_per_rank, row] of every rank, joined on rank 0 along the heads
    (rank r holds KV heads [r * heads_per_rank, (r + 1) * heads_per_rank)); None on the other ranks. The bytes travel
    as uint8, whatever the cache's dtype (gloo has no float8). An int8 cache's blocks hold each region's values, then
    its scales (kernels/quant_int8.py): joined as such (int8_join_heads), so the result is the full-head layout."""
    flat = local.contiguous().view(torch.uint8)
    parts = [torch.empty_like(flat) for _ in range(world)] if rank == 0 else None
    dist.gather(flat, parts, dst=0)
    if rank != 0:
        return None
    parts = [p.view(local.dtype) for p in parts]
    if local.dtype == torch.int8:  # each block's values, then its scales: a rank's heads are two slices of it
        return int8_join_heads(parts)
    return torch.cat(parts, dim=4)


def scatter_heads(full: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  rank: int, world: int) -> torch.Tensor:
    """The inverse of gather_heads: rank 0's full-head blocks, each rank receiving its own heads, `shape` [n, layers,
    2, block_size, heads_per_rank, row]; `full` is None on the other ranks."""
    out = torch.empty(shape, dtype=dtype, device=device)
    parts = None
    if rank == 0:
        heads = int8_split_heads(full, world) if dtype == torch.int8 else full.chunk(world, dim=4)
        parts = [p.contiguous().view(torch.uint8) for p in heads]
    dist.scatter(out.view(torch.uint8), parts, src=0)
    return out
