"""bf16 F.linear against the fp8 path of `--quantization fp8` (engine/quant.py) at Qwen2.5-7B's linear shapes.

  python bench/fp8_gemm.py [--m 1 16 256 512 2048 8192] [--json out.json]

Shapes (N x K, the fused projections the engine runs): qkv 4608 x 3584 (with Qwen2's bias), o 3584 x 3584,
gate_up 37888 x 3584, down 3584 x 18944; lm_head stays bf16 and is not timed. For each token count M, columns:
  bf16       F.linear(x, W, b), W bf16
  fp8        Fp8Linear: per-token activation quantization (Triton) + torch._scaled_mm, what the engine runs
  mm         torch._scaled_mm alone on pre-quantized x (fast accumulation, the engine's setting)
  mm_acc     the same with use_fast_accum=False (exact fp32 accumulation)
  quant      the activation quantizer alone, with the bytes it moves (K*2 read + K write + 4 per row)
Each time is the median of triton.testing.do_bench (the L2 is cleared before every run). TFLOP/s = 2*M*N*K / t;
TB/s = the bytes the GEMM must move at least (x, W, out, once each). The closing table sums the four linears of one
layer: the GEMM time of a decoder layer, bf16 vs fp8, per M, and each as a fraction of this GPU's own square
8192^3 matmul rate in its dtype (measured first). Needs a CUDA device with sm >= 89.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_json  # noqa: E402
from engine.quant import Fp8Linear, check_fp8_support, fp8_linear_ref, scaled_mm_fp8  # noqa: E402
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 256, 512, 2048, 8192], help="token counts")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--json", default=None, help="output file (default bench/results/fp8_gemm-<time>.json)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/fp8_gemm.py needs a CUDA device", file=sys.stderr)
        return 2
    check_fp8_support(torch.device("cuda"), torch.bfloat16)
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
