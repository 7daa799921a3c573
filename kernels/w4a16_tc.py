"""The W4A16 GEMM for batches (decode steps of 17+ rows, prefill chunks): y[M, N] = x[M, K] @ W[K, N] (+ bias), the
4-bit weights (kernels/w4a16.py's layout) dequantized inside the K loop into the accumulating tensor-core dot.

kernels/w4a16.py's _w4a16_kernel multiplies x by the integers q - z and scales each K step's partial sum by the
group's scale (acc += dot(x, q - z) * s): exact products, but every step's dot result is consumed at once, so the
tensor cores never accumulate across steps and wait on the scaling. Here the scale goes into the weights,
w = (q - z) * s rounded once to x's dtype (what Marlin, Machete and vLLM's Triton AWQ kernel compute), and each step
is acc = dot(., ., acc): one rounding per weight, float32 sums.

SWAP computes the transposed tile, y^T[BLOCK_N, BLOCK_M] = W^T[BLOCK_N, BLOCK_K] @ x^T[BLOCK_K, BLOCK_M]. The
dequantized weights, made in registers, are then the dot's first operand, which Hopper's wgmma reads from registers
(its second operand must sit in shared memory, where the pipelined loads of x put it); unswapped, the weights are the
second operand and take a trip through shared memory each step. Swapped, the wgmma tile is 64 weights x BLOCK_M
tokens: small batches waste no rows of the instruction (the trick CUTLASS's mixed-input GEMMs call "swap AB").

Unpack 'reshape' reads each int32 word once ([BLOCK_K / 8, BLOCK_N] words, shifted into [BLOCK_K / 8, 8, BLOCK_N]
and reshaped); 'gather' loads each word once per nibble (8 loads of one word, from L1) and keeps the tile 2-D, which
lets the compiler move the weights' register layout up to the load.

`w4_dequantize_triton` writes W in bfloat16/float16 for the large-M path (dequantize, then cuBLAS), where the GEMM's
work dwarfs one pass over the weights. The contract for both is kernels.w4a16.w4a16_ref, to bf16 rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._checks import check_block_k, check_out, interpreting
from kernels.split_k import COUNTERS_PER_DEVICE, plan_split_k
from kernels.w4a16 import (GEMV_MAX_M, W4GemmConfig, check_w4_operands, output_for, store_tile, swizzled_tile,
                           w4a16_gemv_triton)

_INTERPRET = interpreting()
_MAGIC = tl.constexpr(8388608.0)  # 2^23: float32 bits 0x4B000000 | q are exactly 2^23 + q


@dataclass(frozen=True)
class W4TcConfig(W4GemmConfig):
    """One launch shape of _w4a16_tc_kernel: W4GemmConfig's tile, warps, stages, unpacking, split and swizzle (its
    checks too), and the operand order and the dequantization."""

    swap: bool = True
    """The transposed tile: the weights as the dot's first operand (registers), x as its second (shared memory)."""
    pairs: bool = False
    """Dequantize with paired 16-bit arithmetic (_dequant_word: per 8 weights 4 LOP3, 3 shifts and 8 FMA2s, against
    ~6 float32 operations a weight); 16-bit x on the GPU only (float32 x and the interpreter keep the float32 path,
    the interpreter emulating the pairs' layout)."""

    def short(self) -> str:
        return (f"tc/{'swap' if self.swap else 'noswap'}/m{self.block_m}/n{self.block_n}/k{self.block_k}/"
                f"w{self.num_warps}/st{self.num_stages}/{self.unpack}/s{self.split_k}" + ("/pairs" if self.pairs else ""))


