"""TTFT of a long shared prefix served from the host KV tier (--swap-space) against recomputing it.

  python bench/host_tier.py --model random:qwen2.5-7b --dtype bfloat16 --prefix-len 8192 --swap-space 8

One engine with prefix caching and a host tier, a device pool of --num-gpu-blocks blocks. A prompt is the prefix
plus a short suffix that differs per request; each measure is the wall time of one request with max_tokens=1
(offline TTFT), the median of --num-iters:
  cold       the prefix computed (nothing cached),
  gpu hit    the prefix's blocks still in the device prefix cache,
  host hit   the prefix evicted from the device by filler prompts, kept on the host and copied back,
  recompute  the same eviction with no host tier (a second engine, --swap-space 0): what the tier saves.
The host-hit request's tokens are checked against the recompute engine's for the same prompt (greedy, 8 tokens),
and the engine's host_prefix_hits counter must grow by the prefix's full blocks.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import git_commit, machine_info, write_json  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:tiny")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prefix-len", type=int, default=8192)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--swap-space", type=float, default=8.0, help="GiB of host tier")
    p.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="the device pool (default: 2.5 prompts' worth)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from engine import LLM, SamplingParams

    block = 16
    prefix_blocks = args.prefix_len // block
    prompt_blocks = -(-(args.prefix_len + args.suffix_len + 8) // block)
    gpu_blocks = args.num_gpu_blocks or int(2.5 * prompt_blocks)
    g = torch.Generator().manual_seed(0)

    def engine(swap_space: float) -> LLM:
        return LLM(args.model, dtype=args.dtype, max_model_len=args.prefix_len + args.suffix_len + 16,
                   enable_prefix_caching=True, swap_space=swap_space, num_gpu_blocks_override=gpu_blocks,
                   max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_dtype=args.kv_cache_dtype)

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    greedy1 = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    greedy8 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def tokens(n: int, vocab: int) -> list[int]:
        return torch.randint(10, vocab - 10, (n,), generator=g).tolist()

    def timed(llm: LLM, prompt: list[int], params=greedy1) -> tuple[float, list[int]]:
        sync()
        t0 = time.perf_counter()
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
        sync()
        return time.perf_counter() - t0, list(out[0].outputs[0].token_ids)

    def evict(llm: LLM, vocab: int) -> None:
        # Filler prompts of the prefix's size, more blocks in all than the pool holds: every block of the prefix
        # (least recently used) is evicted from the device.
        for _ in range(gpu_blocks // prompt_blocks + 1):
            timed(llm, tokens(args.prefix_len + args.suffix_len, vocab))

    results: dict[str, list[float]] = {"cold": [], "gpu_hit": [], "host_hit": [], "recompute": []}
    checks: list[tuple[list[int], list[int]]] = []  # (prompt, host-hit tokens)

    llm = engine(args.swap_space)
    vocab = llm.engine.runner.hf_config.vocab_size
    timed(llm, tokens(args.prefix_len + args.suffix_len, vocab))  # warm-up: compiles the long prompt steps
    hits_per_iter = []
    for _ in range(args.num_iters):
        prefix = tokens(args.prefix_len, vocab)
        results["cold"].append(timed(llm, prefix + tokens(args.suffix_len, vocab))[0])
        results["gpu_hit"].append(timed(llm, prefix + tokens(args.suffix_len, vocab))[0])
        evict(llm, vocab)
        before = llm.engine.stats().host_prefix_hits
        prompt = prefix + tokens(args.suffix_len, vocab)
        t, _ = timed(llm, prompt)
        results["host_hit"].append(t)
        hits_per_iter.append(llm.engine.stats().host_prefix_hits - before)
        checks.append((prompt, timed(llm, prompt, greedy8)[1]))  # a device hit now: the same KV
    stats = llm.engine.stats()
    llm.close()
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    llm = engine(0.0)
    timed(llm, tokens(args.prefix_len + args.suffix_len, vocab))
    for _ in range(args.num_iters):
        prefix = tokens(args.prefix_len, vocab)
        timed(llm, prefix + tokens(args.suffix_len, vocab))
        evict(llm, vocab)
        results["recompute"].append(timed(llm, prefix + tokens(args.suffix_len, vocab))[0])
    mismatches = sum(timed(llm, prompt, greedy8)[1] != got for prompt, got in checks)
    llm.close()

    med = {k: round(1e3 * statistics.median(v), 2) for k, v in results.items()}
    expected = prefix_blocks * block
    print(f"model {args.model} prefix {args.prefix_len} tokens, device pool {gpu_blocks} blocks, host tier "
          f"{args.swap_space} GiB; median of {args.num_iters}")
    for k, v in med.items():
        print(f"  {k:10s} TTFT {v:9.2f} ms")
    print(f"  host hit / recompute: {med['host_hit'] / med['recompute']:.3f}; host hits per iteration (tokens): "
          f"{hits_per_iter} (prefix's full blocks: {expected}); host stored blocks {stats.host_stored_blocks}; "
          f"tokens host hit vs recompute: {len(checks) - mismatches}/{len(checks)} identical")
    ok = mismatches == 0 and all(h >= expected for h in hits_per_iter)
    rec = dict(bench="host_tier", model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
               prefix_len=args.prefix_len, suffix_len=args.suffix_len, swap_space=args.swap_space,
               num_gpu_blocks=gpu_blocks, ttft_ms=med, host_hits_per_iter=hits_per_iter, tokens_identical=ok,
               gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               commit=git_commit()["sha"], date=time.strftime("%Y-%m-%d"), machine=machine_info())
    if args.json:
        write_json(Path(args.json), rec)
    if not ok:
        print("host_tier: FAILED (tokens differ or the prefix was not served from the host tier)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
