"""Small-M matmul (GEMV): y[M, N] = x[M, K] @ W[N, K]^T (+ bias), for decode's projections at batch 1..16.

At batch 1 a decode step reads every weight once and does 2 FLOPs per weight: the GEMVs are bound by HBM bandwidth, and
cuBLAS leaves bandwidth on the table where N is small (qkv and o_proj at 7B widths; measured: bench/RESULTS.md). Each
program streams a [BLOCK_N, BLOCK_K] slab of W per step (16-byte vector loads along K, evict-first: each weight is read
once per token), for BLOCK_N rows of W over its share of K. Three ways to do the multiply-adds (`mode`):
  fma       acc[BLOCK_N, m] += sum_k w * x[m], reduced along K every step, for each row m of x (few registers)
  fma_late  acc_m[BLOCK_N, BLOCK_K] += w * x[m], reduced once after the loop (one accumulator per row: M <= 4)
  dot       acc[BLOCK_N, 16] += W @ x^T on the tensor cores, x padded to 16 rows with zeros (W streamed through
            shared memory num_stages deep, as Triton pipelines any tl.dot operand)
The fma modes prefetch the next slab of W into registers (num_stages > 1), since Triton pipelines only dot operands.
Split-K (split_k > 1) gives small N enough programs: program (n, s) sums K range s, and the last of an N tile's
programs to finish adds the partials in split order and writes y (kernels/split_k.py: deterministic, one launch, no
host sync, capturable in a CUDA graph).

fp8 weights (`--quantization fp8`, engine/quant.py's Fp8Linear): W float8_e4m3fn [N, K] with a float32 scale per
output channel, y = (x @ W^T) * scale + bias. x stays 16-bit (no activation quantization: at small M the step is
bound by reading W, which is half the bytes of bf16); each fp8 element is converted exactly to float32 (fma modes)
or to x's dtype (dot: e4m3 fits bf16 and fp16 exactly), and the scale multiplies each output once, after the K
reduction (after the split-K sum). The same slabs hold twice the elements per byte, so BLOCK_K tunes separately.

Configs per (N, K) and M live in CONFIGS (filled from `python3 bench/gemv.py` on the H200) and, for fp8 weights,
CONFIGS_FP8 (from `python3 bench/fp8_gemm.py --sweep`). `linear` is the drop-in for F.linear: this kernel where
CONFIGS says it beat cuBLAS for that weight and row count, F.linear everywhere else (other shapes, larger batches,
CPU). Fp8Linear calls gemv_triton itself where CONFIGS_FP8 has a config (else per-token quantization and
torch._scaled_mm).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._checks import (FLOAT_DTYPES, FP8_DTYPE, check_out, check_same_device, check_tensor, interpreting,
                             sm_count)
from kernels.split_k import plan_split_k, split_k_reduce

INTERPRETER_SMS = 132  # the interpreter takes an H200's count, so CPU tests take the GPU's split decisions
MAX_M = 16  # rows the kernel takes: past that the matmul is no longer bandwidth-bound at these widths (cuBLAS)
MODES = ("fma", "fma_late", "dot")
_INTERPRET = interpreting()  # read once: triton.jit read it when the kernel below was decorated


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], weight [N, K], bias [N] or None -> [M, N] in x.dtype: float32 products and sums, rounded once.
    weight_scale (fp8 weights: N float32 values, [N] or [1, N]) multiplies each output after the K sum."""
    y = x.float() @ weight.float().t()  # fp8 -> float32 is exact
    if weight_scale is not None:
        y = y * weight_scale.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@dataclass(frozen=True)
class GemvConfig:
    """One launch shape of the GEMV kernel."""

    block_n: int = 16
    """Rows of W (outputs) per program; a power of two."""
    block_k: int = 256
    """Columns of W per loop step; a power of two >= 16."""
    split_k: int = 1
    """Programs sharing one row tile's K range (deterministic last-program reduction when > 1)."""
    num_warps: int = 4
    """Warps per program: 1, 2, 4, 8 or 16."""
    num_stages: int = 3
    """dot: shared-memory pipeline depth of the K loop (Triton's); fma modes: > 1 loads the next slab of W into
    registers before reducing this one (Triton pipelines only tl.dot operands)."""
    mode: str = "fma"
    """How the products are summed: fma (reduce along K per step), fma_late (reduce after the loop), dot."""

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v}: must be a power of two")
        if self.block_k < 16:
            raise ValueError(f"block_k={self.block_k}: must be >= 16")
        if self.num_warps > 16:
            raise ValueError(f"num_warps={self.num_warps}: must be <= 16")
        if self.split_k < 1:
            raise ValueError(f"split_k={self.split_k}: must be >= 1")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages}: must be >= 1")
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}: must be one of {MODES}")
        if self.mode == "dot" and self.block_n < 16:
            raise ValueError(f"block_n={self.block_n}: mode='dot' needs >= 16 (tensor-core tile)")

    def short(self) -> str:
        return (f"{self.mode}/n{self.block_n}/k{self.block_k}/s{self.split_k}/w{self.num_warps}/"
                f"st{self.num_stages}")


