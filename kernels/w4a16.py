"""4-bit weights, 16-bit activations (W4A16): y[M, N] = x[M, K] @ W[K, N] (+ bias), W dequantized inside the kernel.

Every 4-bit checkpoint format (AWQ, GPTQ, compressed-tensors: engine/quant_w4.py) is repacked at load into the one
layout these kernels read, for a weight of K inputs, N outputs and groups of G consecutive inputs (G divides K):
  qweight  int32 [K / 8, N]  nibble j (bits 4j..4j+3) of qweight[i, n] holds q[8i + j, n], unsigned 0..15
  scales   [K / G, N]        float16, bfloat16 or float32 (the checkpoint's values, exactly)
  qzeros   uint8 [K / G, N]  zero points, or None: 8 for every group (symmetric formats)
  perm     int32 [K]         or None: row r of W multiplies input column perm[r] (act order, sorted into groups)
  W[r, n] = (q[r, n] - z[r // G, n]) * s[r // G, n],    y[m, n] = sum_r x[m, perm[r]] * W[r, n]
qweight is packed along K, N contiguous: a tile of W is BLOCK_K / 8 rows of int32 words, each row one coalesced
read, and 8 consecutive inputs of one output share a word. Each K step stays inside one group (BLOCK_K divides G),
so its scale and zero point are one row [BLOCK_N] and the scale multiplies the step's partial sum once:
acc += (x_tile @ (q - z)_tile) * s. q - z (integers in [-16, 15]) is exact in any float dtype, so the products are
x's own values times small integers and the only roundings are float32 sums and one multiply per group.

One kernel here, _w4a16_kernel: output tiles on grid axis 0 (group-M swizzled), K splits on axis 1; split-K
(split_k > 1) sums the K ranges deterministically (kernels/split_k.py). q - z is made without an int->float
conversion: the bits 0x4B000000 | q are the float32 2^23 + q, minus (2^23 + z), exactly.
  gemv  M <= GEMV_MAX_M rows (decode): every packed word is read once for all M rows. One row: the kernels of
        kernels/w4a16_gemv.py, _w4a16_pair_kernel for bfloat16 x (mode 'pair': paired bf16 FMAs, two weights an
        instruction) and _w4a16_stream_kernel otherwise (mode 'stream': float32 FMAs; also forced up to
        STREAM_MAX_M rows); 2..16 rows (MODE 2): the rows padded to 16 and one tl.dot per step (16 rows cost what
        one does); blocks under 16 (tests) loop over the rows with FMAs (MODE 0). MODE 1 (the older one-row FMA
        path, [BLOCK_K / 8, 8, BLOCK_N] slabs) is still reached with mode 'fma'.
  gemm  any M (prefill): [BLOCK_M, BLOCK_N] tiles, the unpacked [BLOCK_K, BLOCK_N] tile of (q - z) in x's dtype
        fed to tl.dot (the tensor cores; float32 x, and the interpreter, take an exact float32 dot).
Both read x through perm when there is one (act order): no separate gather.

`w4a16_ref` is the contract: dequantize W in float32, multiply in float32, round once. The launchers check shapes,
dtypes and strides; configs come from an H200 sweep (GEMV_TABLE, default_gemm_config; bench/w4a16_gemm.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._checks import (FLOAT_DTYPES, check_block_k, check_out, check_same_device, check_tensor, interpreting,
                             sm_count)
from kernels.gemv import INTERPRETER_SMS
from kernels.split_k import COUNTERS_PER_DEVICE, plan_split_k, split_k_reduce
from kernels.w4a16_gemv import launch_pair, launch_stream

PACK = 8  # 4-bit values per int32 word
GEMV_MAX_M = 16  # rows the GEMV takes (its FMA loop is unrolled per row); the GEMM takes any M
STREAM_MAX_M = 4  # rows the stream kernel takes: its FMAs per weight grow with the rows, the tensor cores' do not
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INTERPRET = interpreting()  # read once: triton.jit read it when the kernels below were decorated


# ---------------------------------------------------------------------------------------------------------------
# The layout and the reference


def pack_w4(q: torch.Tensor) -> torch.Tensor:
    """q [K, N] integers in 0..15 (any integer dtype) -> qweight int32 [K / 8, N], 8 consecutive rows per word.
    One nibble row at a time: the load's temporaries stay near a byte per weight."""
    K, N = q.shape
    assert K % PACK == 0, f"K={K} is not a multiple of {PACK}"
    words = torch.zeros(K // PACK, N, dtype=torch.int64, device=q.device)  # < 2^32
    for j in range(PACK):
        words |= q[j::PACK].to(torch.int64) << (4 * j)  # rows 8i + j
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the same 32 bits as a signed int32


def unpack_w4(qweight: torch.Tensor) -> torch.Tensor:
    """qweight int32 [K / 8, N] -> q uint8 [K, N] (pack_w4's inverse)."""
    q = torch.empty(qweight.shape[0], PACK, qweight.shape[1], dtype=torch.uint8, device=qweight.device)
    for j in range(PACK):
        q[:, j] = ((qweight >> (4 * j)) & 0xF).to(torch.uint8)  # row 8i + j
    return q.reshape(-1, qweight.shape[1])


def dequantize_w4_ref(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None) -> torch.Tensor:
    """W float32 [K, N] = (q - z) * s, the group of row r being r // (K / num_groups); z = 8 without qzeros."""
    q = unpack_w4(qweight).to(torch.float32)  # [K, N]
    group = q.shape[0] // scales.shape[0]
    z = qzeros.to(torch.float32) if qzeros is not None else torch.full_like(scales, 8, dtype=torch.float32)
    return (q - z.repeat_interleave(group, dim=0)) * scales.to(torch.float32).repeat_interleave(group, dim=0)


def w4a16_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
              bias: torch.Tensor | None = None, perm: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize_w4_ref(...) [K, N] (+ bias) -> [M, N] in x.dtype: float32 products and sums, rounded
    once. With perm, row r of W multiplies x[:, perm[r]]."""
    xf = x.to(torch.float32)
    if perm is not None:
        xf = xf[:, perm.long()]
    y = xf @ dequantize_w4_ref(qweight, scales, qzeros)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Configs


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap that divides n."""
    return min(n & -n, cap)


@dataclass(frozen=True)
class W4GemvConfig:
    """One launch shape of the W4A16 GEMV."""

    block_n: int = 128
    """Outputs per program; a power of two (>= 16 for mode 'dot')."""
    block_k: int = 128
    """Inputs per loop step; a power of two >= 8 that divides the group size (>= 16 for mode 'dot')."""
    split_k: int = 1
    """Programs sharing one N tile's K range (deterministic last-program reduction when > 1)."""
    num_warps: int = 4
    num_stages: int = 2
    mode: str = "auto"
    """'fma': CUDA-core FMAs (one row: a [BLOCK_K / 8, BLOCK_N] accumulator reduced once at the end; more rows: a
    loop over them); 'dot': the rows padded to 16 and one tl.dot per step (tensor cores: 16 rows cost one);
    'stream': _w4a16_stream_kernel (up to STREAM_MAX_M rows, float32 FMAs, words double-buffered); 'pair':
    _w4a16_pair_kernel (one bfloat16 row, bf16x2 FMAs; block_k a multiple of 16; elsewhere as 'auto'); 'auto':
    'pair' for one bfloat16 row, 'stream' for one row of another dtype, 'dot' for more (blocks under 16: 'fma')."""
    x_pairs: bool = True
    """'stream' at one row: bfloat16 x read two inputs a load."""
    pdl: bool = True
    """'pair' and 'stream': launched as programmatic dependents where Triton and the GPU allow it (sm_90): the
    first words load while the previous kernel finishes (kernels/w4a16_gemv.py)."""

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v}: must be a power of two")
        if self.block_k < PACK:
            raise ValueError(f"block_k={self.block_k}: must be >= {PACK}")
        if self.split_k < 1:
            raise ValueError(f"split_k={self.split_k}: must be >= 1")
        if self.mode not in ("auto", "fma", "dot", "stream", "pair"):
            raise ValueError(f"mode={self.mode!r}: must be 'auto', 'fma', 'dot', 'stream' or 'pair'")
        if self.mode == "dot" and min(self.block_n, self.block_k) < 16:
            raise ValueError(f"mode='dot': block_n={self.block_n} and block_k={self.block_k} must be >= 16")

    def kernel_mode(self, M: int, dtype: torch.dtype = torch.bfloat16) -> int:
        """The kernel for M rows of x in `dtype`: 0 FMA over the rows, 1 FMA one row, 2 tl.dot (MODEs of
        _w4a16_kernel), 3 the stream kernel, 4 the pair kernel."""
        auto = self.mode == "auto" or self.mode == "pair"
        if auto and M == 1 and dtype == torch.bfloat16 and self.block_k % 16 == 0:
            return 4
        if (self.mode == "stream" and M <= STREAM_MAX_M) or (auto and M == 1):
            return 3
        if self.mode == "dot" or (auto and M > 1 and min(self.block_n, self.block_k) >= 16):
            return 2
        return 1 if M == 1 else 0

    def short(self) -> str:
        return (f"gemv/{self.mode}/n{self.block_n}/k{self.block_k}/s{self.split_k}/w{self.num_warps}/"
                f"st{self.num_stages}" + ("" if self.x_pairs else "/x16") + ("" if self.pdl else "/nopdl"))


