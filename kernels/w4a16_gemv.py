"""The one-row kernels of the W4A16 GEMV (decode at batch 1): kernels/w4a16.py holds the layout, the reference, the
configs and the launchers that pick these.

Both read the packed words as 2D [rows of words, BLOCK_N] tiles with 16-byte loads along N, the next step's words
in flight during this step's arithmetic, and split K over grid axis 1 (kernels/split_k.py). At one row the multiply
is the cost: one weight is used once, so the instructions spent per weight, not the bytes, bounded the first kernel
(bench/RESULTS.md, "W4A16 one-row GEMV").
  _w4a16_pair_kernel    (mode 'pair', the default for bfloat16 x) paired bfloat16 arithmetic: 2 weights per
                        instruction, float32 sums every 16 weights. Per 8 weights one shift, four ANDs and four
                        bf16x2 FMAs (see its docstring for why no subtraction and no conversion is needed).
  _w4a16_stream_kernel  (mode 'stream': float16 / float32 x, and up to STREAM_MAX_M rows) float32 arithmetic, one
                        LOP3 + FADD + FFMA per weight.
Both launch as programmatic dependents (kernels/pdl.py) where the GPU allows it: the first step's words load while
the kernel before them finishes, and the wait comes before the first read of x.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import PDL_SUPPORTED, launch_kwargs
from kernels._checks import check_block_k, interpreting
from kernels.split_k import plan_split_k, split_k_reduce

_INTERPRET = interpreting()  # read once: triton.jit read it when the kernels below were decorated

_MAGIC = tl.constexpr(8388608.0)  # 2^23: float32 bits 0x4B000000 | q (q < 2^23) read as float32 are exactly 2^23 + q
# The pair kernel's exponents: x enters as x * 2^XS (even nibbles) and x * 2^(XS - 4) (odd ones), the nibbles as
# bfloat16 bit patterns q * 2^-133 and 16 q * 2^-133, so each product is x q 2^(XS - 133) (normal for |x q| >= 2^-93)
# and x may reach 2^28 before x * 2^XS overflows. XS is added to x's exponent field as an integer.
XS = 100
_X_EVEN = tl.constexpr(XS * 128 * 0x10001)  # XS << 7 in both bfloat16 halves: 0x32003200
_X_ODD = tl.constexpr((XS - 4) * 128 * 0x10001)  # 0x30003000
_UNSCALE = tl.constexpr(2.0 ** (133 - XS))  # partial sums -> sum x q
_EMU_A = tl.constexpr(2.0 ** -66)  # 2^-133 in two normal float32 steps (the emulation's bit values)
_EMU_B = tl.constexpr(2.0 ** -67)



# ---------------------------------------------------------------------------------------------------------------
# Paired bfloat16 arithmetic


@triton.jit
def _x_pairs(w0, w1, w2, w3, ASM: tl.constexpr):
    """Eight consecutive bfloat16 inputs x0..x7 as four int32 words (w_m holds x_2m in its low half, x_2m+1 in its
    high half) -> the four bf16x2 operands of one packed word's nibble pairs: (x0, x4) and (x2, x6) times 2^XS,
    (x1, x5) and (x3, x7) times 2^(XS - 4); the scaling is an integer add to each exponent field (exact for
    |x| < 2^28; a zero becomes +-2^-27 before the scaling, 2^-127 relative, which no sum notices)."""
    if ASM:
        return tl.inline_asm_elementwise(
            """{
            prmt.b32 $0, $4, $6, 0x5410;
            prmt.b32 $1, $4, $6, 0x7632;
            prmt.b32 $2, $5, $7, 0x5410;
            prmt.b32 $3, $5, $7, 0x7632;
            add.s32 $0, $0, 0x32003200;
            add.s32 $1, $1, 0x30003000;
            add.s32 $2, $2, 0x32003200;
            add.s32 $3, $3, 0x30003000;
            }""",
            "=r,=r,=r,=r,r,r,r,r", [w0, w1, w2, w3], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
            pack=1)
    else:
        a0 = ((w0 & 0xFFFF) | (w2 << 16)) + _X_EVEN
        a1 = (((w0 >> 16) & 0xFFFF) | (w2 & -65536)) + _X_ODD
        a2 = ((w1 & 0xFFFF) | (w3 << 16)) + _X_EVEN
        a3 = (((w1 >> 16) & 0xFFFF) | (w3 & -65536)) + _X_ODD
        return a0, a1, a2, a3


@triton.jit
def _emu_word(w, a0, a1, a2, a3):
    """What the PTX of _pair_dot computes for one word, in float32 (the interpreter's path): each 16-bit lane of
    the nibble masks read as bfloat16 is its integer value times 2^-133 (subnormal, or the first normal binade:
    the bits are linear in the value up to 0xFF), each lane of a_j is a bfloat16 number."""
    v = ((w & 0xF).to(tl.float32) * (a0 << 16).to(tl.float32, bitcast=True)
         + ((w >> 16) & 0xF).to(tl.float32) * (a0 & -65536).to(tl.float32, bitcast=True))
    v += ((w & 0xF0).to(tl.float32) * (a1 << 16).to(tl.float32, bitcast=True)
          + ((w >> 16) & 0xF0).to(tl.float32) * (a1 & -65536).to(tl.float32, bitcast=True))
    v += (((w >> 8) & 0xF).to(tl.float32) * (a2 << 16).to(tl.float32, bitcast=True)
          + ((w >> 24) & 0xF).to(tl.float32) * (a2 & -65536).to(tl.float32, bitcast=True))
    v += (((w >> 8) & 0xF0).to(tl.float32) * (a3 << 16).to(tl.float32, bitcast=True)
          + ((w >> 24) & 0xF0).to(tl.float32) * (a3 & -65536).to(tl.float32, bitcast=True))
    return v


@triton.jit
def _pair_dot(wa, wb, a0, a1, a2, a3, b0, b1, b2, b3, ASM: tl.constexpr):
    """sum_j x_j q_j * 2^(XS - 133) over the 16 weights of two packed words (wa: inputs 0..7 with operands a_j,
    wb: inputs 8..15 with b_j), float32. ASM: eight bf16x2 FMAs into one pair of bfloat16 partial sums, added in
    float32 at the end."""
    if ASM:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t, u, p, lo, hi;
            mov.b32 p, 0x80008000;
            and.b32 t, $1, 0x000F000F;
            fma.rn.bf16x2 p, $3, t, p;
            and.b32 t, $1, 0x00F000F0;
            fma.rn.bf16x2 p, $4, t, p;
            shr.u32 u, $1, 8;
            and.b32 t, u, 0x000F000F;
            fma.rn.bf16x2 p, $5, t, p;
            and.b32 t, u, 0x00F000F0;
            fma.rn.bf16x2 p, $6, t, p;
            and.b32 t, $2, 0x000F000F;
            fma.rn.bf16x2 p, $7, t, p;
            and.b32 t, $2, 0x00F000F0;
            fma.rn.bf16x2 p, $8, t, p;
            shr.u32 u, $2, 8;
            and.b32 t, u, 0x000F000F;
            fma.rn.bf16x2 p, $9, t, p;
            and.b32 t, u, 0x00F000F0;
            fma.rn.bf16x2 p, $10, t, p;
            shl.b32 lo, p, 16;
            and.b32 hi, p, 0xFFFF0000;
            add.f32 $0, lo, hi;
            }""",
            "=f,r,r,r,r,r,r,r,r,r,r", [wa, wb, a0, a1, a2, a3, b0, b1, b2, b3], dtype=tl.float32, is_pure=True,
            pack=1)
    else:
        return (_emu_word(wa, a0, a1, a2, a3) + _emu_word(wb, b0, b1, b2, b3)) * _EMU_A * _EMU_B


