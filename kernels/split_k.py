"""Split-K for the small-M kernels (kernels/gemv.py, kernels/w4a16.py, kernels/w4a16_gemv.py): one plan on the host,
one reduction in the kernel.

The life of a split launch:
1. The launcher calls plan_split_k: K is cut into num_splits ranges of k_per_split columns (a multiple of the
   kernel's K step, so every range but the last is whole steps and none is empty); with more than one, a float32
   workspace part [num_splits, M, N] and the device's ticket counters come with the plan. Grid axis 1 is the split.
2. Program (tile, s) sums its range into acc and calls split_k_reduce: it writes acc to part[s], then takes a ticket
   from its output tile's counter. The program that takes the last ticket sums the num_splits partials in split
   order (s = 0, 1, ...), so the result does not depend on which program finished last (no float atomics), and
   resets the counter to 0 for the next launch; the caller adds its epilogue (scale, bias) and stores y there.
One launch, no host sync: capturable in a CUDA graph. The counters are one zeroed buffer per device, made at the
first split launch (not inside a graph capture: warm up outside first, as the engine's capture does). Two split
launches on different streams running at the same time would share counters: launches on one stream only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

COUNTERS_PER_DEVICE = 1 << 16  # output tiles a split launch may have (one int32 ticket counter each)

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device) -> torch.Tensor:
    """The device's ticket counters (COUNTERS_PER_DEVICE int32 zeros between launches)."""
    c = _COUNTERS.get(device)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split-K: the first split launch on a device is inside a CUDA graph capture; launch "
                               "once outside the capture first (it makes the zeroed ticket counters)")
        c = _COUNTERS[device] = torch.zeros(COUNTERS_PER_DEVICE, dtype=torch.int32, device=device)
    return c


@dataclass(frozen=True)
class SplitKPlan:
    """How one launch splits K: grid axis 1 has num_splits programs per output tile."""

    k_per_split: int
    """K columns per split, a multiple of the kernel's K step."""
    num_splits: int
    """<= the split_k asked for: no empty splits."""
    part: torch.Tensor
    """[num_splits, M, N] float32 partial sums; the output itself (unused) when num_splits == 1."""
    counters: torch.Tensor
    """The device's ticket counters; the output itself (unused) when num_splits == 1."""

    @property
    def split(self) -> bool:
        return self.num_splits > 1


def plan_split_k(K: int, block_k: int, split_k: int, tiles: int, out: torch.Tensor, what: str) -> SplitKPlan:
    """The split of K columns, in steps of block_k, into at most split_k ranges for a launch of `tiles` output tiles
    writing `out` [M, N]; `what` names the weight in the error for too many tiles."""
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    num_splits = triton.cdiv(K, k_per_split)
    if num_splits == 1:
        return SplitKPlan(k_per_split, 1, out, out)
    if tiles > COUNTERS_PER_DEVICE:
        raise ValueError(f"{what} makes {tiles} output tiles, split-K takes at most {COUNTERS_PER_DEVICE} "
                         "(use split_k=1 or larger blocks)")
    part = torch.empty((num_splits, *out.shape), dtype=torch.float32, device=out.device)
    return SplitKPlan(k_per_split, num_splits, part, counters(out.device))


@triton.jit
def split_k_reduce(acc, part_ptr, count_ptr, counter, tile, mask, split_stride):
    """Step 2 of the module docstring for one output tile: acc (float32, any shape) is this program's partial; tile
    its offsets inside one [M, N] partial, mask the elements that exist, split_stride M * N (64-bit). Returns (total,
    last): in the program that took the last ticket of counter `counter`, last is True and total the partials' sum in
    split order; elsewhere last is False (total is zeros)."""
    tl.store(part_ptr + tl.program_id(1) * split_stride + tile, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial is written before the ticket releases them (CTA, then GPU)
    ticket = tl.atomic_add(count_ptr + counter, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    num_splits = tl.num_programs(1)
    last = ticket == num_splits - 1
    total = tl.zeros_like(acc)
    if last:  # all partials are visible
        for sp in range(0, num_splits):  # in split order, whichever program came last
            total += tl.load(part_ptr + sp * split_stride + tile, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(count_ptr + counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch
    return total, last