# (N, K) -> ((max_m, config or None), ...) ascending in max_m: M rows use the first entry with M <= max_m; None
# there means cuBLAS was faster (linear() calls F.linear). Filled from the H200 sweep: `python3 bench/gemv.py`
# prints this table for Qwen2.5-7B's projections. Shapes and M past the table: linear() calls F.linear,
# gemv_triton() without a config uses default_config. A token's GEMVs through linear() with this table against
# cuBLAS: bench/RESULTS.md.
CONFIGS: dict[tuple[int, int], tuple[tuple[int, GemvConfig | None], ...]] = {
    (4608, 3584): ((1, GemvConfig(8, 512, 1, 4, 1, 'fma_late')), (2, None), (4, None), (8, None),),
    (3584, 3584): ((1, GemvConfig(8, 512, 1, 4, 2, 'fma_late')), (2, GemvConfig(8, 512, 1, 4, 1, 'fma_late')), (4, GemvConfig(128, 128, 4, 8, 4, 'dot')), (8, GemvConfig(64, 128, 4, 4, 3, 'dot')),),
    (37888, 3584): ((1, GemvConfig(8, 512, 1, 4, 1, 'fma')), (2, GemvConfig(8, 256, 1, 4, 1, 'fma')), (4, GemvConfig(128, 128, 1, 8, 4, 'dot')), (8, GemvConfig(64, 128, 1, 4, 4, 'dot')),),
    (3584, 18944): ((1, GemvConfig(8, 512, 2, 4, 1, 'fma_late')), (2, GemvConfig(64, 128, 4, 4, 4, 'dot')), (4, GemvConfig(128, 128, 4, 8, 4, 'dot')), (8, GemvConfig(64, 128, 4, 4, 4, 'dot')),),
    (152064, 3584): ((1, GemvConfig(8, 512, 1, 4, 1, 'fma')), (2, GemvConfig(128, 256, 1, 8, 3, 'dot')), (4, GemvConfig(128, 128, 1, 8, 4, 'dot')), (8, GemvConfig(128, 128, 1, 8, 4, 'dot')),),
}

# The same for float8_e4m3fn weights (Fp8Linear), against per-token quantization + torch._scaled_mm: None there means
# _scaled_mm was faster; shapes and M past the table take _scaled_mm. BLOCK_K counts elements (1 byte each here).
# Filled from the H200 sweep: `python3 bench/fp8_gemm.py --sweep` prints this table for Qwen2.5-7B's layer linears.
# A token's linears through this table against bf16 and _scaled_mm: bench/RESULTS.md.
CONFIGS_FP8: dict[tuple[int, int], tuple[tuple[int, GemvConfig | None], ...]] = {
    (4608, 3584): ((1, GemvConfig(8, 1024, 1, 4, 1, 'fma')), (2, GemvConfig(8, 512, 1, 4, 2, 'fma')), (4, GemvConfig(64, 256, 4, 4, 3, 'dot')), (8, GemvConfig(64, 256, 4, 4, 3, 'dot')), (16, GemvConfig(64, 128, 4, 4, 3, 'dot')),),
    (3584, 3584): ((1, GemvConfig(8, 1024, 1, 4, 1, 'fma_late')), (2, GemvConfig(8, 512, 1, 4, 2, 'fma_late')), (4, GemvConfig(64, 128, 4, 4, 3, 'dot')), (8, GemvConfig(64, 128, 4, 4, 3, 'dot')), (16, GemvConfig(64, 128, 4, 4, 3, 'dot')),),
    (37888, 3584): ((1, GemvConfig(8, 1024, 1, 4, 1, 'fma')), (2, None), (4, None), (8, None), (16, None),),
    (3584, 18944): ((1, GemvConfig(8, 1024, 2, 4, 1, 'fma')), (2, GemvConfig(16, 512, 4, 4, 2, 'fma')), (4, GemvConfig(64, 128, 4, 4, 3, 'dot')), (8, GemvConfig(64, 128, 4, 4, 3, 'dot')), (16, GemvConfig(64, 128, 4, 4, 3, 'dot')),),
}


