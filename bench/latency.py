"""Single-request latency: TTFT for one prompt and batch-1 decode speed, next to the bandwidth roofline.

  python bench/latency.py --model random:qwen2.5-7b --dtype bfloat16 --input-len 512 --output-len 256
  python bench/latency.py --model random:qwen2.5-7b --dtype bfloat16 --quantization awq   # 4-bit weights

The roofline is weight bytes / measured copy bandwidth (4.26 TB/s on the H200): a batch-1 decode step must read
every weight once. --quantization awq / gptq / compressed-tensors on a random: model rounds its random linears to
that format's 4-bit layout (engine/quant_w4.py random_w4_linears: groups of 128, zero points for awq), so a 4-bit
model's decode runs without a checkpoint.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import git_commit, write_json  # noqa: E402
from engine.config import QUANTIZATION_METHODS, ModelConfig, SchedulerConfig  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--bandwidth", type=float, default=4.26e12, help="bytes/s for the roofline")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS,
                   help="fp8: weights quantized at load (as vLLM's flag); a 4-bit format: the checkpoint's (e.g. "
                   "bench/w4_checkpoint.py's), or a random: model rounded to it")
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs,
                   help="the engine's (fewer: fewer decode CUDA graphs to capture; batch 1 needs 1)")
    p.add_argument("--max-prefill-cudagraph-tokens", type=int, default=ModelConfig.max_prefill_cudagraph_tokens,
                   help="the engine's (0: prompts run eagerly, no prefill graphs to capture; TTFT then eager)")
    p.add_argument("--w4-table", default=None,
                   help="4-bit weights: one-row GEMV configs from `bench/w4a16_gemm.py --table-out` (a sweep's "
                   "best), set in kernels/w4a16.py GEMV_TABLE before the model loads")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine's async scheduling (default: the engine's, on for CUDA)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks the model is split across (cuda:0..; the roofline is then one rank's weight bytes)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from engine import LLM, SamplingParams

    if args.w4_table:
        from bench.w4a16_gemm import apply_table
        apply_table(args.w4_table)

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.input_len + args.output_len + 16,
              enable_prefix_caching=False, enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
              tensor_parallel_size=args.tensor_parallel_size, max_num_seqs=args.max_num_seqs,
              max_prefill_cudagraph_tokens=args.max_prefill_cudagraph_tokens)
    vocab = llm.engine.runner.hf_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, vocab - 10, (args.input_len,), generator=g).tolist()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def timed(max_tokens: int) -> float:
        sync()
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=[prompt],
                     sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        sync()
        return time.perf_counter() - t0

    timed(1), timed(8)  # warm-up
    ttft = statistics.median(timed(1) for _ in range(args.num_iters))
    full = statistics.median(timed(args.output_len + 1) for _ in range(max(2, args.num_iters // 2)))
    decode_tps = args.output_len / (full - ttft)
    # Rank 0's shard (with tensor parallelism every rank reads its own shard at once; embeddings and lm_head whole)
    weight_bytes = sum(t.numel() * t.element_size() for t in llm.engine.runner.model.parameters())
    roofline = args.bandwidth / weight_bytes
    print(f"model {args.model} dtype {llm.engine.runner.dtype} quantization {args.quantization} "
          f"w4 table {args.w4_table} "
          f"kv cache {args.kv_cache_dtype} device {llm.engine.runner.device} "
          f"tensor_parallel_size {args.tensor_parallel_size}")
    print(f"TTFT ({args.input_len}-token prompt)  {ttft * 1e3:8.2f} ms")
    print(f"batch-1 decode              {decode_tps:8.1f} tok/s   ({1e3 / decode_tps:.2f} ms/token)")
    print(f"roofline (weights {weight_bytes / 1e9:.2f} GB / {args.bandwidth / 1e12:.2f} TB/s) "
          f"{roofline:8.1f} tok/s   -> {decode_tps / roofline:.0%}")
    if args.json:
        write_json(args.json, dict(model=args.model, input_len=args.input_len, output_len=args.output_len,
                                   quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                                   tensor_parallel_size=args.tensor_parallel_size, dtype=str(llm.engine.runner.dtype),
                                   weight_bytes=weight_bytes, ttft_ms=ttft * 1e3, ms_per_token=1e3 / decode_tps,
                                   decode_tokens_per_s=decode_tps, roofline_tokens_per_s=roofline,
                                   commit=git_commit()["sha"], date=time.strftime("%Y-%m-%d")))
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
