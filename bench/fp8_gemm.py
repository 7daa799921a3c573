"""bf16 F.linear against the fp8 path of `--quantization fp8` (engine/quant.py) at Qwen2.5-7B's linear shapes.

  python bench/fp8_gemm.py [--m 1 16 256 512 2048 8192] [--json out.json]
  python3 bench/fp8_gemm.py --sweep [--m 1 2 4 8 16] [--budget 75] [--workers 16]   (small-M GEMV, below)

Shapes (N x K, the fused projections the engine runs): qkv 4608 x 3584 (with Qwen2's bias), o 3584 x 3584,
gate_up 37888 x 3584, down 3584 x 18944; lm_head stays bf16 and is not timed. For each token count M, columns:
  bf16       F.linear(x, W, b), W bf16
  fp8        Fp8Linear, what the engine runs: per-token activation quantization (Triton) + torch._scaled_mm, or
             the fp8-weight GEMV (x unquantized) at the row counts kernels/gemv.py's CONFIGS_FP8 holds
  mm         torch._scaled_mm alone on pre-quantized x (fast accumulation, the engine's setting)
  mm_acc     the same with use_fast_accum=False (exact fp32 accumulation)
  quant      the activation quantizer alone, with the bytes it moves (K*2 read + K write + 4 per row)
Each time is the median of triton.testing.do_bench (the L2 is cleared before every run). TFLOP/s = 2*M*N*K / t;
TB/s = the bytes the GEMM must move at least (x, W, out, once each). The closing table sums the four linears of one
layer: the GEMM time of a decoder layer, bf16 vs fp8, per M, and each as a fraction of this GPU's own square
8192^3 matmul rate in its dtype (measured first). Needs a CUDA device with sm >= 89.

--sweep: the fp8-weight GEMV (kernels/gemv.py, x unquantized) at decode's row counts, timed as bench/gemv.py does
(one CUDA graph of back-to-back launches over enough weight copies that none is found in L2). For each shape and M,
every candidate config is checked against the float32 dequantized reference and timed; the baseline is Fp8Linear's
other path (the activation quantizer + torch._scaled_mm, in the same graph way). Then one decode token's linears at
M=1 (--layer-m) as one graph: 28 layers (qkv+bias, o, gate_up, down on distinct weights) + the bf16 lm_head, for
  bf16 cuBLAS      F.linear everywhere
  bf16 linear()    kernels.gemv.linear with the shipped bf16 CONFIGS (the engine's bf16 decode)
  fp8 _scaled_mm   Fp8Linear with CONFIGS_FP8 empty (quantizer + _scaled_mm), lm_head through linear()
  fp8 GEMV         Fp8Linear with this sweep's CONFIGS_FP8, lm_head through linear()
and prints the CONFIGS_FP8 table to paste into kernels/gemv.py (None: _scaled_mm was faster). ~60-90 s on an H200,
most of it compiling the candidates in a pool of processes (--workers); --budget trims the timing loop.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_json  # noqa: E402
import kernels.gemv as gemv  # noqa: E402
from engine.quant import (Fp8Linear, check_fp8_support, fp8_linear_ref, quantize_weight_fp8,  # noqa: E402
                          scaled_mm_fp8)
from kernels.gemv import MAX_M, GemvConfig, gemv_ref, gemv_triton  # noqa: E402
from kernels.quant_fp8 import per_token_quant_fp8_triton  # noqa: E402

SHAPES = {  # name: (N, K, bias)
    "qkv": (4608, 3584, True),
    "o": (3584, 3584, False),
    "gate_up": (37888, 3584, False),
    "down": (3584, 18944, False),
}


def bench(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3  # seconds


def ceilings() -> dict[str, float]:
    """This GPU's own square-matmul rates (8192^3): bf16 torch.mm and fp8 torch._scaled_mm (row-wise scales)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    bt = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t_bf16 = bench(lambda: a @ bt.t())
    a_q, b_q = a.to(torch.float8_e4m3fn), bt.to(torch.float8_e4m3fn)
    sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    t_fp8 = bench(lambda: torch._scaled_mm(a_q, b_q.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                           use_fast_accum=True))
    del a, bt, a_q, b_q
    return {"bf16_TFLOP_s": 2 * n**3 / t_bf16 / 1e12, "fp8_TFLOP_s": 2 * n**3 / t_fp8 / 1e12}