def table_config(M: int, N: int, K: int, fp8: bool = False) -> GemvConfig | None:
    """The measured config for M rows of an (N, K) weight (CONFIGS_FP8 for fp8 weights), None where the table has
    none (or says cuBLAS / _scaled_mm)."""
    for max_m, cfg in (CONFIGS_FP8 if fp8 else CONFIGS).get((N, K), ()):
        if M <= max_m:
            return cfg
    return None


def default_config(M: int, N: int, K: int, num_sms: int = 132, fp8: bool = False) -> GemvConfig:
    """A guess for shapes the table lacks: tensor cores from 4 rows on, else per-step FMA reduction; row tiles
    small enough that the grid fills every SM a few times over, split-K only where N alone cannot. fp8 weights:
    twice the fma slab's columns (the same bytes)."""
    mode = "dot" if M >= 4 else "fma"
    want_k = 512 if fp8 and mode == "fma" else 256
    block_k = want_k if K >= want_k else max(16, triton.next_power_of_2(K))
    block_n = 64 if mode == "dot" else 16
    target = 4 * num_sms  # programs: a few per SM keep enough loads in flight
    tiles = triton.cdiv(N, block_n)
    while mode != "dot" and block_n > 4 and tiles < target:
        block_n //= 2
        tiles = triton.cdiv(N, block_n)
    split_k = 1
    if tiles < target:
        split_k = max(1, min(triton.cdiv(target, tiles), K // (4 * block_k)))
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=3, mode=mode)


def pick_config(M: int, N: int, K: int, num_sms: int = 132, fp8: bool = False) -> GemvConfig:
    return table_config(M, N, K, fp8) or default_config(M, N, K, num_sms, fp8)


@triton.jit
def _fma_row(acc, w, x_rows, cols, kmask, m: tl.constexpr, M, stride_xm, rm, BLOCK_M: tl.constexpr,
             EVEN_K: tl.constexpr):
    """acc[:, m] += w @ x[m, cols] (one row of x, reduced along K now)."""
    x_ptrs = x_rows + tl.minimum(M - 1, m) * stride_xm + cols  # [BLOCK_K]; rows past M repeat row M-1 (dropped later)
    if EVEN_K:
        x = tl.load(x_ptrs, eviction_policy="evict_last")
    else:
        x = tl.load(x_ptrs, mask=kmask, other=0.0, eviction_policy="evict_last")
    p = tl.sum(w * x.to(tl.float32)[None, :], axis=1)  # [BLOCK_N]
    if BLOCK_M == 1:
        return acc + p[:, None]
    return tl.where(rm[None, :] == m, acc + p[:, None], acc)


@triton.jit
def _fma_late_row(acc_m, w, x_rows, cols, kmask, m: tl.constexpr, M, stride_xm, EVEN_K: tl.constexpr):
    """acc_m[BLOCK_N, BLOCK_K] += w * x[m, cols] (reduced along K after the loop)."""
    x_ptrs = x_rows + tl.minimum(M - 1, m) * stride_xm + cols
    if EVEN_K:
        x = tl.load(x_ptrs, eviction_policy="evict_last")
    else:
        x = tl.load(x_ptrs, mask=kmask, other=0.0, eviction_policy="evict_last")
    return acc_m + w * x.to(tl.float32)[None, :]


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] x's dtype, or float8e4nv (W_FP8)
    scale_ptr,  # [N] float32 per-output weight scale (only when W_FP8)
    bias_ptr,  # [N] (only when HAS_BIAS)
    y_ptr,  # [M, N]
    part_ptr,  # [num_splits, M, N] float32 partial sums (only when SPLIT)
    count_ptr,  # [>= cdiv(N, BLOCK_N)] int32 tickets, 0 between launches (only when SPLIT)
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    k_per_split,  # K columns per split, a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,  # >= M, a power of two (>= 16 for dot, <= 4 for fma_late)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MODE: tl.constexpr,  # "fma" | "fma_late" | "dot"
    PREFETCH: tl.constexpr,  # fma modes: load the next slab of W before reducing this one
    SPLIT: tl.constexpr,  # more than one program along K
    HAS_BIAS: tl.constexpr,
    W_FP8: tl.constexpr,  # W is float8_e4m3fn: converted exactly after the load, scaled per output after the K sum
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no column masks
    INTERPRET: tl.constexpr,  # Triton >= 3.9's interpreter rejects a scalar load mask: the (same) column mask there
    DOT_FP32: tl.constexpr,  # float32 dot operands, exact products: float32 inputs, and the interpreter (whose
                             # bf16 dot is wrong)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns = rows of W
    rm = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    # Rows past N load row N-1 again instead of masking: the loads stay unmasked 16-byte vectors, and the stores
    # below drop those results.
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)  # every split has at least one column (host side)
    rk = tl.arange(0, BLOCK_K)  # [BLOCK_K]

    # The accumulator is transposed, acc[n, m]: rows of W stay the leading axis everywhere.
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if MODE == "dot":
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
        mrow = (rm < M)[:, None]  # x's padding rows (to the tensor-core tile) read nothing: zeros
        for k0 in range(k_lo, k_hi, BLOCK_K):
            cols = k0 + rk
            if EVEN_K:
                w = tl.load(w_rows + cols[None, :], eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K]
                x = tl.load(x_rows + cols[None, :], mask=mrow, other=0.0)  # [BLOCK_M, BLOCK_K]
            else:
                kmask = (cols < k_hi)[None, :]
                w = tl.load(w_rows + cols[None, :], mask=kmask, other=0.0, eviction_policy="evict_first")
                x = tl.load(x_rows + cols[None, :], mask=mrow & kmask, other=0.0)
            if DOT_FP32:
                acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
            elif W_FP8:
                acc += tl.dot(w.to(x.dtype), tl.trans(x))  # e4m3 -> bf16/fp16 is exact
            else:
                acc += tl.dot(w, tl.trans(x))  # [BLOCK_N, BLOCK_M]
    else:
        x_rows = x_ptr  # row m at + m * stride_xm
        if MODE == "fma_late":
            acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        w_next = tl.load(w_rows + (k_lo + rk)[None, :], mask=PREFETCH & ((k_lo + rk) < k_hi)[None, :], other=0.0,
                         eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K] the first slab (PREFETCH only)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            cols = k0 + rk
            kmask = cols < k_hi
            if PREFETCH:
                w = w_next
                ncols = cols + BLOCK_K
                if EVEN_K and not INTERPRET:  # a row-uniform predicate keeps the loads vectorized
                    w_next = tl.load(w_rows + ncols[None, :], mask=k0 + BLOCK_K < k_hi, other=0.0,
                                     eviction_policy="evict_first")
                else:
                    w_next = tl.load(w_rows + ncols[None, :], mask=(ncols < k_hi)[None, :], other=0.0,
                                     eviction_policy="evict_first")
            else:
                if EVEN_K:
                    w = tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
                else:
                    w = tl.load(w_rows + cols[None, :], mask=kmask[None, :], other=0.0, eviction_policy="evict_first")
            wf = w.to(tl.float32)  # [BLOCK_N, BLOCK_K]
            if MODE == "fma_late":
                acc0 = _fma_late_row(acc0, wf, x_rows, cols, kmask, 0, M, stride_xm, EVEN_K)
                if BLOCK_M > 1:
                    acc1 = _fma_late_row(acc1, wf, x_rows, cols, kmask, 1, M, stride_xm, EVEN_K)
                if BLOCK_M > 2:
                    acc2 = _fma_late_row(acc2, wf, x_rows, cols, kmask, 2, M, stride_xm, EVEN_K)
                    acc3 = _fma_late_row(acc3, wf, x_rows, cols, kmask, 3, M, stride_xm, EVEN_K)
            else:
                for m in tl.static_range(BLOCK_M):
                    acc = _fma_row(acc, wf, x_rows, cols, kmask, m, M, stride_xm, rm, BLOCK_M, EVEN_K)
        if MODE == "fma_late":
            acc = tl.where(rm[None, :] == 0, tl.sum(acc0, axis=1)[:, None], acc)
            if BLOCK_M > 1:
                acc = tl.where(rm[None, :] == 1, tl.sum(acc1, axis=1)[:, None], acc)
            if BLOCK_M > 2:
                acc = tl.where(rm[None, :] == 2, tl.sum(acc2, axis=1)[:, None], acc)
                acc = tl.where(rm[None, :] == 3, tl.sum(acc3, axis=1)[:, None], acc)

    out_mask = (rn < N)[:, None] & (rm < M)[None, :]  # [BLOCK_N, BLOCK_M]
    y_ptrs = y_ptr + rm.to(tl.int64)[None, :] * stride_ym + rn[:, None]
    if SPLIT:
        tile = rm.to(tl.int64)[None, :] * N + rn[:, None]  # [BLOCK_N, BLOCK_M] offsets inside one [M, N] partial
        split_stride = (tl.zeros((), dtype=tl.int64) + M) * N  # elements of one partial, in 64 bits
        total, last = split_k_reduce(acc, part_ptr, count_ptr, pid_n, tile, out_mask, split_stride)
        if last:
            if W_FP8:
                total *= tl.load(scale_ptr + rn, mask=rn < N, other=0.0)[:, None]
            if HAS_BIAS:
                total += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        if W_FP8:
            acc *= tl.load(scale_ptr + rn, mask=rn < N, other=0.0)[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def gemv_triton(
    x: torch.Tensor,  # [M, K], M <= MAX_M
    weight: torch.Tensor,  # [N, K], as nn.Linear stores it; x's dtype, or float8_e4m3fn with weight_scale
    bias: torch.Tensor | None = None,  # [N]
    *,
    weight_scale: torch.Tensor | None = None,  # fp8 weight: [N] or [1, N] float32, contiguous (Fp8Linear's [1, N])
    out: torch.Tensor | None = None,  # [M, N] in x.dtype
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias for M <= MAX_M rows, in x.dtype (float32 sums); for an fp8 weight,
    (x @ weight.T) * weight_scale + bias with x unquantized. No host sync, no data-dependent allocation: capturable
    in a CUDA graph."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    M, K = x.shape
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype, FP8_DTYPE), shape=(None, K))
    N = weight.shape[0]
    fp8 = weight.dtype == FP8_DTYPE
    if fp8:
        if weight_scale is None:
            raise ValueError("weight_scale: None for a float8_e4m3fn weight; pass its [N] float32 per-output scales")
        check_tensor("weight_scale", weight_scale, dtypes=(torch.float32,))
        if weight_scale.numel() != N or not weight_scale.is_contiguous() or weight_scale.dim() > 2:
            raise ValueError(f"weight_scale: shape {tuple(weight_scale.shape)} "
                             f"(contiguous={weight_scale.is_contiguous()}), expected [{N}] or [1, {N}] contiguous")
        check_same_device(x=x, weight=weight, weight_scale=weight_scale)
    elif weight_scale is not None:
        raise ValueError(f"weight_scale: given for a {weight.dtype} weight; only float8_e4m3fn weights take a scale")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(x.dtype,), shape=(N,))
        check_same_device(x=x, weight=weight, bias=bias)
    else:
        check_same_device(x=x, weight=weight)
    if M > MAX_M:
        raise ValueError(f"x: {M} rows, the GEMV takes at most MAX_M={MAX_M} (use F.linear)")
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    else:
        check_out("out", out, (M, N), x.dtype, x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.copy_(bias.expand(M, N) if bias is not None else torch.zeros_like(out))
    cfg = config or pick_config(M, N, K, sm_count(x.device, INTERPRETER_SMS), fp8)
    block_m = max(16 if cfg.mode == "dot" else 1, triton.next_power_of_2(M))
    if cfg.mode == "fma_late" and block_m > 4:
        raise ValueError(f"x: {M} rows, mode='fma_late' takes at most 4 (config {cfg.short()})")
    tiles = triton.cdiv(N, cfg.block_n)
    plan = plan_split_k(K, cfg.block_k, cfg.split_k, tiles, out, f"weight: N={N} in row tiles of {cfg.block_n}")
    _gemv_kernel[(tiles, plan.num_splits)](
        x, weight, weight_scale if fp8 else out, bias if bias is not None else out, out, plan.part, plan.counters,
        M, N, K, x.stride(0), weight.stride(0), out.stride(0), plan.k_per_split,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, MODE=cfg.mode,
        PREFETCH=cfg.mode != "dot" and cfg.num_stages > 1, SPLIT=plan.split,
        HAS_BIAS=bias is not None, W_FP8=fp8, EVEN_K=K % cfg.block_k == 0, INTERPRET=_INTERPRET,
        DOT_FP32=x.dtype == torch.float32 or _INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the GEMV kernel where CONFIGS holds a measured config for this weight's
    (N, K) and x's rows (16-bit CUDA tensors, 2-D x, at most MAX_M rows); F.linear everywhere else."""
    if x.is_cuda and x.dim() == 2 and x.dtype != torch.float32 and 0 < x.shape[0] <= MAX_M:
        cfg = table_config(x.shape[0], weight.shape[0], weight.shape[1])
        if cfg is not None:
            return gemv_triton(x, weight, bias, config=cfg)
    return F.linear(x, weight, bias)