def _pairs_asm(f16: bool) -> str:
    """_dequant_word's PTX: outputs $0..$7 (nibbles 0..7, 16-bit), inputs $8 the word, $9 zz, $10 ss."""
    magic, fma, one = ("0x64006400", "fma.rn.f16x2", "0x3C003C00") if f16 else \
        ("0x43004300", "fma.rn.bf16x2", "0x3F803F80")
    steps = []
    for j in range(4):  # nibbles j and j + 4 of the word: one pair
        src = "$8"
        if j:
            steps.append(f"shr.u32 u, $8, {4 * j};")
            src = "u"
        steps.append(f"lop3.b32 t, {src}, 0x000F000F, {magic}, 0xEA;")  # (src & 0x000F000F) | magic: M + q
        steps.append(f"{fma} t, t, one, $9;")  # + -(M + z), exact
        steps.append(f"{fma} t, t, $10, nz;")  # * s (+ -0: keeps -0), the one rounding
        steps.append(f"mov.b32 {{${j}, ${j + 4}}}, t;")
    return ("{ .reg .b32 t, u, one, nz; " f"mov.b32 one, {one}; mov.b32 nz, 0x80008000; " + " ".join(steps) + " }")


_PAIRS_ASM_BF16 = tl.constexpr(_pairs_asm(False))
_PAIRS_ASM_F16 = tl.constexpr(_pairs_asm(True))


