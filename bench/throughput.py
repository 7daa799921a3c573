"""Offline throughput, vLLM's benchmark_throughput arguments: random-token prompts, fixed input and output lengths.

  python bench/throughput.py --model random:qwen2.5-7b --dtype bfloat16 --num-prompts 500 --input-len 512 \
      --output-len 256 --backend tandem hf

Each backend runs the same prompts in the same invocation; one JSON file per backend run goes to bench/results/.
`--stream` (or vLLM's `--async-engine`): the tandem backend hands each request's tokens out step by step as the
services stream them (instead of collecting every output at the end), and adds the mean time to first token and
time per output token to the table and the JSON.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import git_commit, machine_info, write_json  # noqa: E402
from engine.config import (DTYPE_ALIASES, KV_CACHE_DTYPES, PREEMPTION_MODES, QUANTIZATION_METHODS,  # noqa: E402
                           _DTYPES, parse_dtype)


def make_prompts(num: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (num, input_len), generator=g).tolist()


def run_tandem(args, prompts) -> tuple[float, int, dict]:
    from engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.input_len + args.output_len + 16,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization, enable_prefix_caching=False,
              seed=args.seed, async_scheduling=args.async_scheduling,
              tensor_parallel_size=args.tensor_parallel_size, swap_space=args.swap_space,
              preemption_mode=args.preemption_mode, num_gpu_blocks_override=args.num_gpu_blocks_override,
              **({} if args.new_token_ratio is None else {"new_token_ratio": args.new_token_ratio}))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    # Warm-up with full-size prefill steps: Triton compiles one kernel per launch configuration.
    warm = max(1, min(len(prompts), args.max_num_batched_tokens // args.input_len + 1))
    llm.generate(prompt_token_ids=prompts[:warm], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True))
    sync()
    llm.engine.step_log = []
    t0 = time.perf_counter()
    if args.stream:
        n_out, latency = stream_requests(llm.engine, prompts, params, t0)
    else:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        n_out, latency = sum(len(o.outputs[0].token_ids) for o in outs), {}
    sync()
    elapsed = time.perf_counter() - t0
    print_step_breakdown(llm.engine.step_log, elapsed)
    steps = step_stats(llm.engine.step_log, len(prompts) * args.input_len)
    stats = llm.engine.stats()
    steps.update(num_preemptions=stats.num_preemptions, num_swaps=stats.num_swaps,
                 swapped_out_blocks=stats.swapped_out_blocks, swapped_in_blocks=stats.swapped_in_blocks,
                 num_gpu_blocks=stats.num_total_blocks)
    llm.close()
    del llm
    return elapsed, n_out, {**latency, **steps}


def stream_requests(engine, prompts, params, t0: float) -> tuple[int, dict]:
    """Every request added at t0, then each step's new tokens handed out per request as they come (what the
    services stream): output tokens, and the mean time to first token and per output token after it, in ms."""
    first, last, count = {}, {}, {}
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{i}", p, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids:
                now = time.perf_counter()
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                count[out.request_id] = count.get(out.request_id, 0) + len(out.new_token_ids)
    ttft = [first[r] - t0 for r in first]
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in first if count[r] > 1]
    return sum(count.values()), {"mean_ttft_ms": round(1e3 * sum(ttft) / max(1, len(ttft)), 2),
                                 "mean_tpot_ms": round(1e3 * sum(tpot) / max(1, len(tpot)), 2)}


def step_stats(steps, prompt_tokens: int) -> dict:
    """What `tandem plan --from-bench` reads (engine/capacity.py): the mean time of a pure decode step (each advances
    every running request by one token: the requests' TPOT), the mean decode batch, and the prompt tokens per
    second of the steps that carried prompt tokens (mixed steps' decode tokens are a small share of them)."""
    pre = [s for s in steps if s.num_batched_tokens > s.num_seqs]
    dec = [s for s in steps if s.num_batched_tokens == s.num_seqs]
    out = {}
    if dec:
        out["tpot_ms_mean"] = round(1e3 * sum(s.step_seconds for s in dec) / len(dec), 4)
        out["mean_decode_batch"] = round(sum(s.num_seqs for s in dec) / len(dec), 2)
    if pre:
        out["prefill_tokens_per_s"] = round(prompt_tokens / sum(s.step_seconds for s in pre), 1)
    return out


def print_step_breakdown(steps, elapsed: float) -> None:
    """Where the time went: steps that carried prefill tokens vs pure decode steps (each step ends in a host sync
    for the sampled ids, so step wall time is real GPU + host time)."""
    pre = [s for s in steps if s.num_batched_tokens > s.num_seqs]
    dec = [s for s in steps if s.num_batched_tokens == s.num_seqs]
    for name, group in (("prefill/mixed", pre), ("decode", dec)):
        if not group:
            continue
        t = sum(s.step_seconds for s in group)
        toks = sum(s.num_batched_tokens for s in group)
        print(f"  {name:14s} {len(group):5d} steps {t:7.2f} s  {1e3 * t / len(group):7.2f} ms/step  "
              f"{toks / t:10.0f} tok/s  mean batch {sum(s.num_seqs for s in group) / len(group):6.1f}")
    print(f"  outside steps  {elapsed - sum(s.step_seconds for s in steps):7.2f} s")
    print("  first prefill steps (tokens, seqs, ms):",
          ", ".join(f"({s.num_batched_tokens}, {s.num_seqs}, {1e3 * s.step_seconds:.0f})" for s in pre[:8]))


def run_hf(args, prompts) -> tuple[float, int, dict]:
    from transformers import AutoModelForCausalLM

    from engine.loader import load_weights, resolve_model

    resolved = resolve_model(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = parse_dtype(args.dtype) if args.dtype != "auto" else (torch.bfloat16 if device == "cuda" else torch.float32)
    if resolved.weights_dir is not None:
        model = AutoModelForCausalLM.from_pretrained(resolved.weights_dir, dtype=dtype).to(device)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(resolved.config, dtype=dtype)
        load_weights(model, resolved)
    model.eval()
    model.generation_config.eos_token_id = None
    n_out = 0
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), args.hf_batch_size):
            batch = torch.tensor(prompts[i:i + args.hf_batch_size], device=device)
            out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=args.output_len,
                                 do_sample=False, pad_token_id=0)
            n_out += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    sync()
    elapsed = time.perf_counter() - t0
    del model
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return elapsed, n_out, {}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto", choices=("auto", *_DTYPES, *DTYPE_ALIASES))
    p.add_argument("--num-prompts", type=int, default=500)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", nargs="+", default=["tandem"], choices=["tandem", "hf"])
    p.add_argument("--max-num-seqs", type=int, default=512,
                   help="512 (default): all 500 prompts of the issue's workload in one batch; 12.7k vs 10.9k output "
                        "tok/s at 256 on the H200 (bench/RESULTS.md). vLLM's offline default on such GPUs is 1024")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS,
                   help="the engine's online weight quantization (engine/quant.py); transformers runs unquantized")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine's async scheduling (default: the engine's, on for CUDA)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="the engine's ranks (cuda:0, cuda:1, ...)")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="the engine's KV blocks (vLLM's flag): a small pool makes a workload preempt")
    p.add_argument("--swap-space", type=float, default=0.0,
                   help="GiB of host KV tier (vLLM's flag): preempted requests swap there instead of recomputing")
    p.add_argument("--preemption-mode", default="auto", choices=PREEMPTION_MODES,
                   help="with --swap-space: swap, recompute, or auto (the engine's choice per request)")
    p.add_argument("--new-token-ratio", type=float, default=None,
                   help="the admission watermark (engine default 0.7); 0 admits whenever a prompt fits, so a small "
                        "--num-gpu-blocks-override preempts often")
    p.add_argument("--hf-batch-size", type=int, default=256)
    p.add_argument("--stream", "--async-engine", action="store_true",
                   help="tandem: hand tokens out per step, as served, and report TTFT and TPOT (module docstring)")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    from engine.loader import resolve_model
    vocab = resolve_model(args.model).config.vocab_size
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    rows = []
    # transformers first: it frees its memory on return, while our engine sizes its KV cache from what is free.
    for backend in sorted(args.backend, key=lambda b: b != "hf"):
        try:
            elapsed, n_out, latency = (run_tandem if backend == "tandem" else run_hf)(args, prompts)
        except ValueError as e:  # what only loading tells: --quantization against the checkpoint's format, ...
            print(f"throughput: {backend}: {e}", file=sys.stderr)
            return 1
        total = n_out + args.num_prompts * args.input_len
        rec = dict(backend=backend, gpu=gpu, model=args.model,
                   quantization=args.quantization if backend == "tandem" else None,
                   tensor_parallel_size=args.tensor_parallel_size if backend == "tandem" else 1,
                   num_prompts=args.num_prompts,
                   input_len=args.input_len, output_len=args.output_len, elapsed_s=round(elapsed, 3),
                   output_tokens_per_s=round(n_out / elapsed, 1), total_tokens_per_s=round(total / elapsed, 1),
                   stream=args.stream if backend == "tandem" else False,
                   kv_cache_dtype=args.kv_cache_dtype if backend == "tandem" else None,
                   swap_space=args.swap_space if backend == "tandem" else None,
                   preemption_mode=args.preemption_mode if backend == "tandem" and args.swap_space else None,
                   **latency,
                   commit=git_commit()["sha"], date=time.strftime("%Y-%m-%d"), machine=machine_info())
        write_json(Path(args.out_dir) / f"throughput-{backend}-{time.strftime('%Y%m%d-%H%M%S')}.json", rec)
        rows.append(rec)
        print(f"{backend:7s} {elapsed:8.2f} s  {rec['output_tokens_per_s']:10.1f} out tok/s  "
              f"{rec['total_tokens_per_s']:10.1f} total tok/s"
              + "".join(f"  {k} {v}" for k, v in latency.items()), flush=True)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if len(rows) == 2:
        by = {r["backend"]: r["output_tokens_per_s"] for r in rows}
        print(f"tandem / hf = {by['tandem'] / by['hf']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