def run_shape(name: str, n: int, k: int, has_bias: bool, ms: list[int]) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    b = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02 if has_bias else None
    lin = torch.nn.Linear(k, n, bias=has_bias, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
        if has_bias:
            lin.bias.copy_(b)
    f = Fp8Linear.from_linear(lin)
    del lin
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
        x_q, x_s = per_token_quant_fp8_triton(x)
        with torch.inference_mode():
            t_bf16 = bench(lambda: F.linear(x, w, b))
            t_fp8 = bench(lambda: f(x))
            t_mm = bench(lambda: scaled_mm_fp8(x_q, x_s, f.weight, f.weight_scale, f.bias, torch.bfloat16, True))
            t_acc = bench(lambda: scaled_mm_fp8(x_q, x_s, f.weight, f.weight_scale, f.bias, torch.bfloat16, False))
            t_q = bench(lambda: per_token_quant_fp8_triton(x, out=x_q, scale=x_s))
            y = f(x).float()
            exact = F.linear(x.float(), w.float(), None if b is None else b.float())
            ref = fp8_linear_ref(x_q, x_s, f.weight, f.weight_scale, f.bias, torch.float32)
        flops = 2 * m * n * k
        rows.append(dict(
            shape=name, m=m, n=n, k=k,
            bf16_us=t_bf16 * 1e6, fp8_us=t_fp8 * 1e6, mm_us=t_mm * 1e6, mm_acc_us=t_acc * 1e6, quant_us=t_q * 1e6,
            bf16_tflops=flops / t_bf16 / 1e12, fp8_tflops=flops / t_fp8 / 1e12, mm_tflops=flops / t_mm / 1e12,
            bf16_tbs=2 * (m * k + n * k + m * n) / t_bf16 / 1e12,
            fp8_tbs=(m * k + n * k + 2 * m * n) / t_mm / 1e12,
            quant_tbs=(3 * m * k + 4 * m) / t_q / 1e12,
            speedup=t_bf16 / t_fp8,
            rel_err_vs_bf16_inputs=((y - exact).norm() / exact.norm()).item(),  # the quantization's error
            rel_err_vs_ref=((y - ref).norm() / ref.norm()).item(),  # the GEMM's own (accumulation, bf16 out)
        ))
        r = rows[-1]
        print(f"{name:8s} {m:6d} {r['bf16_us']:9.1f} {r['fp8_us']:9.1f} {r['mm_us']:9.1f} {r['mm_acc_us']:9.1f} "
              f"{r['quant_us']:8.1f} | {r['bf16_tflops']:6.0f} {r['mm_tflops']:6.0f} {r['fp8_tflops']:6.0f} | "
              f"{r['bf16_tbs']:5.2f} {r['fp8_tbs']:5.2f} {r['quant_tbs']:5.2f} | {r['speedup']:5.2f}x "
              f"{r['rel_err_vs_bf16_inputs']:7.4f} {r['rel_err_vs_ref']:8.5f}", flush=True)
        del x, x_q, x_s, y, exact, ref
    del w, b, f
    torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------- --sweep
NUM_LAYERS = 28
LM_HEAD = (152064, 3584)
ROTATION_BYTES = 256e6  # bytes of other weight copies read between two uses of one copy (>> the 50 MB L2)


def gemv_candidates(M: int, N: int) -> list[GemvConfig]:
    """fp8 configs for M rows: the bf16 winners' tiles with BLOCK_K doubled (same bytes per slab) and as they were,
    tensor cores from 4 rows on; split-K only where N is small. A short list: it must compile and time in ~60 s."""
    splits = (1, 2, 4) if N <= 8192 else (1,)
    out = []
    if M <= 4:
        fma = [(8, 1024, 4, 1), (8, 1024, 4, 2), (8, 512, 4, 2), (16, 512, 4, 2), (4, 1024, 4, 2)]
        out += [GemvConfig(bn, bk, s, w, st, "fma") for bn, bk, w, st in fma for s in splits]
    if M <= 2:
        late = [(8, 1024, 4, 1), (8, 1024, 4, 2), (8, 512, 4, 2)]
        out += [GemvConfig(bn, bk, s, w, st, "fma_late") for bn, bk, w, st in late for s in splits]
    if M >= 2:
        dot = [(64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 8, 4), (32, 256, 4, 4)]
        out += [GemvConfig(bn, bk, s, w, st, "dot") for bn, bk, w, st in dot for s in splits]
    return out


def fp8_copies(n: int, k: int, has_bias: bool, seed: int) -> list[Fp8Linear]:
    """Fp8Linear modules of one random bf16 weight, enough copies that consecutive launches miss the L2."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=has_bias, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) / k**0.5)
        if has_bias:
            lin.bias.copy_(torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02)
    first = Fp8Linear.from_linear(lin)
    copies = max(2, math.ceil(ROTATION_BYTES / (n * k)) + 1)
    return [first] + [Fp8Linear(first.weight.clone(), first.weight_scale.clone(), first.bias) for _ in
                      range(copies - 1)]


def whole_token(M: int, table: dict) -> dict[str, float]:
    """One decode token's linears at M rows, ms per graph replay, for the four variants of the module docstring."""
    from bench.gemv import graph_ms

    gen = torch.Generator(device="cuda").manual_seed(1000 + M)
    layers = []  # per layer: {name: (bf16 weight, bias, Fp8Linear)}
    with torch.no_grad():
        for _ in range(NUM_LAYERS):
            lw = {}
            for name, (n, k, has_bias) in SHAPES.items():
                w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5
                b = torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02 if has_bias else None
                w_q, s = quantize_weight_fp8(w)
                lw[name] = (w, b, Fp8Linear(w_q, s, b))
                del w_q, s
            layers.append(lw)
    head = torch.randn(*LM_HEAD, device="cuda", generator=gen, dtype=torch.bfloat16) / LM_HEAD[1]**0.5
    xs = {k: torch.randn(M, k, device="cuda", generator=gen, dtype=torch.bfloat16) for k in {k for _, k, _ in
                                                                                            SHAPES.values()}}

    def run(kind: str):
        def go():
            for lw in layers:
                for name, (n, k, _) in SHAPES.items():
                    w, b, f = lw[name]
                    if kind == "bf16 cuBLAS":
                        F.linear(xs[k], w, b)
                    elif kind == "bf16 linear()":
                        gemv.linear(xs[k], w, b)
                    else:
                        f(xs[k])
            (F.linear if kind == "bf16 cuBLAS" else gemv.linear)(xs[LM_HEAD[1]], head)
        return go

    out = {}
    saved = gemv.CONFIGS_FP8
    try:
        with torch.inference_mode():
            for kind in ("bf16 cuBLAS", "bf16 linear()", "fp8 _scaled_mm", "fp8 GEMV"):
                gemv.CONFIGS_FP8 = table if kind == "fp8 GEMV" else {}
                out[kind] = graph_ms(run(kind))
    finally:
        gemv.CONFIGS_FP8 = saved
    del layers, head
    torch.cuda.empty_cache()
    return out


def sweep_main(args) -> int:
    from bench.gemv import close, precompile, table_source, time_rotation

    t0 = time.time()
    ms = sorted(set(args.m))
    if ms[-1] > MAX_M:
        print(f"--m {ms[-1]}: the GEMV takes at most MAX_M={MAX_M} rows", file=sys.stderr)
        return 2
    import triton
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    jobs = [(c, m, k, b) for name in args.shapes for n, k, b in [SHAPES[name]] for m in ms
            for c in gemv_candidates(m, n)]
    precompile(jobs, args.workers, fp8=True)

    rows, table, bad_all = [], {}, []
    items = [(name, m) for name in args.shapes for m in ms]
    reserve = 15.0 * len(args.layer_m)  # seconds kept for the whole-token graphs
    done = 0
    for name in args.shapes:
        n, k, has_bias = SHAPES[name]
        mods = fp8_copies(n, k, has_bias, seed=n + k)
        est_us = n * k / 4e12 * 1e6
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            f0 = mods[0]
            ref = gemv_ref(x, f0.weight, f0.bias, weight_scale=f0.weight_scale)
            with torch.inference_mode():
                saved, gemv.CONFIGS_FP8 = gemv.CONFIGS_FP8, {}
                try:
                    base = time_rotation(lambda i: mods[i](x), len(mods), est_us)  # quantizer + _scaled_mm
                finally:
                    gemv.CONFIGS_FP8 = saved
            left = t0 + args.budget - reserve - time.time()
            deadline = time.time() + max(2.0, left / (len(items) - done))  # an equal share of what is left
            done += 1
            results, cands = [], gemv_candidates(m, n)
            for cfg in cands:
                if time.time() > deadline:
                    break
                try:
                    y.fill_(float("nan"))
                    gemv_triton(x, f0.weight, f0.bias, weight_scale=f0.weight_scale, out=y, config=cfg)
                    if not close(y, ref):
                        bad_all.append(f"{name} M={m} {cfg.short()}: wrong result")
                        continue
                    us = time_rotation(lambda i: gemv_triton(x, mods[i].weight, mods[i].bias,
                                                             weight_scale=mods[i].weight_scale, out=y, config=cfg),
                                       len(mods), est_us)
                    results.append((us, cfg))
                except Exception as e:
                    bad_all.append(f"{name} M={m} {cfg.short()}: {type(e).__name__}: {str(e)[:120]}")
            results.sort(key=lambda r: r[0])
            byts = n * k + 2 * m * (k + n) + (2 * n if has_bias else 0) + 4 * n
            if not results:
                print(f"{name:8s} M={m:2d}: no candidate ran", flush=True)
                table.setdefault((n, k), []).append((m, None))
                continue
            us, cfg = results[0]
            table.setdefault((n, k), []).append((m, cfg if us < base else None))
            rows.append(dict(shape=name, n=n, k=k, m=m, gemv_us=us, scaled_mm_us=base, config=cfg.short(),
                             gemv_TBps=byts / us / 1e6, ran=len(results), of=len(cands),
                             top3=[(u, c.short()) for u, c in results[:3]]))
            print(f"{name:8s} M={m:2d}: GEMV {us:7.2f} us {byts / us / 1e6:5.2f} TB/s  {cfg.short():28s} | quant + "
                  f"_scaled_mm {base:7.2f} us | {base / us:5.2f}x  ({len(results)}/{len(cands)} ran, "
                  f"{time.time() - t0:.0f} s)", flush=True)
        del mods
        torch.cuda.empty_cache()
    table = {key: tuple(v) for key, v in table.items()}
    token = {m: whole_token(m, table) for m in args.layer_m}

    print("\n===== fp8-weight GEMV vs quantizer + _scaled_mm (us per launch, L2-cold) =====")
    for r in rows:
        print(f"{r['shape']:8s} M={r['m']:2d} GEMV {r['gemv_us']:7.2f}  _scaled_mm {r['scaled_mm_us']:7.2f}  "
              f"{r['scaled_mm_us'] / r['gemv_us']:5.2f}x  {r['config']}")
    for m, t in token.items():
        print(f"whole token M={m} ({NUM_LAYERS} layers + bf16 lm_head, one graph): "
              + ", ".join(f"{kind} {v:.3f} ms" for kind, v in t.items()))
    if bad_all:
        print(f"{len(bad_all)} candidate(s) failed or were wrong; first: " + " | ".join(bad_all[:4]))
    print(f"total {time.time() - t0:.0f} s")
    print("\n# kernels/gemv.py CONFIGS_FP8 from this run (None: quantizer + _scaled_mm was faster)")
    source = table_source(table, "CONFIGS_FP8")
    print(source)
    out = Path(args.json) if args.json else (Path(__file__).resolve().parent / "results"
                                             / f"fp8_gemv-{time.strftime('%Y%m%d-%H%M%S')}.json")
    write_json(out, dict(rows=rows, whole_token_ms=token, failed=bad_all, table=source))
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=None,
                   help="token counts (default 1 16 256 512 2048 8192; with --sweep 1 2 4 8 16)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--json", default=None, help="output file (default bench/results/fp8_gemm-<time>.json)")
    p.add_argument("--sweep", action="store_true", help="sweep the fp8-weight GEMV at small M (see above)")
    p.add_argument("--budget", type=float, default=75.0, help="--sweep: seconds for the whole run (trims timing)")
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="--sweep: compile processes")
    p.add_argument("--layer-m", type=int, nargs="*", default=[1], help="--sweep: rows for the whole-token graphs")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/fp8_gemm.py needs a CUDA device", file=sys.stderr)
        return 2
    check_fp8_support(torch.device("cuda"), torch.bfloat16)
    if args.sweep:
        args.m = args.m or [1, 2, 4, 8, 16]
        return sweep_main(args)
    args.m = args.m or [1, 16, 256, 512, 2048, 8192]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  cuda {torch.version.cuda}")
    ceil = ceilings()
    print(f"square 8192^3 matmul on this GPU: bf16 {ceil['bf16_TFLOP_s']:.0f} TFLOP/s, "
          f"fp8 row-wise {ceil['fp8_TFLOP_s']:.0f} TFLOP/s")
    print(f"{'shape':8s} {'M':>6s} {'bf16 us':>9s} {'fp8 us':>9s} {'mm us':>9s} {'mm_acc':>9s} {'quant':>8s} | "
          f"{'TFLOP/s bf16':>12s} {'mm':>6s} {'fp8':>6s} | {'TB/s bf16':>9s} {'mm':>5s} {'qnt':>5s} | "
          f"{'speed':>6s} {'err':>7s} {'gemm err':>8s}")
    rows = []
    for name in args.shapes:
        n, k, bias = SHAPES[name]
        rows += run_shape(name, n, k, bias, args.m)

    print("\none decoder layer's linears (the shapes above summed), bf16 vs fp8 (quantizer included):")
    print(f"{'M':>6s} {'bf16 us':>9s} {'fp8 us':>9s} {'quant us':>9s} {'speedup':>8s} {'bf16 % of mm':>13s} "
          f"{'fp8 % of mm':>12s}")
    for m in args.m:
        sel = [r for r in rows if r["m"] == m]
        bf, f8, q = (sum(r[key] for r in sel) for key in ("bf16_us", "fp8_us", "quant_us"))
        flops = sum(2 * r["m"] * r["n"] * r["k"] for r in sel)
        print(f"{m:6d} {bf:9.1f} {f8:9.1f} {q:9.1f} {bf / f8:7.2f}x "
              f"{100 * flops / (bf * 1e-6) / (ceil['bf16_TFLOP_s'] * 1e12):12.1f}% "
              f"{100 * flops / (f8 * 1e-6) / (ceil['fp8_TFLOP_s'] * 1e12):11.1f}%")
    out = Path(args.json) if args.json else (Path(__file__).resolve().parent / "results"
                                             / f"fp8_gemm-{time.strftime('%Y%m%d-%H%M%S')}.json")
    write_json(out, dict(ceilings=ceil, rows=rows))  # with the run's machine, commit and date under "meta"
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