@dataclass(frozen=True)
class W4GemmConfig:
    """One launch shape of the W4A16 GEMM."""

    block_m: int = 64
    """Rows of x per program; a power of two >= 16 (tensor-core tile)."""
    block_n: int = 128
    """Outputs per program; a power of two >= 16."""
    block_k: int = 64
    """Inputs per loop step; a power of two >= 16 that divides the group size."""
    num_warps: int = 4
    num_stages: int = 3
    unpack: str = "reshape"
    """How the [BLOCK_K, BLOCK_N] tile of q is read: 'reshape' (each int32 word once, unpacked to [BLOCK_K / 8, 8,
    BLOCK_N] and reshaped) or 'gather' (each word loaded for each of its 8 rows, from L1)."""
    split_k: int = 1
    """Programs sharing one output tile's K range (few row tiles: fills the SMs; deterministic reduction)."""
    group_m: int = 8
    """Row tiles per swizzle group: consecutive programs share W's column tiles in the L2."""

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v}: must be a power of two")
        for name in ("block_m", "block_n", "block_k"):
            if getattr(self, name) < 16:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 16 (tensor-core tile)")
        if self.unpack not in ("reshape", "gather"):
            raise ValueError(f"unpack={self.unpack!r}: must be 'reshape' or 'gather'")
        if self.split_k < 1 or self.group_m < 1:
            raise ValueError(f"split_k={self.split_k}, group_m={self.group_m}: must be >= 1")

    def short(self) -> str:
        return (f"gemm/m{self.block_m}/n{self.block_n}/k{self.block_k}/w{self.num_warps}/st{self.num_stages}/"
                f"{self.unpack}/s{self.split_k}")