@triton.jit
def _x_words(x_ptr, perm_ptr, k0, rows, X_WORDS: tl.constexpr, HAS_PERM: tl.constexpr):
    """The 8 inputs k0 + rows .. k0 + rows + 7 (rows: [R] multiples of 8) as four int32 words each (w_m: x_2m low,
    x_2m+1 high): X_WORDS two 8-byte loads; else (act order, or x not 8-byte aligned) eight 2-byte loads."""
    if X_WORDS:
        x64 = x_ptr.to(tl.pointer_type(tl.int64)) + k0 // 4  # one scalar base a step: the rows are immediates
        v0 = tl.load(x64 + rows // 4)
        v1 = tl.load(x64 + rows // 4 + 1)
        return v0.to(tl.int32), (v0 >> 32).to(tl.int32), v1.to(tl.int32), (v1 >> 32).to(tl.int32)
    else:
        rows = k0 + rows
        if HAS_PERM:
            c0 = tl.load(perm_ptr + rows)
            c1 = tl.load(perm_ptr + rows + 1)
            c2 = tl.load(perm_ptr + rows + 2)
            c3 = tl.load(perm_ptr + rows + 3)
            c4 = tl.load(perm_ptr + rows + 4)
            c5 = tl.load(perm_ptr + rows + 5)
            c6 = tl.load(perm_ptr + rows + 6)
            c7 = tl.load(perm_ptr + rows + 7)
        else:
            c0, c1, c2, c3, c4, c5, c6, c7 = rows, rows + 1, rows + 2, rows + 3, rows + 4, rows + 5, rows + 6, rows + 7
        h = x_ptr.to(tl.pointer_type(tl.int16))
        w0 = (tl.load(h + c0).to(tl.int32) & 0xFFFF) | (tl.load(h + c1).to(tl.int32) << 16)
        w1 = (tl.load(h + c2).to(tl.int32) & 0xFFFF) | (tl.load(h + c3).to(tl.int32) << 16)
        w2 = (tl.load(h + c4).to(tl.int32) & 0xFFFF) | (tl.load(h + c5).to(tl.int32) << 16)
        w3 = (tl.load(h + c6).to(tl.int32) & 0xFFFF) | (tl.load(h + c7).to(tl.int32) << 16)
        return w0, w1, w2, w3


@triton.jit
def _load_words(w_ptrs, N, n_ok, EVEN_N: tl.constexpr):
    """One step's words: [BK/16, BN] tiles of packed rows 2i (at w_ptrs) and 2i + 1."""
    if EVEN_N:
        wa = tl.load(w_ptrs, eviction_policy="evict_first")
        wb = tl.load(w_ptrs + N, eviction_policy="evict_first")
    else:
        wa = tl.load(w_ptrs, mask=n_ok[None, :], other=0, eviction_policy="evict_first")
        wb = tl.load(w_ptrs + N, mask=n_ok[None, :], other=0, eviction_policy="evict_first")
    return wa, wb


@triton.jit
def _pair_step(acc, wa, wb, k0, x_ptr, s_ptr, z_ptr, perm_ptr, rn, n_ok, ri, N, group_size, BLOCK_K: tl.constexpr,
               EVEN_N: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, X_WORDS: tl.constexpr,
               ASM: tl.constexpr):
    """acc [BN] += the step of inputs k0 .. k0 + BLOCK_K - 1 (words wa, wb: packed rows 2i and 2i + 1)."""
    w0, w1, w2, w3 = _x_words(x_ptr, perm_ptr, k0, 16 * ri, X_WORDS, HAS_PERM)  # inputs of packed row 2i
    a0, a1, a2, a3 = _x_pairs(w0, w1, w2, w3, ASM)
    w0, w1, w2, w3 = _x_words(x_ptr, perm_ptr, k0, 16 * ri + 8, X_WORDS, HAS_PERM)
    b0, b1, b2, b3 = _x_pairs(w0, w1, w2, w3, ASM)
    part = _pair_dot(wa, wb, a0[:, None], a1[:, None], a2[:, None], a3[:, None], b0[:, None], b1[:, None],
                     b2[:, None], b3[:, None], ASM)  # [BK/16, BN]
    kk = k0 + tl.arange(0, BLOCK_K)
    if HAS_PERM:
        kk = tl.load(perm_ptr + kk)
    xsum = tl.sum(tl.load(x_ptr + kk).to(tl.float32))  # the step's inputs, for the zero points
    # runs of 4 columns, as the words' (a hint: at 8 columns a thread the 16-bit scales still get a layout of their
    # own, and a trip through shared memory each step; at 4 they share the words')
    g_off = tl.max_contiguous((k0 // group_size).to(tl.int64) * N + rn, 4)
    if EVEN_N:
        s = tl.load(s_ptr + g_off).to(tl.float32)
    else:
        s = tl.load(s_ptr + g_off, mask=n_ok, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        if EVEN_N:
            z = tl.load(z_ptr + g_off).to(tl.float32)
        else:
            z = tl.load(z_ptr + g_off, mask=n_ok, other=0).to(tl.float32)
    else:
        z = 8.0
    return acc + (tl.sum(part, axis=0) * _UNSCALE - z * xsum) * s


@triton.jit
def _w4a16_pair_kernel(
    x_ptr,  # [1, K] bfloat16
    qw_ptr,  # [K // 8, N] int32, contiguous
    s_ptr,  # [K // G, N], contiguous
    z_ptr,  # [K // G, N] uint8 (only when HAS_ZEROS)
    perm_ptr,  # [K] int32 (only when HAS_PERM)
    bias_ptr,  # [N] (only when HAS_BIAS)
    y_ptr,  # [1, N]
    part_ptr,  # [num_splits, 1, N] float32 partial sums (only when SPLIT)
    count_ptr,  # [>= number of N tiles] int32 tickets, 0 between launches (only when SPLIT)
    N, K, group_size,
    k_per_split,  # a multiple of BLOCK_K
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of 16 that divides group_size and k_per_split
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: no masks along N
    SPLIT: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    X_WORDS: tl.constexpr,  # x read 4 inputs per 8-byte load (no perm, x 8-byte aligned)
    ASM: tl.constexpr,  # the paired PTX; False under the interpreter (the same sums in float32)
    PDL: tl.constexpr,  # launched as a programmatic dependent (see the module docstring)
):
    """y = x @ W (+ bias) for one bfloat16 row, the multiply-adds in bf16x2. The tile is [BLOCK_K / 16, BLOCK_N]
    pairs of packed words (rows 2i and 2i + 1 of the step); with BLOCK_N = 128 * num_warps * c every thread holds
    all rows of c * 4 columns, so the per-column work (scales, zero points, the sum over rows) is in-thread and x's
    pairs, which every thread builds for itself, are shared by c * 4 columns.
    Per packed word w (8 weights, nibble j = input 8i + j): w & 0x000F000F read as two bfloat16 is (q0, q4) * 2^-133
    (subnormal: the bit pattern is the value), w & 0x00F000F0 is (q1, q5) * 16 * 2^-133 (bits up to 0xFF stay linear:
    the first normal binade has the subnormals' spacing), and the same after one shift by 8 for q2, q6, q3, q7. An
    FMA with x scaled by 2^XS (2^(XS - 4) for the odd nibbles) makes each product x q 2^(XS - 133) exactly, rounded
    once into the bf16x2 partial sum: no subtraction of a magic number, no int->float conversion. The zero point
    enters once per step and column as z sum(x) (float32; a step lies inside one group), the scale once per step
    and column. Rounding: each FMA rounds to bfloat16 (8 bits) over 8 products a lane, float32 from there; the
    error is about the size of the bfloat16 output's own rounding (bench/RESULTS.md)."""
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    ri = tl.arange(0, BLOCK_K // 16)
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_ptrs = qw_ptr + ((k_lo // 8 + 2 * ri).to(tl.int64) * N)[:, None] + rn[None, :]  # [BK/16, BN]: packed rows 2i
    step = (BLOCK_K // 8) * (tl.zeros((), dtype=tl.int64) + N)  # words between two steps' tiles
    # Two steps an iteration, the words of one in flight while the other's are used: written out, so each buffer
    # is loaded into the registers it is used from (a loop-carried prefetch costs a move per word).
    wa0, wb0 = _load_words(w_ptrs, N, n_ok, EVEN_N)
    if PDL:
        pdl.wait()  # the words above are weights: loaded before the previous kernel's x is ready
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, 2 * BLOCK_K):
        # past the last step: this step's words again (unmasked loads stay 16 bytes wide)
        wa1, wb1 = _load_words(w_ptrs + tl.where(k0 + BLOCK_K < k_hi, step, 0), N, n_ok, EVEN_N)
        acc = _pair_step(acc, wa0, wb0, k0, x_ptr, s_ptr, z_ptr, perm_ptr, rn, n_ok, ri, N, group_size, BLOCK_K,
                         EVEN_N, HAS_ZEROS, HAS_PERM, X_WORDS, ASM)
        w_ptrs += tl.where(k0 + 2 * BLOCK_K < k_hi, 2 * step, 0)
        wa0, wb0 = _load_words(w_ptrs, N, n_ok, EVEN_N)
        if k0 + BLOCK_K < k_hi:
            acc = _pair_step(acc, wa1, wb1, k0 + BLOCK_K, x_ptr, s_ptr, z_ptr, perm_ptr, rn, n_ok, ri, N, group_size,
                             BLOCK_K, EVEN_N, HAS_ZEROS, HAS_PERM, X_WORDS, ASM)

    if SPLIT:
        total, last = split_k_reduce(acc, part_ptr, count_ptr, pid_n, rn, n_ok, tl.zeros((), dtype=tl.int64) + N)
        if last:
            if HAS_BIAS:
                total += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(y_ptr + rn, total.to(y_ptr.dtype.element_ty), mask=n_ok)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


# ---------------------------------------------------------------------------------------------------------------
# float32 arithmetic


@triton.jit
def _w4a16_stream_kernel(
    x_ptr,  # [M, K] (rows strided, K contiguous)
    qw_ptr,  # [K // 8, N] int32, contiguous
    s_ptr,  # [K // G, N], contiguous
    z_ptr,  # [K // G, N] uint8 (only when HAS_ZEROS)
    perm_ptr,  # [K] int32 (only when HAS_PERM)
    bias_ptr,  # [N] (only when HAS_BIAS)
    y_ptr,  # [M, N]
    part_ptr,  # [num_splits, M, N] float32 partial sums (only when SPLIT)
    count_ptr,  # [>= number of N tiles] int32 tickets, 0 between launches (only when SPLIT)
    M, N, K, group_size,
    stride_xm, stride_ym,
    k_per_split,  # a multiple of BLOCK_K
    magic_bits,  # 0x4B000000, as an argument: a register, so (word & mask) | magic is one LOP3 with the mask as its
    # one immediate (both constants would cost a move of the mask into a register for every weight)
    BLOCK_M: tl.constexpr,  # rows, a power of two >= M (1 for decode at batch 1)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides group_size and k_per_split
    SPLIT: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    X_PAIRS: tl.constexpr,  # bfloat16 x read as int32 words of two inputs (no perm, x aligned): half the loads
    PDL: tl.constexpr,  # launched as a programmatic dependent (see the module docstring)
):
    """The GEMV for few rows as a stream of packed words, in as few instructions per weight as the float32 sums
    allow (it is bound by instruction issue, not by the bytes, once the words arrive as 16-byte loads): only 2D
    [BLOCK_K / 8, BLOCK_N] tiles of words, the 8 nibbles of a word unrolled at compile time, the next step's words
    loaded before this step's arithmetic (registers double-buffer the stream whatever the compiler pipelines), and
    no shift per nibble: nibble j sits at bits p = 4j of the word for j <= 4 (p = 4(j - 3) after one shift by 12
    for j = 5..7), so (word & 0xF << p) | 0x4B000000 read as float32 is exactly 2^23 + q * 2^p (< 2^24), and minus
    2^23 it is q * 2^p exactly; x comes pre-multiplied by 2^-p (a power of two: the products round as x * q would).
    Per weight: one LOP3, one FADD, one FFMA. The zero point enters once per word: sum_j x_j (q_j - z) = sum_j x_j
    q_j - z sum_j x_j (float32 sums; the reference's tolerance is bf16's)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Outputs past N are masked, not clamped: a clamped index hides the contiguity along N from the compiler and
    # every word becomes its own 4-byte load; masked, N a multiple of 4 gives 16-byte loads.
    n_ok = rn < N
    ri = tl.arange(0, BLOCK_K // 8)
    rm = tl.arange(0, BLOCK_M)
    rm_c = tl.minimum(rm, M - 1)
    x_rows = x_ptr + rm_c.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_ptrs = qw_ptr + ((k_lo // 8 + ri).to(tl.int64) * N)[:, None] + rn[None, :]  # [BK/8, BN]
    step = (BLOCK_K // 8) * N  # words between two steps' tiles
    nxt = tl.load(w_ptrs, mask=n_ok[None, :], other=0, eviction_policy="evict_first")
    if PDL:
        pdl.wait()  # the words above are weights: loaded before the previous kernel's x is ready
    if BLOCK_M == 1:
        acc2 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)  # reduced over the packed rows at the end
    else:
        acc3 = tl.zeros((BLOCK_M, BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        packed = nxt
        w_ptrs += step
        more = (k0 + BLOCK_K + ri * 0 < k_hi)[:, None] & n_ok[None, :]  # past the last step: no read
        nxt = tl.load(w_ptrs, mask=more, other=0, eviction_policy="evict_first")
        hi = packed >> 12  # nibbles 5..7 at bits 8..19 (the sign bits above are masked away)
        # The step's scales and zero points as [BK/8, BN] tiles in the words' layout (a row index that is always 0
        # but not known to be: a [BN] vector would get its own layout and a trip through shared memory, with a
        # barrier, for each use); every row reads the same bytes, from L1.
        g_off = (k0 // group_size).to(tl.int64) * N + rn[None, :] + (ri // (BLOCK_K // 8))[:, None] * N
        s = tl.load(s_ptr + g_off, mask=n_ok[None, :], other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + g_off, mask=n_ok[None, :], other=0).to(tl.float32)
        else:
            z = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32) + 8.0
        for j in tl.static_range(8):
            src = packed if j < 5 else hi
            # nibble j sits in src at bits 4 * (j if j < 5 else j - 3) (written out below: a constexpr cannot be
            # reassigned inside the unrolled loop)
            w = ((src & (0xF << (4 * j if j < 5 else 4 * (j - 3)))) | magic_bits).to(tl.float32, bitcast=True) - _MAGIC
            kk = k0 + ri * 8 + j  # [BK/8] inputs of nibble j
            if HAS_PERM:
                cols = tl.load(perm_ptr + kk)
            else:
                cols = kk
            if BLOCK_M == 1:
                if X_PAIRS:
                    if j % 2 == 0:  # inputs j and j + 1 of each packed row in one word
                        xw = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + (k0 // 2 + ri * 4 + j // 2))
                        xj = (xw << 16).to(tl.float32, bitcast=True)  # bfloat16 is float32's upper half
                    else:
                        xj = (xw & -65536).to(tl.float32, bitcast=True)
                else:
                    xj = tl.load(x_ptr + cols).to(tl.float32)  # [BK/8]
                if j == 0:
                    xs = xj
                    p2 = (xj * (0.5 ** (4 * j if j < 5 else 4 * (j - 3))))[:, None] * w
                else:
                    xs += xj
                    p2 += (xj * (0.5 ** (4 * j if j < 5 else 4 * (j - 3))))[:, None] * w
            else:
                xj = tl.load(x_rows + cols[None, :]).to(tl.float32)  # [BM, BK/8]
                if j == 0:
                    xs3 = xj
                    p3 = (xj * (0.5 ** (4 * j if j < 5 else 4 * (j - 3))))[:, :, None] * w[None, :, :]
                else:
                    xs3 += xj
                    p3 += (xj * (0.5 ** (4 * j if j < 5 else 4 * (j - 3))))[:, :, None] * w[None, :, :]
        # sum_j x_j (q_j - z) = sum_j x_j q_j - z sum_j x_j: the zero point once per word, not once per weight
        if BLOCK_M == 1:
            acc2 += (p2 - xs[:, None] * z) * s
        else:
            acc3 += (p3 - xs3[:, :, None] * z[None, :, :]) * s[None, :, :]
    if BLOCK_M == 1:
        acc = tl.sum(acc2, axis=0)[None, :]  # [1, BN]
    else:
        acc = tl.sum(acc3, axis=1)  # [BM, BN]

    out_mask = (rm < M)[:, None] & (rn < N)[None, :]
    y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    if SPLIT:
        tile = rm.to(tl.int64)[:, None] * N + rn[None, :]
        split_stride = (tl.zeros((), dtype=tl.int64) + M) * N
        total, last = split_k_reduce(acc, part_ptr, count_ptr, pid_n, tile, out_mask, split_stride)
        if last:
            if HAS_BIAS:
                total += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


# ---------------------------------------------------------------------------------------------------------------
# Launches (kernels/w4a16.py w4a16_gemv_triton checks the operands and picks the config)


def launch_pair(x, qweight, scales, qzeros, bias, perm, out, N: int, K: int, group_size: int, *, block_n: int,
                block_k: int, split_k: int, num_warps: int, pdl: bool) -> None:
    """One launch of _w4a16_pair_kernel for bfloat16 x [1, K]: N tiles on grid axis 0, K splits on axis 1."""
    if group_size % block_k or block_k % 16:
        raise ValueError(f"config: block_k={block_k} must be a multiple of 16 that divides the group size "
                         f"{group_size} (mode 'pair')")
    tiles = triton.cdiv(N, block_n)
    plan = plan_split_k(K, block_k, split_k, tiles, out, f"qweight: N={N}")
    pdl = pdl and PDL_SUPPORTED
    _w4a16_pair_kernel[(tiles, plan.num_splits)](
        x, qweight, scales, qzeros if qzeros is not None else qweight, perm if perm is not None else qweight,
        bias if bias is not None else out, out, plan.part, plan.counters, N, K, group_size, plan.k_per_split,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_N=N % block_n == 0, SPLIT=plan.split, HAS_ZEROS=qzeros is not None,
        HAS_PERM=perm is not None, HAS_BIAS=bias is not None, X_WORDS=perm is None and x.data_ptr() % 8 == 0,
        ASM=not _INTERPRET, PDL=pdl, num_warps=num_warps, num_stages=1, **launch_kwargs(pdl),
    )


def launch_stream(x, qweight, scales, qzeros, bias, perm, out, M: int, N: int, K: int, group_size: int, *,
                  block_n: int, block_k: int, split_k: int, num_warps: int, num_stages: int, x_pairs: bool,
                  pdl: bool) -> None:
    """One launch of _w4a16_stream_kernel: N tiles on grid axis 0, K splits on axis 1."""
    check_block_k(block_k, group_size)
    tiles = triton.cdiv(N, block_n)
    plan = plan_split_k(K, block_k, split_k, tiles, out, f"qweight: N={N}")
    pdl = pdl and PDL_SUPPORTED
    _w4a16_stream_kernel[(tiles, plan.num_splits)](
        x, qweight, scales, qzeros if qzeros is not None else qweight, perm if perm is not None else qweight,
        bias if bias is not None else out, out, plan.part, plan.counters,
        M, N, K, group_size, x.stride(0), out.stride(0), plan.k_per_split, 0x4B000000,
        BLOCK_M=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=plan.split,
        HAS_ZEROS=qzeros is not None, HAS_PERM=perm is not None, HAS_BIAS=bias is not None,
        X_PAIRS=x_pairs and M == 1 and perm is None and x.dtype == torch.bfloat16 and x.data_ptr() % 4 == 0,
        PDL=pdl, num_warps=num_warps, num_stages=num_stages, **launch_kwargs(pdl),
    )
