"""The fastest any engine could run an offline batch (bench/throughput.py's workload) on one GPU: a floor from the
model's FLOPs and bytes and the GPU's measured matmul peak and copy bandwidth, no engine involved.

  python bench/floor.py --model random:qwen2.5-7b --num-prompts 500 --input-len 512 --output-len 256
  python bench/floor.py --model random:qwen2.5-7b --weight-bytes 1 --kv-bytes 1        # fp8 weights and KV cache

Every prompt token goes through every linear once (prefill) and every output token but the first once more
(decode); the first output token comes with its prompt's last prefill row (lm_head runs on that row only).
Attention adds its dot products (causal over the prompt in prefill; over the whole context per decoded token) and,
in decode, reading every earlier token's K and V once per decoded token. A decode step's linears take
max(FLOPs / peak, weight bytes / bandwidth): at --max-num-seqs sequences a step they are compute-bound on an H200
(500 x 14.2 GFLOP = 9.1 ms against 3.6 ms of bf16 weights). The floor adds the parts (they are separate kernels; an
engine that overlapped attention with the GEMMs could beat the sum, none here does) and assumes 100% of peak for each:
what an engine reaches is the floor divided by its efficiency. The defaults are the H200's measured 781 TFLOP/s bf16
matmul and 4.26 TB/s copy bandwidth (docs/kernels.md, /work/.library device notes).
"""
from __future__ import annotations

import argparse
from pathlib import Path
import sys

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.loader import resolve_model  # noqa: E402

# The H200's measured rates (docs/kernels.md): bf16 matmul 682-781 TFLOP/s depending on the run, fp8
# torch._scaled_mm 1,272 TFLOP/s at 8192^3, device-to-device copy 4.26 TB/s.
BF16_PEAK_TFLOPS = 781.0
FP8_PEAK_TFLOPS = 1272.0
BANDWIDTH_TBS = 4.26


def workload_floor(config, num_prompts: int, input_len: int, output_len: int, max_num_seqs: int, peak_flops: float,
                   bandwidth: float, weight_bytes: float = 2, kv_bytes: float = 2,
                   attn_peak_flops: float | None = None) -> dict[str, float]:
    """Seconds of each part at 100% of peak and bandwidth (weight_bytes, kv_bytes: bytes per value). peak_flops is
    the linears' matmul rate (fp8 weights: the fp8 rate); attention's dot products run at attn_peak_flops (default
    the same: the attention kernels take bf16 queries, so with fp8 weights pass the bf16 rate)."""
    attn_peak = attn_peak_flops or peak_flops
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or h // heads
    linear = layers * (h * heads * hd + 2 * h * kv_heads * hd + heads * hd * h + 3 * h * inter)  # params
    head = h * config.vocab_size  # lm_head
    n, li, lo = num_prompts, input_len, output_len
    decoded = n * (lo - 1)  # decode forward rows
    # Sum over decoded tokens of the context they attend to: positions li+1 .. li+lo-1 per prompt.
    ctx = n * sum(li + j for j in range(1, lo))
    prefill_gemm = (n * li * 2 * linear + n * 2 * head) / peak_flops
    prefill_attn = n * layers * 2 * heads * hd * li * li / attn_peak  # QK^T and PV, causal: 2 x (2 x L^2 / 2)
    decode_flops = decoded * 2 * (linear + head)
    steps = -(-decoded // min(max_num_seqs, n))
    decode_gemm = max(decode_flops / peak_flops, steps * (linear + head) * weight_bytes / bandwidth)
    kv_per_token = layers * 2 * kv_heads * hd * kv_bytes
    decode_attn = max(ctx * kv_per_token / bandwidth, ctx * layers * 4 * heads * hd / attn_peak)
    total = prefill_gemm + prefill_attn + decode_gemm + decode_attn
    return dict(prefill_gemm_s=prefill_gemm, prefill_attention_s=prefill_attn, decode_gemm_s=decode_gemm,
                decode_attention_s=decode_attn, total_s=total, output_tokens_per_s=n * lo / total,
                decode_steps=steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:qwen2.5-7b")
    p.add_argument("--num-prompts", type=int, default=500)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=512, help="sequences a decode step may batch")
    p.add_argument("--peak-tflops", type=float, default=BF16_PEAK_TFLOPS, help="measured dense matmul TFLOP/s")
    p.add_argument("--bandwidth-tbs", type=float, default=BANDWIDTH_TBS, help="measured copy bandwidth, TB/s")
    p.add_argument("--weight-bytes", type=float, default=2, help="bytes per weight (2: bf16, 1: fp8)")
    p.add_argument("--kv-bytes", type=float, default=2, help="bytes per KV cache value (2: bf16, 1: fp8)")
    p.add_argument("--fp8-peak-tflops", type=float, default=FP8_PEAK_TFLOPS,
                   help="matmul peak for fp8 weights (default: torch._scaled_mm measured on the H200 at 8192^3)")
    p.add_argument("--efficiency", type=float, nargs="+", default=[1.0, 0.9, 0.8],
                   help="fractions of the floor's rate to print")
    args = p.parse_args(argv)
    config = resolve_model(args.model).config
    peak = args.peak_tflops * 1e12
    if args.weight_bytes < 2:
        peak = args.fp8_peak_tflops * 1e12
    f = workload_floor(config, args.num_prompts, args.input_len, args.output_len, args.max_num_seqs, peak,
                       args.bandwidth_tbs * 1e12, args.weight_bytes, args.kv_bytes,
                       attn_peak_flops=args.peak_tflops * 1e12)
    print(f"{args.model}: {args.num_prompts} x ({args.input_len} in, {args.output_len} out), "
          f"{peak / 1e12:.0f} TFLOP/s, {args.bandwidth_tbs} TB/s, weights {args.weight_bytes:g} B, "
          f"KV {args.kv_bytes:g} B per value")
    for k in ("prefill_gemm_s", "prefill_attention_s", "decode_gemm_s", "decode_attention_s", "total_s"):
        print(f"  {k:22s} {f[k]:7.3f} s")
    print(f"  decode steps           {f['decode_steps']:7d}")
    for e in args.efficiency:
        print(f"  at {e:4.0%} of the floor's rate: {e * f['output_tokens_per_s']:9,.0f} output tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