def _split_for(tiles: int, K: int, block_k: int, num_sms: int, waves: float = 2) -> int:
    """Splits of K that bring tiles up to about `waves` programs per SM, each split keeping >= 2 steps."""
    target = int(waves * num_sms)
    if tiles >= target:
        return 1
    return max(1, min(triton.cdiv(target, tiles), K // (2 * block_k)))


# H200 sweeps (bench/w4a16_gemm.py --sweep / --sweep-pair, group 128, Qwen2.5-7B's fused projections; bench/
# RESULTS.md): (N, K) -> (one bfloat16 row: the pair kernel, one row of another dtype: the stream kernel, 2..16
# rows: the tensor-core dot). Other shapes (tensor-parallel shards, other models) take the heuristics below; so does
# a config whose block_k does not divide the group size.
_G = W4GemvConfig
GEMV_TABLE: dict[tuple[int, int], tuple[W4GemvConfig, W4GemvConfig, W4GemvConfig]] = {
    (4608, 3584): (_G(512, 128, 28, 4, 1), _G(64, 128, 12, 4, 1), _G(128, 64, 16, 4, 3)),  # qkv
    (3584, 3584): (_G(512, 128, 28, 4, 1), _G(64, 128, 12, 4, 1), _G(128, 64, 16, 4, 3)),  # o
    (37888, 3584): (_G(1024, 64, 7, 4, 1), _G(128, 128, 4, 4, 1), _G(128, 64, 4, 4, 3)),  # gate_up
    (3584, 18944): (_G(512, 128, 38, 4, 1), _G(64, 128, 24, 2, 1), _G(128, 64, 16, 4, 3)),  # down
}


def default_gemv_config(M: int, N: int, K: int, group_size: int, num_sms: int = INTERPRETER_SMS,
                        dtype: torch.dtype = torch.bfloat16) -> W4GemvConfig:
    """One bfloat16 row: the pair kernel, 4 warps, 64 words of a step a thread ([1024 outputs, 64 inputs] tiles for
    wide N, [512, 128] otherwise: the sweep's winners), split-K until the grid covers the SMs about twice. One row of
    another dtype: the stream kernel, [BK/8, BN] tiles of words, split-K until the grid covers the SMs about four
    times. More rows: wide N tiles and one tl.dot per step, split-K likewise."""
    pair = M == 1 and dtype == torch.bfloat16 and group_size % 16 == 0
    entry = GEMV_TABLE.get((N, K))
    if entry is not None and num_sms >= 128:
        cfg = entry[0] if pair else entry[1] if M == 1 else entry[2]
        if group_size % cfg.block_k == 0:
            return cfg
    if pair:
        wide = N >= 16384
        block_k = _pow2_divisor(group_size, 64 if wide else 128)
        warps = 4
        block_n = min(1024 if wide else 512, max(16, triton.next_power_of_2(N)))
        tiles = triton.cdiv(N, block_n)
        split_k = 1 if tiles >= 2 * num_sms else max(1, min(triton.cdiv(2 * num_sms, tiles), K // block_k))
        if split_k > 1 and tiles > COUNTERS_PER_DEVICE:
            split_k = 1
        return W4GemvConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=warps, num_stages=1)
    if M == 1:
        block_k = _pow2_divisor(group_size, 128)
        block_n = 128 if N >= 16384 else 64  # narrow tiles and deep splits won the sweep at every shape
        tiles = triton.cdiv(N, block_n)
        split_k = _split_for(tiles, K, block_k, num_sms, waves=4)
        if split_k > 1 and tiles > COUNTERS_PER_DEVICE:
            split_k = 1
        return W4GemvConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=1)
    block_k = _pow2_divisor(group_size, 64)
    block_n = 128
    if block_k < 16:
        block_n = 64
    tiles = triton.cdiv(N, block_n)
    split_k = _split_for(tiles, K, block_k, num_sms, waves=4)
    if split_k > 1 and tiles > COUNTERS_PER_DEVICE:
        split_k = 1
    return W4GemvConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=3)


def default_gemm_config(M: int, N: int, K: int, group_size: int, num_sms: int = INTERPRETER_SMS) -> W4GemmConfig:
    """From the H200 sweep: past 128 rows [128, 64] tiles, 4 warps, 4 stages (1.3x the [128, 128] / 8 warps tile at
    every shape); up to 128 rows one or two row tiles, split-K to fill the SMs."""
    block_k = _pow2_divisor(group_size, 64)
    if M <= 128:
        block_m = 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128
        block_n = 128 if block_m <= 64 else 64
        warps, stages, waves = 4, 3 if block_m <= 64 else 4, 2
    else:
        block_m, block_n, warps, stages, waves = 128, 64, 4, 4, 1
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    split_k = _split_for(tiles, K, block_k, num_sms, waves=waves)
    if split_k > 1 and tiles > COUNTERS_PER_DEVICE:
        split_k = 1
    return W4GemmConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages,
                        split_k=split_k)


