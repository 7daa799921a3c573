"""Times each Triton kernel at Qwen2.5-7B shapes against its torch reference and the H200's ceilings.

  python bench/kernels.py [--quick] [--sweep] [--json out.json] [--compile-only]

Qwen2.5-7B: 28 query heads, 4 KV heads, head_dim 128, hidden 3584, intermediate 18944; block size 16.
Each row prints the time (median of triton.testing.do_bench, which clears the L2 before every run), the bytes it
must move at least (each input read once, each output written once) and the FLOPs, and the fraction of the
ceilings reached: 4.26 TB/s copy and 781 TFLOP/s bf16 (the issue's H200 numbers; this run's own measured copy and
matmul rates are printed too). Prefill rows pass the step's k/v as the engine does (the launch may read the chunk's
own keys from them). --compile-only launches every timed configuration once, untimed (to fill Triton's cache from
a process running beside the tests). Needs a CUDA device.
The *_quant_fp8 rows (the norms and SiLU-and-mul writing fp8 and per-token scales, engine/fp8_fusion.py) show the
unfused pair (the 16-bit kernel, then per_token_quant_fp8) in the ref column: the kernel-level A/B of
TANDEM_FUSED_FP8_QUANT (for the model-level one, run bench/profile_decode.py --quantization fp8 with it 0 and 1).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.activation import silu_and_mul_quant_fp8_triton, silu_and_mul_ref, silu_and_mul_triton  # noqa: E402
from kernels.kv_write import write_kv_ref, write_kv_triton  # noqa: E402
from kernels.norm import fused_add_rms_norm_ref, fused_add_rms_norm_triton, rms_norm_ref, rms_norm_triton  # noqa: E402
from kernels.norm import fused_add_rms_norm_quant_fp8_triton, rms_norm_quant_fp8_triton  # noqa: E402
from kernels.quant_fp8 import per_token_quant_fp8_triton  # noqa: E402
from kernels.paged_attention import (LAST_LAUNCH, PREFILL_CANDIDATES, default_config, paged_attention_ref,  # noqa: E402
                                     paged_attention_triton)
from kernels.rotary import rotary_embedding_ref, rotary_embedding_triton  # noqa: E402

PEAK_BW = 4.26e12  # B/s, H200 device-to-device copy (read + write)
PEAK_FLOPS = 781e12  # FLOP/s, H200 dense bf16
H, HKV, D, HIDDEN, INTER, BS = 28, 4, 128, 3584, 18944, 16
REF_MEM_LIMIT = 24e9  # skip the torch reference where its float32 intermediates would exceed this


COMPILE_ONLY = False


def bench(fn) -> float:
    import triton.testing
    if COMPILE_ONLY:
        fn()
        torch.cuda.synchronize()
        return float("nan")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3  # seconds


def ceilings() -> dict[str, float]:
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    copy_s = bench(lambda: b.copy_(a))
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_s = bench(lambda: x @ y)
    del a, b, x, y
    return {"copy_TB_s": 2 * n / copy_s / 1e12, "bf16_matmul_TFLOP_s": 2 * 8192**3 / mm_s / 1e12}


def step_kv(args) -> dict:
    """The step's k/v as the engine passes them: row t holds what the cache holds for q's row t; k contiguous (the
    rotary output), v a slice of a fused qkv-shaped tensor."""
    kc, vc, bt = args["k_cache"], args["v_cache"], args["block_tables"]
    qsl, seq_lens = args["query_start_loc"].tolist(), args["seq_lens"].tolist()
    blocks, offs = [], []
    for i, sl in enumerate(seq_lens):
        pos = torch.arange(sl - (qsl[i + 1] - qsl[i]), sl)
        blocks.append(bt[i, (pos // BS).cuda()].long())
        offs.append((pos % BS).cuda())
    blocks, offs = torch.cat(blocks), torch.cat(offs)
    k = kc[blocks, offs].to(args["q"].dtype)  # [T, Hkv, D]
    qkv = torch.empty(k.shape[0], (H + 2 * HKV) * D, dtype=k.dtype, device="cuda")
    v = qkv[:, (H + HKV) * D:].view(-1, HKV, D)
    v.copy_(vc[blocks, offs].to(v.dtype))
    return dict(k=k, v=v)


def paged_batch(specs, dtype=torch.bfloat16, kv_fp8=False):
    """specs: [(q_len, seq_len)] -> paged_attention's arguments over a shuffled block pool, plus bytes/FLOPs."""
    nblk = [math.ceil(sl / BS) for _, sl in specs]
    num_blocks = sum(nblk) + 1
    kv = torch.randn(num_blocks, 1, 2, BS, HKV, D, dtype=dtype, device="cuda")
    k_scale = v_scale = 1.0
    if kv_fp8:
        kv = (kv * 16).to(torch.float8_e4m3fn)
        k_scale = v_scale = 1 / 16
    perm = torch.randperm(num_blocks, device="cuda")
    bt = torch.zeros(len(specs), max(nblk), dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(nblk):
        bt[i, :n] = perm[used:used + n]
        used += n
    q_lens = torch.tensor([ql for ql, _ in specs])
    qsl = torch.zeros(len(specs) + 1, dtype=torch.int32)
    qsl[1:] = q_lens.cumsum(0)
    num_tokens = int(qsl[-1])
    args = dict(q=torch.randn(num_tokens, H, D, dtype=dtype, device="cuda"), k_cache=kv[:, 0, 0],
                v_cache=kv[:, 0, 1], block_tables=bt, seq_lens=torch.tensor([sl for _, sl in specs],
                dtype=torch.int32, device="cuda"), query_start_loc=qsl.cuda(), max_query_len=int(q_lens.max()),
                max_seq_len=max(sl for _, sl in specs), scale=D ** -0.5, k_scale=k_scale, v_scale=v_scale)
    elt = kv.element_size()
    kv_bytes = sum(sl * HKV * D * 2 * elt for _, sl in specs)
    qo_bytes = 2 * num_tokens * H * D * args["q"].element_size()
    # causal: query j of a sequence sees seq_len - q_len + j + 1 keys; QK^T and PV are 2 FLOPs per MAC each
    visible = sum(ql * (sl - ql) + ql * (ql + 1) // 2 for ql, sl in specs)
    ref_mem = len(specs) * max(sl for _, sl in specs) * H * D * 4 * 4 + \
        len(specs) * H * int(q_lens.max()) * max(sl for _, sl in specs) * 4 * 3
    return args, kv_bytes + qo_bytes, 4 * visible * H * D, ref_mem


ROWS: list[dict] = []


def record(kernel, shape, fn, ref_fn, nbytes, flops, extra=None, bound="bw"):
    t = bench(fn)
    if COMPILE_ONLY:
        return dict(ms=float("nan"), config=(extra or {}).get("config"))
    try:
        t_ref = bench(ref_fn) if ref_fn is not None else None
    except torch.OutOfMemoryError:
        t_ref = None
    row = dict(kernel=kernel, shape=shape, ms=t * 1e3, ref_ms=t_ref * 1e3 if t_ref else None,
               TB_s=nbytes / t / 1e12, TFLOP_s=flops / t / 1e12, frac_bw=nbytes / t / PEAK_BW,
               frac_flops=flops / t / PEAK_FLOPS, bound=bound, **(extra or {}))
    ROWS.append(row)
    ref = f"{row['ref_ms']:9.3f}" if t_ref else "        -"
    print(f"{kernel:22s} {shape:34s} {row['ms']:9.4f} {ref}  {row['TB_s']:6.2f} TB/s ({row['frac_bw']:5.1%})  "
          f"{row['TFLOP_s']:6.1f} TF/s ({row['frac_flops']:5.1%})", flush=True)
    return row


def bench_attention(quick: bool):
    decode = [(1, 4096), (1, 32768), (8, 4096), (64, 512), (64, 4096), (64, 32768), (256, 4096), (256, 32768)]
    if quick:
        decode = [(1, 32768), (64, 4096), (256, 4096)]
    for batch, ctx in decode:
        for fp8 in (False, True) if (batch, ctx) == (64, 4096) else (False,):
            args, nbytes, flops, ref_mem = paged_batch([(1, ctx)] * batch, kv_fp8=fp8)
            cfg = default_config(batch, batch, HKV, H // HKV, D, 1, ctx,
                                 torch.cuda.get_device_properties(0).multi_processor_count)
            record("decode_attn" + ("_fp8" if fp8 else ""), f"batch={batch} ctx={ctx}",
                   lambda: paged_attention_triton(**args), (lambda: paged_attention_ref(**args))
                   if ref_mem < REF_MEM_LIMIT else None, nbytes, flops, dict(config=cfg))
            del args
    prefill = [("chunk=4096 prefix=0", [(4096, 4096)]), ("chunk=4096 prefix=4096", [(4096, 8192)]),
               ("4 x chunk=1024 prefix=3072", [(1024, 4096)] * 4),
               ("mixed 2048-chunk + 63 decodes@4k", [(2048, 6144)] + [(1, 4096)] * 63)]
    for name, specs in prefill:
        args, nbytes, flops, ref_mem = paged_batch(specs)
        kv = step_kv(args)
        paged_attention_triton(**args, **kv)
        print(f"  {compiled()}")
        record("prefill_attn", name, lambda: paged_attention_triton(**args, **kv),
               (lambda: paged_attention_ref(**args)) if ref_mem < REF_MEM_LIMIT else None, nbytes, flops,
               bound="flops")
        del args, kv


def compiled() -> str:
    k = LAST_LAUNCH.get("kernel")
    if k is None or not hasattr(k, "n_regs"):
        return "compiled: ?"
    return f"compiled: {k.n_regs} registers, {k.n_spills} spills, {getattr(k.metadata, 'shared', '?')} B smem"


def _sweep(label, name, specs, configs, deadline, kv_fp8=False, bound="bw"):
    args, nbytes, flops, _ = paged_batch(specs, kv_fp8=kv_fp8)
    kv = step_kv(args) if max(q for q, _ in specs) > 1 else {}
    best = None
    for cfg in configs:
        if time.time() > deadline:
            print(f"  sweep budget spent: {name} stopped early")
            break
        try:
            row = record(label, name, lambda: paged_attention_triton(**args, **kv, config=cfg), None, nbytes,
                         flops, dict(config=cfg), bound=bound)
        except Exception as e:  # noqa: BLE001 (an out-of-resources config is a data point)
            print(f"  {cfg}: {type(e).__name__}: {str(e)[:100]}")
            continue
        if COMPILE_ONLY:
            continue
        print(f"    {cfg} {compiled()}")
        row["compiled"] = compiled()
        if best is None or row["ms"] < best["ms"]:
            best = row
    if best:
        frac = best["frac_flops"] if bound == "flops" else best["frac_bw"]
        print(f"BEST {label} {name}: {best['config']} {best['ms']:.4f} ms {frac:.1%}")
    del args


def sweep_attention(budget_s: float, full: bool):
    """Times config variants at the target shapes (docs/kernels.md keeps the tables); stops after budget_s."""
    deadline = time.time() + budget_s
    # The prefill launch configurations that may become the default (tests/kernels checks each on CUDA).
    _sweep("sweep_prefill", "chunk=4096", [(4096, 4096)], PREFILL_CANDIDATES, deadline, bound="flops")
    _sweep("sweep_prefill", "chunk=4096 prefix=4096", [(4096, 8192)], PREFILL_CANDIDATES, deadline, bound="flops")
    mixed = [dict(block_m=m, tile_n=64, num_warps=w, num_stages=2, new_kv=n) for m, w in ((128, 8), (64, 4))
             for n in (0, 2)]
    _sweep("sweep_mixed", "2048-chunk + 63 decodes@4k", [(2048, 6144)] + [(1, 4096)] * 63, mixed, deadline,
           bound="flops")
    if not full:
        return
    prefill = [dict(block_m=128, tile_n=t, num_warps=8, num_stages=st) for t in (64, 128) for st in (2, 3, 4)]
    prefill += [dict(block_m=64, tile_n=64, num_warps=w, num_stages=st) for w, st in ((4, 2), (4, 3), (8, 2))]
    _sweep("sweep_prefill", "chunk=4096 (cache only)", [(4096, 4096)], prefill, deadline, bound="flops")
    fp8 = [dict(tile_n=t, num_segments=sg, num_warps=w, num_stages=st, fp8_via_fp16=f)
           for f in (0, 1) for t in (128, 256) for sg in (1, 2) for w, st in ((4, 3), (8, 3))]
    _sweep("sweep_decode_fp8", "batch=64 ctx=4096", [(1, 4096)] * 64, fp8, deadline, kv_fp8=True)
    decode = [dict(tile_n=t, num_segments=1, num_warps=w, num_stages=3) for t in (128, 256) for w in (4, 8)]
    _sweep("sweep_decode", "batch=64 ctx=4096", [(1, 4096)] * 64, decode, deadline)
    small = [dict(tile_n=128, num_segments=sg, num_warps=4, num_stages=3) for sg in (1, 2, 4, 8, 16)]
    _sweep("sweep_decode", "batch=8 ctx=4096", [(1, 4096)] * 8, small, deadline)


def sweep_short_decode(budget_s: float):
    """Decode attention at the offline-throughput workload's contexts (512-token prompts, 256 outputs: ~640 keys per
    sequence at batch 256-512), where each program's walk is a few tiles long, and at batch 1."""
    deadline = time.time() + budget_s
    configs = [dict(tile_n=t, num_segments=1, num_warps=w, num_stages=st)
               for t in (32, 64, 128) for w in (2, 4, 8) for st in (2, 3, 4)]
    for b in (256, 512):
        _sweep("sweep_decode_short", f"batch={b} ctx=640", [(1, 640)] * b, configs, deadline)
    fp8 = [dict(tile_n=t, num_segments=1, num_warps=w, num_stages=st) for t in (64, 128) for w in (4, 8)
           for st in (2, 3)]
    _sweep("sweep_decode_short_fp8", "batch=512 ctx=640", [(1, 640)] * 512, fp8, deadline, kv_fp8=True)
    one = [dict(tile_n=t, num_segments=sg, num_warps=w, num_stages=3) for t in (32, 64) for sg in (4, 8, 16)
           for w in (2, 4)]
    _sweep("sweep_decode_short", "batch=1 ctx=640", [(1, 640)], one, deadline)


def sweep_fp8_decode(budget_s: float):
    """fp8-cache decode read byte by byte (fp8x4=0) against four values per 32-bit load (fp8x4=1), at the
    offline workload's short contexts and at 4k; the 16-bit cache's default config alongside for reference."""
    deadline = time.time() + budget_s
    fp8 = [dict(fp8x4=x, tile_n=t, num_warps=4, num_stages=st) for x in (2, 1, 0) for t in (64, 128)
           for st in (2, 3)]
    for name, specs in (("batch=512 ctx=640", [(1, 640)] * 512), ("batch=64 ctx=4096", [(1, 4096)] * 64),
                        ("batch=256 ctx=4096", [(1, 4096)] * 256)):
        _sweep("sweep_decode_bf16", name, specs, [{}], deadline)
        _sweep("sweep_decode_fp8", name, specs, fp8, deadline, kv_fp8=True)


def engine_batch(seq_lens, kv: str, num_layers: int = 28, max_seq_len: int | None = None):
    """paged_attention's decode arguments over layer 3 of an engine-layout cache (engine/model_runner.py:
    [blocks, layers, 2, block_size, kv_heads, row], so the strides are the engine's; an int8 row is head_dim values
    then its float32 scale) for kv in bf16 / fp8 / int8, filled as write_kv fills it; plus the bytes it must read."""
    from kernels.quant_int8 import INT8_ROW_PAD, int8_cache_views, quantize_int8_rows_ref
    nblk = [math.ceil(sl / BS) for sl in seq_lens]
    num_blocks = sum(nblk) + 1
    row = D + INT8_ROW_PAD if kv == "int8" else D
    dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[kv]
    cache = torch.empty(num_blocks, num_layers, 2, BS, HKV, row, dtype=dtype, device="cuda")
    x = torch.randn(num_blocks, 2, BS, HKV, D, device="cuda") * torch.rand(num_blocks, 2, BS, HKV, 1, device="cuda")
    extra = {}
    if kv == "int8":
        (kc, ks), (vc, vs) = int8_cache_views(cache[:, 3, 0]), int8_cache_views(cache[:, 3, 1])
        x_q, sc = quantize_int8_rows_ref(x)
        kc.copy_(x_q[:, 0]), vc.copy_(x_q[:, 1]), ks.copy_(sc[:, 0]), vs.copy_(sc[:, 1])
        extra = dict(k_scale_cache=ks, v_scale_cache=vs)
    else:
        kc, vc = cache[:, 3, 0], cache[:, 3, 1]
        if kv == "fp8":
            x *= 64
            extra = dict(k_scale=1 / 64, v_scale=1 / 64)
        kc.copy_(x[:, 0]), vc.copy_(x[:, 1])
    del x
    perm = torch.randperm(num_blocks, device="cuda")
    max_seq_len = max_seq_len or max(seq_lens)
    bt = torch.zeros(len(seq_lens), max(max(nblk), math.ceil(max_seq_len / BS)), dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(nblk):
        bt[i, :n] = perm[used:used + n]
        used += n
    b = len(seq_lens)
    args = dict(q=torch.randn(b, H, D, dtype=torch.bfloat16, device="cuda"), k_cache=kc, v_cache=vc, block_tables=bt,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                query_start_loc=torch.arange(b + 1, dtype=torch.int32, device="cuda"), max_query_len=1,
                max_seq_len=max_seq_len, scale=D ** -0.5, **extra)
    nbytes = sum(seq_lens) * HKV * 2 * (row * cache.element_size()) + 2 * b * H * D * 2
    return args, nbytes, 4 * sum(seq_lens) * H * D


def int8_decode(budget_s: float):
    """Decode attention over engine-layout bf16 / fp8 / int8 caches at the offline workload's shape (batch 256, contexts
    512-768, mean ~640: 500 x 512/256 with --max-num-seqs 256) and at batch 1 (640 keys; the launch sized for
    max_model_len 784, as the decode CUDA graphs are), each checked against paged_attention_ref; then the int8 KV
    write against the bf16 / fp8 caches' fused rotary + write, at 256 decode tokens."""
    from kernels.quant_int8 import INT8_ROW_PAD, int8_cache_views
    from kernels.rotary import rotary_embedding_write_kv_triton
    deadline = time.time() + budget_s
    gen = torch.Generator().manual_seed(0)
    shapes = (("batch=256 ctx=512..768", torch.randint(512, 769, (256,), generator=gen).tolist(), None),
              ("batch=1 ctx=640", [640], 784))
    old = dict(fp8x4=0, num_stages=3)  # the int8 default before the word walk
    for name, seq_lens, max_len in shapes:
        tiles = (128, 64) if len(seq_lens) > 1 else (64,)  # batch 1: the default's 64-key tiles, split context
        words = [dict(fp8x4=x, tile_n=t, num_stages=st) for x in (2, 1) for t in tiles for st in (2, 3)]
        for kv, configs in (("bf16", [{}]), ("fp8", [{}]), ("int8", [{}, old] + words)):
            if time.time() > deadline:
                print("  budget spent")
                return
            args, nbytes, flops = engine_batch(seq_lens, kv, max_seq_len=max_len)
            ref = paged_attention_ref(**args).float()
            for cfg in configs:
                out = torch.full_like(args["q"], float("nan"))
                try:
                    paged_attention_triton(**args, out=out, config=cfg or None)
                except Exception as e:  # noqa: BLE001 (an out-of-resources config is a data point)
                    print(f"  {kv} {cfg}: {type(e).__name__}: {str(e)[:100]}")
                    continue
                err = ((out.float() - ref).norm() / ref.norm()).item()
                ok = bool(torch.isfinite(out).all()) and err < 2e-2
                record(f"decode_{kv}", name, lambda: paged_attention_triton(**args, config=cfg or None), None,
                             nbytes, flops, dict(config=cfg or "default", rel_err=err, ok=ok, compiled=compiled()))
                print(f"    {cfg or 'default'} rel err {err:.2e} {'ok' if ok else 'WRONG'}  {compiled()}")
            del args, ref
    tokens = 256
    k = torch.randn(tokens, HKV, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    q = torch.randn(tokens, H, D, dtype=torch.bfloat16, device="cuda")
    pos = torch.randint(0, 768, (tokens,), device="cuda")
    cos_sin = torch.randn(4096, D, device="cuda")
    nblocks = 1024
    slots = torch.randperm(nblocks * BS, device="cuda")[:tokens]
    for kv in ("bf16", "fp8", "int8"):
        dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[kv]
        row = D + INT8_ROW_PAD if kv == "int8" else D
        cache = torch.zeros(nblocks, 28, 2, BS, HKV, row, dtype=dtype, device="cuda")
        if kv == "int8":
            (kc, ks), (vc, vs) = int8_cache_views(cache[:, 3, 0]), int8_cache_views(cache[:, 3, 1])
            extra = dict(k_scale_cache=ks, v_scale_cache=vs)
        else:
            kc, vc, extra = cache[:, 3, 0], cache[:, 3, 1], {}
        scales = (0.05, 0.05) if kv == "fp8" else (1.0, 1.0)
        nbytes = tokens * (H + 2 * HKV) * D * 2 * 2 + tokens * HKV * 2 * row * cache.element_size()
        record(f"rotary_write_kv_{kv}", f"tokens={tokens}",
               lambda: rotary_embedding_write_kv_triton(pos, q, k, v, cos_sin, kc, vc, slots, *scales, **extra),
               None, nbytes, 0)
        if kv == "int8":
            record("write_kv_int8", f"tokens={tokens}",
                   lambda: write_kv_triton(k, v, kc, vc, slots, **extra), None, tokens * HKV * 2 * (D * 2 + row), 0)
        del cache


def bench_pointwise(quick: bool):
    bf16 = torch.bfloat16
    for tokens in (64, 4096, 32768) if not quick else (4096, 32768):
        nblocks = math.ceil(tokens / BS) + 8
        kv = torch.randn(nblocks, 28, 2, BS, HKV, D, dtype=bf16, device="cuda")  # 28 layers: strided views
        k = torch.randn(tokens, HKV, D, dtype=bf16, device="cuda")
        v = torch.randn_like(k)
        slots = torch.randperm(nblocks * BS, device="cuda")[:tokens]
        kc, vc = kv[:, 3, 0], kv[:, 3, 1]
        record("write_kv", f"tokens={tokens}", lambda: write_kv_triton(k, v, kc, vc, slots),
               lambda: write_kv_ref(k, v, kc, vc, slots), 4 * tokens * HKV * D * 2 + tokens * 8, 0)
        kv8 = torch.empty(kv.shape, dtype=torch.float8_e4m3fn, device="cuda")
        kc8, vc8 = kv8[:, 3, 0], kv8[:, 3, 1]
        record("write_kv_fp8", f"tokens={tokens}", lambda: write_kv_triton(k, v, kc8, vc8, slots, 0.05, 0.05),
               lambda: write_kv_ref(k, v, kc8, vc8, slots, 0.05, 0.05), 2 * tokens * HKV * D * 3 + tokens * 8, 0)
        del kv, kv8
    for tokens in (1, 64, 4096, 32768) if not quick else (4096,):
        x = torch.randn(tokens, HIDDEN, dtype=bf16, device="cuda")
        r = torch.randn_like(x)
        w = torch.randn(HIDDEN, dtype=bf16, device="cuda")
        n = x.numel() * 2
        record("rms_norm", f"tokens={tokens}", lambda: rms_norm_triton(x, w, 1e-6), lambda: rms_norm_ref(x, w, 1e-6),
               2 * n + HIDDEN * 2, 0)
        record("fused_add_rms_norm", f"tokens={tokens}", lambda: fused_add_rms_norm_triton(x, r, w, 1e-6),
               lambda: fused_add_rms_norm_ref(x, r, w, 1e-6), 4 * n + HIDDEN * 2, 0)
        # ref column: the unfused pair. Bytes: x (and r, residual out) in 16 bits, x_q in fp8, a float32 scale per row.
        record("rms_norm_quant_fp8", f"tokens={tokens}", lambda: rms_norm_quant_fp8_triton(x, w, 1e-6),
               lambda: per_token_quant_fp8_triton(rms_norm_triton(x, w, 1e-6)), n + n // 2 + tokens * 4 + HIDDEN * 2,
               0)
        record("fused_add_rms_norm_q8", f"tokens={tokens}", lambda: fused_add_rms_norm_quant_fp8_triton(x, r, w, 1e-6),
               lambda: per_token_quant_fp8_triton(fused_add_rms_norm_triton(x, r, w, 1e-6)[0]),
               3 * n + n // 2 + tokens * 4 + HIDDEN * 2, 0)
        pos = torch.randint(0, 32768, (tokens,), device="cuda")
        qkv = torch.randn(tokens, (H + 2 * HKV) * D, dtype=bf16, device="cuda")
        q = qkv[:, :H * D].view(tokens, H, D)
        kk = qkv[:, H * D:(H + HKV) * D].view(tokens, HKV, D)
        cache = torch.randn(32768, D, device="cuda")
        record("rotary", f"tokens={tokens}", lambda: rotary_embedding_triton(pos, q, kk, cache, q_out=q, k_out=kk),
               lambda: rotary_embedding_ref(pos, q, kk, cache), 2 * tokens * (H + HKV) * D * 2 + tokens * D * 4, 0)
        g = torch.randn(tokens, 2 * INTER, dtype=bf16, device="cuda")
        record("silu_and_mul", f"tokens={tokens}", lambda: silu_and_mul_triton(g), lambda: silu_and_mul_ref(g),
               3 * tokens * INTER * 2, 0)
        record("silu_and_mul_quant_fp8", f"tokens={tokens}", lambda: silu_and_mul_quant_fp8_triton(g),
               lambda: per_token_quant_fp8_triton(silu_and_mul_triton(g)), 2 * tokens * INTER * 2 + tokens * INTER
               + tokens * 4, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows and the run's metadata here")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--sweep", action="store_true", help="also time attention config variants")
    ap.add_argument("--sweep-budget", type=float, default=150.0, help="seconds the sweep may take")
    ap.add_argument("--full-sweep", action="store_true", help="also the older cache-only prefill and decode sweeps")
    ap.add_argument("--only", choices=["attention", "pointwise", "sweep", "decode-sweep", "fp8-decode-sweep",
                                       "int8-decode"],
                    help="one group only")
    ap.add_argument("--compile-only", action="store_true", help="launch each timed configuration once, untimed")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA device")
    global COMPILE_ONLY
    COMPILE_ONLY = a.compile_only
    t0 = time.time()
    ceil = ceilings() if not COMPILE_ONLY else {"copy_TB_s": float("nan"), "bf16_matmul_TFLOP_s": float("nan")}
    print(f"{torch.cuda.get_device_name(0)}: measured copy {ceil['copy_TB_s']:.2f} TB/s, bf16 matmul "
          f"{ceil['bf16_matmul_TFLOP_s']:.0f} TFLOP/s (fractions below are of 4.26 TB/s and 781 TFLOP/s)")
    print(f"{'kernel':22s} {'shape':34s} {'ms':>9s} {'ref ms':>9s}")
    if a.only in (None, "attention"):
        bench_attention(a.quick)
    if a.only in (None, "pointwise"):
        bench_pointwise(a.quick)
    if a.sweep or a.only == "sweep":
        sweep_attention(a.sweep_budget, a.full_sweep)
    if a.only == "decode-sweep":
        sweep_short_decode(a.sweep_budget)
    if a.only == "fp8-decode-sweep":
        sweep_fp8_decode(a.sweep_budget)
    if a.only == "int8-decode":
        int8_decode(a.sweep_budget)
    print(f"done in {time.time() - t0:.0f} s")
    if a.json:
        try:
            from bench.common import write_json
            write_json(a.json, {"ceilings_measured": ceil, "rows": ROWS})
        except ImportError:
            import json
            Path(a.json).write_text(json.dumps({"ceilings_measured": ceil, "rows": ROWS}, indent=2, default=str))


if __name__ == "__main__":
    main()