@triton.jit
def _dequant_word(words, zz, ss, F16: tl.constexpr, ASM: tl.constexpr):
    """The 8 weights of each int32 word ((q_j - z) * s, j = 0..7, nibble j), each a tensor of words' shape in bf16
    (F16: fp16). zz: int32 of -(M + z) twice in 16-bit halves, ss: s twice (M the magic: 128 for bf16, 1024 for
    fp16, whose bits OR'ed with q are the 16-bit number M + q). ASM: per nibble pair (q_j, q_j+4), one LOP3 makes
    (M + q_j, M + q_j+4), one FMA2 adds -(M + z) (exact: small integers), one FMA2 times s (the one rounding)."""
    if ASM:
        if F16:
            return tl.inline_asm_elementwise(_PAIRS_ASM_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, zz, ss],
                                             dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(_PAIRS_ASM_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, zz, ss],
                                             dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:  # the interpreter: the same values in float32 (zz's low half decoded back to -(M + z))
        if F16:
            mz = -((zz & 0x3FF).to(tl.float32) + 1024.0)
        else:
            mz = -((zz & 0x7F).to(tl.float32) + 128.0)
        sf = (ss << 16).to(tl.float32, bitcast=True) if not F16 else \
            (ss & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        base = 1024.0 if F16 else 128.0
        w0 = ((words & 0xF).to(tl.float32) + base + mz) * sf
        w1 = (((words >> 4) & 0xF).to(tl.float32) + base + mz) * sf
        w2 = (((words >> 8) & 0xF).to(tl.float32) + base + mz) * sf
        w3 = (((words >> 12) & 0xF).to(tl.float32) + base + mz) * sf
        w4 = (((words >> 16) & 0xF).to(tl.float32) + base + mz) * sf
        w5 = (((words >> 20) & 0xF).to(tl.float32) + base + mz) * sf
        w6 = (((words >> 24) & 0xF).to(tl.float32) + base + mz) * sf
        w7 = (((words >> 28) & 0xF).to(tl.float32) + base + mz) * sf
        return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _stack_nibbles(w0, w1, w2, w3, w4, w5, w6, w7, WORDS_AXIS: tl.constexpr):
    """Eight [A, B] tensors (w_j: nibble j of each word) -> the weights in input order along WORDS_AXIS (0: [8A, B],
    row 8a + j; 1: [A, 8B], column 8b + j). The joins put j = b + 2a + 4c in three new trailing axes (b, a, c)."""
    r = tl.join(tl.join(tl.join(w0, w1), tl.join(w2, w3)), tl.join(tl.join(w4, w5), tl.join(w6, w7)))
    if WORDS_AXIS == 0:
        return tl.reshape(tl.permute(r, (0, 4, 3, 2, 1)), (r.shape[0] * 8, r.shape[1]))
    else:
        return tl.reshape(tl.permute(r, (0, 1, 4, 3, 2)), (r.shape[0], r.shape[1] * 8))


@triton.jit
def _pair_operands(z_ptr, g_off, s, HAS_ZEROS: tl.constexpr, F16: tl.constexpr):
    """zz and ss of _dequant_word for one group row: [BLOCK_N] int32 each."""
    if HAS_ZEROS:
        z = tl.load(z_ptr + g_off).to(tl.int32)
    else:
        z = tl.zeros(s.shape, dtype=tl.int32) + 8
    if F16:
        mz = 0xE400 | z  # -(1024 + z) in fp16 (z <= 16)
        sb = s.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    else:
        mz = 0xC300 | z  # -(128 + z) in bf16
        sb = s.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return mz | (mz << 16), sb | (sb << 16)


@triton.jit
def _w4a16_tc_kernel(
    x_ptr,  # [M, K] (rows strided, K contiguous)
    qw_ptr,  # [K // 8, N] int32, contiguous
    s_ptr,  # [K // G, N] contiguous
    z_ptr,  # [K // G, N] uint8, contiguous (only when HAS_ZEROS)
    perm_ptr,  # [K] int32 (only when HAS_PERM)
    bias_ptr,  # [N] (only when HAS_BIAS)
    y_ptr,  # [M, N]
    part_ptr,  # [num_splits, M, N] float32 (only when SPLIT)
    count_ptr,  # int32 tickets (only when SPLIT)
    M, N, K, group_size,
    stride_xm, stride_ym,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SWAP: tl.constexpr,
    GATHER: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # float32 x, and the interpreter: float32 weights, exact products
    PAIRS: tl.constexpr,  # _dequant_word's paired 16-bit dequantization (16-bit x)
    F16: tl.constexpr,  # x is float16 (else bfloat16; PAIRS only)
    ASM: tl.constexpr,  # PAIRS in PTX (else its float32 emulation: the interpreter)
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = swizzled_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm_c = tl.minimum(rm, M - 1)  # rows and outputs past the ends repeat the last; the store drops them
    rn_c = tl.minimum(rn, N - 1)
    rk = tl.arange(0, BLOCK_K)
    ri = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_rows = x_ptr + rm_c.to(tl.int64) * stride_xm  # [BLOCK_M]
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PAIRS:
        # pointers advanced each step (no per-step 64-bit address arithmetic); act order gathers x per step
        if SWAP:
            w_ptrs = qw_ptr + (k_lo // 8 + ri).to(tl.int64)[None, :] * N + rn_c[:, None]  # [BN, BK/8]
            x_ptrs = x_rows[None, :] + (k_lo + rk)[:, None]  # [BK, BM]
        else:
            w_ptrs = qw_ptr + (k_lo // 8 + ri).to(tl.int64)[:, None] * N + rn_c[None, :]  # [BK/8, BN]
            x_ptrs = x_rows[:, None] + (k_lo + rk)[None, :]  # [BM, BK]
        w_step = (BLOCK_K // 8) * N.to(tl.int64)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            g_off = (k0 // group_size).to(tl.int64) * N + rn_c  # [BLOCK_N]
            zz, ss = _pair_operands(z_ptr, g_off, tl.load(s_ptr + g_off).to(tl.float32), HAS_ZEROS, F16)
            words = tl.load(w_ptrs)
            if HAS_PERM:
                cols = tl.load(perm_ptr + k0 + rk)
            if SWAP:
                w0, w1, w2, w3, w4, w5, w6, w7 = _dequant_word(words, zz[:, None], ss[:, None], F16, ASM)
                w = _stack_nibbles(w0, w1, w2, w3, w4, w5, w6, w7, 1)  # [BN, BK]
                if HAS_PERM:
                    xt = tl.load(x_rows[None, :] + cols[:, None])
                else:
                    xt = tl.load(x_ptrs)
                if ASM:
                    acc = tl.dot(w.to(xt.dtype), xt, acc)
                else:  # (the interpreter's 16-bit dot is wrong: the rounded weights, multiplied in float32)
                    acc = tl.dot(w.to(xt.dtype).to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
            else:
                w0, w1, w2, w3, w4, w5, w6, w7 = _dequant_word(words, zz[None, :], ss[None, :], F16, ASM)
                w = _stack_nibbles(w0, w1, w2, w3, w4, w5, w6, w7, 0)  # [BK, BN]
                if HAS_PERM:
                    x = tl.load(x_rows[:, None] + cols[None, :])
                else:
                    x = tl.load(x_ptrs)
                if ASM:
                    acc = tl.dot(x, w.to(x.dtype), acc)
                else:
                    acc = tl.dot(x.to(tl.float32), w.to(x.dtype).to(tl.float32), acc, input_precision="ieee")
            w_ptrs += w_step
            x_ptrs += BLOCK_K
    else:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            g_off = (k0 // group_size).to(tl.int64) * N + rn_c  # [BLOCK_N]
            s = tl.load(s_ptr + g_off).to(tl.float32)
            if HAS_ZEROS:
                zf = tl.load(z_ptr + g_off).to(tl.float32) + _MAGIC
            else:
                zf = tl.zeros((BLOCK_N,), dtype=tl.float32) + (_MAGIC + 8.0)
            kk = k0 + rk
            if HAS_PERM:
                cols = tl.load(perm_ptr + kk)
            else:
                cols = kk
            if SWAP:
                # W^T tile [BLOCK_N, BLOCK_K]: element (n, k) is nibble k % 8 of word (k // 8, n)
                if GATHER:
                    words = tl.load(qw_ptr + (kk // 8).to(tl.int64)[None, :] * N + rn_c[:, None])  # [BN, BK]
                    q = (words >> ((rk % 8) * 4)[None, :]) & 0xF
                else:
                    rows = (k0 // 8 + ri).to(tl.int64)
                    words = tl.load(qw_ptr + rows[None, :] * N + rn_c[:, None])  # [BN, BK/8]
                    q = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_N, BLOCK_K))
                w = ((q | 0x4B000000).to(tl.float32, bitcast=True) - zf[:, None]) * s[:, None]
                xt = tl.load(x_rows[None, :] + cols[:, None])  # [BK, BM]
                if DOT_FP32:
                    acc = tl.dot(w, xt.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(w.to(xt.dtype), xt, acc)
            else:
                if GATHER:
                    words = tl.load(qw_ptr + (kk // 8).to(tl.int64)[:, None] * N + rn_c[None, :])  # [BK, BN]
                    q = (words >> ((rk % 8) * 4)[:, None]) & 0xF
                else:
                    rows = (k0 // 8 + ri).to(tl.int64)
                    words = tl.load(qw_ptr + rows[:, None] * N + rn_c[None, :])  # [BK/8, BN]
                    q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
                w = ((q | 0x4B000000).to(tl.float32, bitcast=True) - zf[None, :]) * s[None, :]
                x = tl.load(x_rows[:, None] + cols[None, :])  # [BM, BK]
                if DOT_FP32:
                    acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, w.to(x.dtype), acc)

    if SWAP:
        out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    else:
        out = acc
    store_tile(out, y_ptr, bias_ptr, part_ptr, count_ptr, pid, rm, rn, rn_c, M, N, stride_ym, SPLIT, HAS_BIAS)


def default_tc_config(M: int, N: int, K: int, group_size: int, num_sms: int) -> W4TcConfig:
    """Swapped tiles of 128 weights (two warpgroups) by up to 128 rows, split-K until the grid covers the SMs."""
    block_k = min(group_size & -group_size, 64)
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128
    block_n = 128
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    split_k = 1
    if tiles < num_sms:
        split_k = max(1, min(triton.cdiv(num_sms, tiles), K // (2 * block_k)))
        if tiles > COUNTERS_PER_DEVICE:
            split_k = 1
    return W4TcConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=8, num_stages=3, swap=True,
                      split_k=split_k)


def w4a16_tc_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, perm: torch.Tensor | None = None, *,
                    out: torch.Tensor | None = None, config: W4TcConfig | None = None) -> torch.Tensor:
    """kernels.w4a16.w4a16_ref on the tensor cores with the weights rounded once to x's dtype. No host sync:
    capturable in a CUDA graph (after one split launch outside the capture has made the ticket counters)."""
    from kernels._checks import sm_count
    from kernels.gemv import INTERPRETER_SMS
    M, N, K, group_size = check_w4_operands(x, qweight, scales, qzeros, bias, perm)
    out = output_for(x, N, out)
    if M == 0 or N == 0:
        return out
    cfg = config or default_tc_config(M, N, K, group_size, sm_count(x.device, INTERPRETER_SMS))
    check_block_k(cfg.block_k, group_size)
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    plan = plan_split_k(K, cfg.block_k, cfg.split_k, tiles, out, f"qweight: N={N} (M={M})")
    pairs = cfg.pairs and x.dtype in (torch.bfloat16, torch.float16)
    _w4a16_tc_kernel[(tiles, plan.num_splits)](
        x, qweight, scales, qzeros if qzeros is not None else qweight, perm if perm is not None else qweight,
        bias if bias is not None else out, out, plan.part, plan.counters,
        M, N, K, group_size, x.stride(0), out.stride(0), plan.k_per_split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SWAP=cfg.swap,
        GATHER=cfg.unpack == "gather", SPLIT=plan.split,
        HAS_ZEROS=qzeros is not None, HAS_PERM=perm is not None, HAS_BIAS=bias is not None,
        DOT_FP32=(x.dtype == torch.float32 or _INTERPRET) and not pairs, PAIRS=pairs,
        F16=x.dtype == torch.float16, ASM=not _INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# ---------------------------------------------------------------------------------------------------------------
# Dequantize, then cuBLAS (large M)


@triton.jit
def _w4_dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, group_size,
                       BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """W^T[N, K] (nn.Linear's layout) in w_ptr's dtype: BLOCK_N outputs by BLOCK_R packed rows (8 * BLOCK_R inputs,
    one contiguous run of each output's row)."""
    pid_r = tl.program_id(0)
    pid_n = tl.program_id(1)
    ri = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    words = tl.load(qw_ptr + ri.to(tl.int64)[None, :] * N + rn[:, None], mask=nmask[:, None], other=0)  # [BN, BR]
    q = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF  # [BN, BR, 8]: input 8r + j
    g = (ri * 8 // group_size).to(tl.int64)  # one group per packed row (8 divides the group size)
    s = tl.load(s_ptr + g[None, :] * N + rn[:, None], mask=nmask[:, None], other=0).to(tl.float32)
    if HAS_ZEROS:
        zf = tl.load(z_ptr + g[None, :] * N + rn[:, None], mask=nmask[:, None], other=0).to(tl.float32) + _MAGIC
    else:
        zf = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32) + (_MAGIC + 8.0)
    w = ((q | 0x4B000000).to(tl.float32, bitcast=True) - zf[:, :, None]) * s[:, :, None]
    w = tl.reshape(w, (BLOCK_N, BLOCK_R * 8))
    cols = pid_r * (BLOCK_R * 8) + tl.arange(0, BLOCK_R * 8)
    tl.store(w_ptr + rn.to(tl.int64)[:, None] * K + cols[None, :], w.to(w_ptr.dtype.element_ty),
             mask=nmask[:, None])


def w4_dequantize_triton(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                         dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """W^T [N, K] = ((q - z) * s)^T rounded once to dtype: kernels.w4a16.dequantize_w4_ref, transposed into
    nn.Linear's layout (the one cuBLAS is tuned for: F.linear(x, W^T) runs as the bf16 model's GEMM does)."""
    K8, N = qweight.shape
    K = K8 * 8
    group_size = K // scales.shape[0]
    if out is None:
        out = torch.empty((N, K), dtype=dtype, device=qweight.device)
    else:
        check_out("out", out, (N, K), dtype, qweight.device)
    block_r = 16 if K8 % 16 == 0 else 8 if K8 % 8 == 0 else 1
    block_n = 32
    _w4_dequant_kernel[(K8 // block_r, triton.cdiv(N, block_n))](
        qweight, scales, qzeros if qzeros is not None else qweight, out, N, K, group_size,
        BLOCK_R=block_r, BLOCK_N=block_n, HAS_ZEROS=qzeros is not None, num_warps=4)
    return out


def w4a16_dequant_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, perm: torch.Tensor | None = None, *,
                     scratch: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W (+ bias) through a dequantized copy of W (scratch [N, K] in x's dtype, reused when given): one pass
    over the weights, then cuBLAS. For batches where the GEMM's work dwarfs that pass (and, while the fused GEMM
    runs below cuBLAS, for most batches past the GEMV's)."""
    w = w4_dequantize_triton(qweight, scales, qzeros, x.dtype, out=scratch)
    if perm is not None:
        x = x.index_select(1, perm.long())
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


# ---------------------------------------------------------------------------------------------------------------
# The batch path: which of the two for M rows


TC_MAX_M = 64
"""Up to this many rows a wide weight (N >= TC_MIN_N) takes the fused GEMM: there the pass over a dequantized copy
costs more than the fused GEMM's arithmetic (H200 sweep, bench/w4_tc_sweep.py; bench/RESULTS.md)."""
TC_MIN_N = 16384
TC_SMALL = W4TcConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4, swap=False)


TC_PLAN: dict[tuple[int, int], list[tuple[int, W4TcConfig | None]]] = {}
"""Per weight shape (N, K): [(max_m, config or None)] by max_m; the first entry with M <= max_m decides (a config:
the fused GEMM with it; None: dequantize + cuBLAS); past the last, the rule of batch_path. Filled from a sweep's
--table-out (load_tc_plan); empty: the rule alone."""


def load_tc_plan(table: dict) -> None:
    """TC_PLAN from bench/w4_tc_sweep.py's --table-out JSON ({"NxK": [[m, {"kind", "config"}], ...]})."""
    TC_PLAN.clear()
    for shape, entries in table.items():
        n, k = (int(v) for v in shape.split("x"))
        TC_PLAN[(n, k)] = sorted((m, W4TcConfig(**e["config"]) if e["kind"] == "tc" and "config" in e else None)
                                 for m, e in entries)


def _plan(M: int, N: int, K: int, group_size: int) -> tuple[str, W4TcConfig | None]:
    for max_m, cfg in TC_PLAN.get((N, K), ()):
        if M <= max_m:
            if cfg is not None and group_size % cfg.block_k == 0:
                return "tc", cfg
            return "dequant", None
    if M <= TC_MAX_M and N >= TC_MIN_N and group_size % TC_SMALL.block_k == 0:
        return "tc", TC_SMALL
    return "dequant", None


def batch_path(M: int, N: int, K: int, group_size: int) -> str:
    """'tc' (the fused GEMM) or 'dequant' (dequantize, then cuBLAS) for M rows of x."""
    return _plan(M, N, K, group_size)[0]


def w4a16_batch_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       qzeros: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                       perm: torch.Tensor | None = None) -> torch.Tensor:
    """w4a16_ref for a batch (more rows than the GEMV takes), by batch_path."""
    M, K = x.shape
    N = qweight.shape[1]
    path, cfg = _plan(M, N, K, K // scales.shape[0])
    if path == "tc":
        return w4a16_tc_triton(x, qweight, scales, qzeros, bias, perm, config=cfg)
    return w4a16_dequant_mm(x, qweight, scales, qzeros, bias, perm)


def w4a16_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, perm: torch.Tensor | None = None) -> torch.Tensor:
    """The engine's 4-bit linear on CUDA: kernels/w4a16.py's GEMV for at most GEMV_MAX_M rows, the batch path
    above (the fused GEMM or dequantize + cuBLAS, by batch_path)."""
    if x.shape[0] <= GEMV_MAX_M:
        return w4a16_gemv_triton(x, qweight, scales, qzeros, bias, perm)
    return w4a16_batch_triton(x, qweight, scales, qzeros, bias, perm)