# ---------------------------------------------------------------------------------------------------------------
# Kernels

_MAGIC = tl.constexpr(8388608.0)  # 2^23: float32 bits 0x4B000000 | q (q < 2^23) read as float32 are exactly 2^23 + q


@triton.jit
def swizzled_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of output tile `pid`, in groups of GROUP_M row tiles: consecutive programs share the
    weight's column tiles in the L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % width) % group_rows, (pid % width) // group_rows


@triton.jit
def store_tile(acc, y_ptr, bias_ptr, part_ptr, count_ptr, pid, rm, rn, rn_c, M, N, stride_ym,
               SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y[rm, rn] = acc (float32 [BLOCK_M, BLOCK_N]) + bias, in y's dtype; with SPLIT, acc is one K split's partial
    and the last program of the tile sums them in order (kernels/split_k.py) and stores."""
    out_mask = (rm < M)[:, None] & (rn < N)[None, :]
    y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    if SPLIT:
        tile = rm.to(tl.int64)[:, None] * N + rn[None, :]  # offsets inside one [M, N] partial
        split_stride = (tl.zeros((), dtype=tl.int64) + M) * N
        total, last = split_k_reduce(acc, part_ptr, count_ptr, pid, tile, out_mask, split_stride)
        if last:
            if HAS_BIAS:
                total += tl.load(bias_ptr + rn_c).to(tl.float32)[None, :]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn_c).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _w4a16_kernel(
    x_ptr,  # [M, K] (rows strided, K contiguous)
    qw_ptr,  # [K // 8, N] int32, contiguous
    s_ptr,  # [K // G, N] float16 / bfloat16 / float32, contiguous
    z_ptr,  # [K // G, N] uint8 zero points, contiguous (only when HAS_ZEROS)
    perm_ptr,  # [K] int32 input column of each row of W (only when HAS_PERM)
    bias_ptr,  # [N] (only when HAS_BIAS)
    y_ptr,  # [M, N]
    part_ptr,  # [num_splits, M, N] float32 partial sums (only when SPLIT)
    count_ptr,  # [>= number of output tiles] int32 tickets, 0 between launches (only when SPLIT)
    M, N, K, group_size,
    stride_xm, stride_ym,
    k_per_split,  # K columns per split, a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,  # rows per program (MODE 0: >= M)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides group_size and k_per_split
    GROUP_M: tl.constexpr,  # row tiles per swizzle group (L2 reuse of W's tiles across row tiles)
    MODE: tl.constexpr,  # 0: FMA, a loop over the rows; 1: FMA, one row; 2: tl.dot (tensor cores)
    UNPACK_RESHAPE: tl.constexpr,  # MODE 2: read each word once, reshape [BK/8, 8, BN] -> [BK, BN]; else 8 loads
    SPLIT: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # float32 operands, exact products: float32 x, and the interpreter (its bf16 dot is wrong)
):
    # Output tiles on axis 0 (2^31 of them; axis 1 stops at 65535), swizzled in groups of GROUP_M row tiles.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = swizzled_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows and outputs past the ends repeat the last (the loads stay unmasked); the stores drop them.
    rm_c = tl.minimum(rm, M - 1)
    rn_c = tl.minimum(rn, N - 1)
    ri = tl.arange(0, BLOCK_K // 8)  # packed rows of a step
    rj = tl.arange(0, 8)  # nibbles of a word
    shifts = rj * 4
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_rows = x_ptr + rm_c.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    if MODE == 1:
        acc2 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)  # reduced over the packed rows at the end
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        g_off = (k0 // group_size).to(tl.int64) * N + rn_c  # [BLOCK_N] this step's group row
        s = tl.load(s_ptr + g_off).to(tl.float32)
        # q - z exactly in float32 without an int->float conversion: (2^23 + q) - (2^23 + z)
        if HAS_ZEROS:
            zf = tl.load(z_ptr + g_off).to(tl.float32) + _MAGIC
        else:
            zf = tl.zeros((BLOCK_N,), dtype=tl.float32) + _MAGIC + 8.0
        if MODE == 2:
            rk = tl.arange(0, BLOCK_K)
            kk = k0 + rk
            if HAS_PERM:
                cols = tl.load(perm_ptr + kk)
            else:
                cols = kk
            x = tl.load(x_rows + cols[None, :])  # [BLOCK_M, BLOCK_K]
            if UNPACK_RESHAPE:
                rows = (k0 // 8 + ri).to(tl.int64)
                packed = tl.load(qw_ptr + rows[:, None] * N + rn_c[None, :])  # [BK/8, BN]
                q = tl.reshape((packed[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
            else:
                packed = tl.load(qw_ptr + (kk // 8).to(tl.int64)[:, None] * N + rn_c[None, :])  # 8 loads per word
                q = (packed >> ((rk % 8) * 4)[:, None]) & 0xF
            w = (q | 0x4B000000).to(tl.float32, bitcast=True) - zf[None, :]  # [BLOCK_K, BLOCK_N] in [-16, 15]
            if DOT_FP32:
                part = tl.dot(x.to(tl.float32), w, input_precision="ieee")
            else:
                part = tl.dot(x, w.to(x.dtype))  # integers in [-16, 15]: exact in bf16 and fp16
            acc += part * s[None, :]
        else:
            rows = (k0 // 8 + ri).to(tl.int64)
            packed = tl.load(qw_ptr + rows[:, None] * N + rn_c[None, :], eviction_policy="evict_first")  # [BK/8, BN]
            q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [BK/8, 8, BN]: input k0 + 8i + j
            w = (q | 0x4B000000).to(tl.float32, bitcast=True) - zf[None, None, :]
            kk = k0 + ri[:, None] * 8 + rj[None, :]  # [BK/8, 8] rows of W
            if HAS_PERM:
                cols = tl.load(perm_ptr + kk)
            else:
                cols = kk
            if MODE == 1:
                xm = tl.load(x_ptr + pid_m.to(tl.int64) * stride_xm + cols).to(tl.float32)  # [BK/8, 8], BLOCK_M = 1
                acc2 += tl.sum(xm[:, :, None] * w, axis=1) * s[None, :]
            else:
                for m in tl.static_range(BLOCK_M):
                    # rows past M repeat row M-1 (dropped at the store)
                    xm = tl.load(x_ptr + tl.minimum(M - 1, m) * stride_xm + cols, eviction_policy="evict_last")
                    p = tl.sum(tl.sum(xm.to(tl.float32)[:, :, None] * w, axis=1), axis=0) * s  # [BLOCK_N]
                    acc = tl.where(rm[:, None] == m, acc + p[None, :], acc)
    if MODE == 1:
        acc += tl.sum(acc2, axis=0)[None, :]

    store_tile(acc, y_ptr, bias_ptr, part_ptr, count_ptr, pid, rm, rn, rn_c, M, N, stride_ym, SPLIT, HAS_BIAS)


# ---------------------------------------------------------------------------------------------------------------
# Launchers


def check_w4_operands(x, qweight, scales, qzeros, bias, perm) -> tuple[int, int, int, int]:
    """Shapes, dtypes, strides and devices of the operands; returns (M, N, K, group_size)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    M, K = x.shape
    if K % PACK:
        raise ValueError(f"x: K={K} is not a multiple of {PACK} (the 4-bit layout packs 8 inputs per word)")
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int32,), shape=(K // PACK, None))
    N = qweight.shape[1]
    check_tensor("scales", scales, ndim=2, dtypes=SCALE_DTYPES, shape=(None, N))
    num_groups = scales.shape[0]
    if num_groups < 1 or K % num_groups:
        raise ValueError(f"scales: {num_groups} groups do not divide K={K}")
    group_size = K // num_groups
    tensors = dict(x=x, qweight=qweight, scales=scales)
    for name, t in (("qweight", qweight), ("scales", scales)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: strides {t.stride()}, the kernel needs it contiguous")
    if qzeros is not None:
        check_tensor("qzeros", qzeros, ndim=2, dtypes=(torch.uint8,), shape=(num_groups, N))
        if not qzeros.is_contiguous():
            raise ValueError(f"qzeros: strides {qzeros.stride()}, the kernel needs it contiguous")
        tensors["qzeros"] = qzeros
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES, shape=(N,))
        tensors["bias"] = bias
    if perm is not None:
        check_tensor("perm", perm, ndim=1, dtypes=(torch.int32,), shape=(K,))
        tensors["perm"] = perm
    check_same_device(**tensors)
    return M, N, K, group_size


def output_for(x: torch.Tensor, N: int, out: torch.Tensor | None) -> torch.Tensor:
    """The launchers' output: out checked as [M, N] in x's dtype on x's device, or a new one."""
    if out is None:
        return torch.empty((x.shape[0], N), dtype=x.dtype, device=x.device)
    check_out("out", out, (x.shape[0], N), x.dtype, x.device)
    return out


def _launch(x, qweight, scales, qzeros, bias, perm, out, M, N, K, group_size, *, block_m, block_n, block_k,
            split_k, group_m, mode, unpack_reshape, num_warps, num_stages) -> None:
    """One launch of _w4a16_kernel: output tiles on grid axis 0, K splits on axis 1."""
    check_block_k(block_k, group_size)
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    plan = plan_split_k(K, block_k, split_k, tiles, out, f"qweight: N={N} (M={M})")
    _w4a16_kernel[(tiles, plan.num_splits)](
        x, qweight, scales, qzeros if qzeros is not None else qweight, perm if perm is not None else qweight,
        bias if bias is not None else out, out, plan.part, plan.counters,
        M, N, K, group_size, x.stride(0), out.stride(0), plan.k_per_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, MODE=mode,
        UNPACK_RESHAPE=unpack_reshape, SPLIT=plan.split,
        HAS_ZEROS=qzeros is not None, HAS_PERM=perm is not None, HAS_BIAS=bias is not None,
        DOT_FP32=x.dtype == torch.float32 or _INTERPRET,
        num_warps=num_warps, num_stages=num_stages,
    )


def w4a16_gemv_triton(
    x: torch.Tensor,  # [M, K], M <= GEMV_MAX_M
    qweight: torch.Tensor,  # [K / 8, N] int32
    scales: torch.Tensor,  # [K / G, N]
    qzeros: torch.Tensor | None = None,  # [K / G, N] uint8
    bias: torch.Tensor | None = None,  # [N]
    perm: torch.Tensor | None = None,  # [K] int32
    *,
    out: torch.Tensor | None = None,  # [M, N] in x.dtype
    config: W4GemvConfig | None = None,
) -> torch.Tensor:
    """w4a16_ref for at most GEMV_MAX_M rows. No host sync, no data-dependent allocation: capturable in a CUDA graph
    (after one split launch outside the capture has made the ticket counters)."""
    M, N, K, group_size = check_w4_operands(x, qweight, scales, qzeros, bias, perm)
    if M > GEMV_MAX_M:
        raise ValueError(f"x: {M} rows, the GEMV takes at most GEMV_MAX_M={GEMV_MAX_M} (use w4a16_gemm_triton)")
    out = output_for(x, N, out)
    if M == 0 or N == 0:
        return out
    cfg = config or default_gemv_config(M, N, K, group_size, sm_count(x.device, INTERPRETER_SMS), x.dtype)
    mode = cfg.kernel_mode(M, x.dtype)
    if mode == 4:
        launch_pair(x, qweight, scales, qzeros, bias, perm, out, N, K, group_size, block_n=cfg.block_n,
                    block_k=cfg.block_k, split_k=cfg.split_k, num_warps=cfg.num_warps, pdl=cfg.pdl)
        return out
    if mode == 3:
        launch_stream(x, qweight, scales, qzeros, bias, perm, out, M, N, K, group_size, block_n=cfg.block_n,
                      block_k=cfg.block_k, split_k=cfg.split_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                      x_pairs=cfg.x_pairs, pdl=cfg.pdl)
        return out
    block_m = max(16, triton.next_power_of_2(M)) if mode == 2 else 1 if mode == 1 else triton.next_power_of_2(M)
    _launch(x, qweight, scales, qzeros, bias, perm, out, M, N, K, group_size, block_m=block_m, block_n=cfg.block_n,
            block_k=cfg.block_k, split_k=cfg.split_k, group_m=1, mode=mode, unpack_reshape=True,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def w4a16_gemm_triton(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K / 8, N] int32
    scales: torch.Tensor,  # [K / G, N]
    qzeros: torch.Tensor | None = None,  # [K / G, N] uint8
    bias: torch.Tensor | None = None,  # [N]
    perm: torch.Tensor | None = None,  # [K] int32
    *,
    out: torch.Tensor | None = None,  # [M, N] in x.dtype
    config: W4GemmConfig | None = None,
) -> torch.Tensor:
    """w4a16_ref for any number of rows, on the tensor cores. No host sync: capturable in a CUDA graph (after one
    split launch outside the capture, as for the GEMV)."""
    M, N, K, group_size = check_w4_operands(x, qweight, scales, qzeros, bias, perm)
    out = output_for(x, N, out)
    if M == 0 or N == 0:
        return out
    cfg = config or default_gemm_config(M, N, K, group_size, sm_count(x.device, INTERPRETER_SMS))
    _launch(x, qweight, scales, qzeros, bias, perm, out, M, N, K, group_size, block_m=cfg.block_m,
            block_n=cfg.block_n, block_k=cfg.block_k, split_k=cfg.split_k, group_m=cfg.group_m, mode=2,
            unpack_reshape=cfg.unpack == "reshape", num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
