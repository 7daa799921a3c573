"""TensorRT-LLM's published H200 workloads, run through Tandem's offline engine, next to TensorRT-LLM's figures and
the floor (bench/floor.py).

  python bench/trtllm.py                                    # all four workloads, fp8 weights, fp8 and bf16 KV
  python bench/trtllm.py --kv-cache-dtype fp8 --workloads 128x128 2048x128
  python bench/trtllm.py --model random:tiny --num-prompts 8 --scale 0.05     # a smoke run on the CPU

TensorRT-LLM's performance overview (trtllm-bench, Llama-3.1-8B FP8, one H200) lists output tokens/s for
input/output lengths 128/128, 1000/1000, 2048/128 and 500/2000. `random:llama-3-8b` has that model's exact shape
(speed does not depend on the weights' values). One engine is built per KV-cache dtype and runs every workload in
turn (building it costs more than a short workload): each workload is warmed up, then timed from the first prompt
to the last token, as bench/throughput.py times it. One JSON row per (workload, KV dtype) goes to bench/results/,
with bench/throughput.py's fields plus `kv_cache_dtype`, `floor_output_tokens_per_s`, `percent_of_floor` and
`trtllm_output_tokens_per_s`.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import git_commit, machine_info, write_json  # noqa: E402
from bench.floor import BANDWIDTH_TBS, BF16_PEAK_TFLOPS, FP8_PEAK_TFLOPS, workload_floor  # noqa: E402
from bench.throughput import make_prompts, print_step_breakdown, sync  # noqa: E402

# TensorRT-LLM's performance overview, Llama-3.1-8B FP8 on one H200, output tokens/s (trtllm-bench).
TRTLLM_H200 = {(128, 128): 28_447, (1000, 1000): 17_591, (2048, 128): 3_531, (500, 2000): 21_463}
# Prompts per workload: enough that steady state dominates the timed run (short workloads get more).
DEFAULT_PROMPTS = {(128, 128): 4000, (1000, 1000): 1000, (2048, 128): 1000, (500, 2000): 1000}


def parse_workload(text: str) -> tuple[int, int]:
    try:
        i, o = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a workload is INPUTxOUTPUT, e.g. 128x128, not {text!r}") from None
    if i < 1 or o < 1:
        raise argparse.ArgumentTypeError(f"input and output lengths must be >= 1, not {text!r}")
    return i, o


def run(args) -> list[dict]:
    from engine import LLM, SamplingParams
    from engine.loader import resolve_model

    config = resolve_model(args.model).config
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    max_len = max(i + o for i, o in args.workloads) + 16
    rows = []
    for kv in args.kv_cache_dtype:
        t_build = time.perf_counter()
        llm = LLM(args.model, dtype=args.dtype, max_model_len=max_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_dtype=kv,
                  quantization=args.quantization, enable_prefix_caching=False, seed=0,
                  gpu_memory_utilization=args.gpu_memory_utilization)
        runner = llm.engine.runner
        print(f"engine (kv {kv}) built in {time.perf_counter() - t_build:.1f} s; KV cache "
              f"{runner.num_blocks * runner.block_size:,} tokens", flush=True)
        for input_len, output_len in args.workloads:
            n = args.num_prompts or max(1, int(DEFAULT_PROMPTS.get((input_len, output_len), 1000) * args.scale))
            prompts = make_prompts(n, input_len, config.vocab_size, seed=input_len * 7919 + output_len)
            warm = max(1, min(n, args.max_num_batched_tokens // input_len + 1))
            llm.generate(prompt_token_ids=prompts[:warm],
                         sampling_params=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            sync()
            llm.engine.step_log = []
            t0 = time.perf_counter()
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
                temperature=0.0, max_tokens=output_len, ignore_eos=True))
            sync()
            elapsed = time.perf_counter() - t0
            print(f"{input_len}/{output_len} x {n}, kv {kv}:", flush=True)
            print_step_breakdown(llm.engine.step_log, elapsed)
            llm.engine.step_log = None
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            peak = (FP8_PEAK_TFLOPS if args.quantization == "fp8" else BF16_PEAK_TFLOPS) * 1e12
            floor = workload_floor(config, n, input_len, output_len, args.max_num_seqs, peak, BANDWIDTH_TBS * 1e12,
                                   weight_bytes=1 if args.quantization == "fp8" else 2,
                                   kv_bytes=1 if kv == "fp8" else 2, attn_peak_flops=BF16_PEAK_TFLOPS * 1e12)
            rec = dict(backend="tandem", gpu=gpu, model=args.model, quantization=args.quantization,
                       kv_cache_dtype=kv, tensor_parallel_size=1, num_prompts=n, input_len=input_len,
                       output_len=output_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, elapsed_s=round(elapsed, 3),
                       output_tokens_per_s=round(n_out / elapsed, 1),
                       total_tokens_per_s=round((n_out + n * input_len) / elapsed, 1),
                       floor_output_tokens_per_s=round(floor["output_tokens_per_s"], 1),
                       percent_of_floor=round(100 * n_out / elapsed / floor["output_tokens_per_s"], 1),
                       trtllm_output_tokens_per_s=TRTLLM_H200.get((input_len, output_len)),
                       commit=git_commit()["sha"], date=time.strftime("%Y-%m-%d"), machine=machine_info())
            write_json(Path(args.out_dir) / f"trtllm-{input_len}x{output_len}-{kv}-{time.strftime('%Y%m%d-%H%M%S')}"
                       ".json", rec)
            rows.append(rec)
            print(f"  {rec['output_tokens_per_s']:,.0f} out tok/s ({rec['percent_of_floor']:.0f}% of the floor)",
                  flush=True)
        llm.close()
        del llm
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'workload':>10s} {'kv':>5s} {'prompts':>7s} {'tandem tok/s':>12s} {'TRT-LLM':>8s} {'ratio':>6s} "
          f"{'floor':>8s} {'% floor':>7s}")
    for r in rows:
        trt = r["trtllm_output_tokens_per_s"]
        ratio = f"{r['output_tokens_per_s'] / trt:5.2f}x" if trt else "    -"
        print(f"{r['input_len']:>5d}/{r['output_len']:<4d} {r['kv_cache_dtype']:>5s} {r['num_prompts']:7d} "
              f"{r['output_tokens_per_s']:12,.0f} {trt or 0:8,d} {ratio:>6s} {r['floor_output_tokens_per_s']:8,.0f} "
              f"{r['percent_of_floor']:6.0f}%")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-3-8b")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="fp8", choices=["fp8", "none"])
    p.add_argument("--kv-cache-dtype", nargs="+", default=["fp8", "auto"], choices=["fp8", "auto"])
    p.add_argument("--workloads", nargs="+", type=parse_workload, default=list(TRTLLM_H200),
                   metavar="INxOUT", help="default: TensorRT-LLM's four (128x128 1000x1000 2048x128 500x2000)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts per workload (default: 4000 for 128x128, 1000 for the others)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the default prompt counts")
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--rows-to-stdout", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quantization == "none":
        args.quantization = None
    if len(args.kv_cache_dtype) > 1:
        # One process per KV dtype: a closed engine does not give all of its GPU memory back, and the next one sizes
        # its KV cache from what is free (it found none).
        rows = []
        for kv in args.kv_cache_dtype:
            child = [sys.executable, __file__, *[a for a in (argv if argv is not None else sys.argv[1:])],
                     "--kv-cache-dtype", kv, "--rows-to-stdout"]
            lines = subprocess.run(child, stdout=subprocess.PIPE, text=True, check=True).stdout.strip().splitlines()
            print("\n".join(lines[:-1]), flush=True)
            rows += json.loads(lines[-1])
    else:
        rows = run(args)
    if args.rows_to_stdout:
        print(json.dumps(rows))
        return 0
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
