"""Where a decode step's time goes: GPU kernels by kind vs the host's scheduling, input packing and sampling.

  python bench/profile_decode.py --model random:qwen2.5-7b --dtype bfloat16 --batch 256 --input-len 512

Fills the engine with --batch requests of --input-len random tokens, runs until every one of them decodes, then
times --steps pure decode steps twice (async scheduling off, then on) and profiles them with torch.profiler:
GPU time per step by kernel kind (GEMM, attention, KV write, norms, rotary, activation, sampling/logits, copies),
the host's busy time per step (step wall time minus the time spent waiting for the device's tokens) and how much of
the wall time the GPU was idle. Next to them: the step's floor from the weight + KV bytes over the measured copy
bandwidth and the GEMM FLOPs over the measured bf16 matmul rate.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import git_commit, write_json  # noqa: E402

KINDS = (  # (kind, substrings of the kernel name), first match wins
    ("attention", ("paged_attention", "_attn", "flash")),
    ("kv write", ("kv_write", "write_kv", "reshape_and_cache")),
    ("rms norm", ("rms_norm",)),
    ("rotary", ("rotary",)),
    ("silu*mul", ("silu",)),
    ("GEMM", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "sm90", "cublas", "matmul", "splitk")),
    ("sampling", ("argmax", "reduce", "topk", "sort", "softmax", "exponential")),
    ("copies", ("copy", "memcpy", "fill", "index", "cat", "elementwise")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def host_trace(eng, run, steps: int, path: str, ProfilerActivity, profile, graphs) -> None:
    """Async steps with graphs, the engine's phases marked: a Chrome trace of 4 steps (where the device idles and
    what the host does meanwhile), then a cProfile of `steps` steps (the host's work by function, per step)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import record_function

    eng.async_scheduling, eng.runner.graphs = True, graphs
    phases = [(eng.scheduler, "schedule"), (eng.runner, "execute"), (eng, "_read_step"), (eng.runner.sampler, "sample")]
    for obj, name in phases:
        def marked(*a, _fn=getattr(obj, name), _name=name, **k):
            with record_function(f"engine.{_name}"):
                return _fn(*a, **k)
        setattr(obj, name, marked)
    try:
        run(3)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(4)
        prof.export_chrome_trace(path)
        print(f"\ntrace of 4 async steps: {path}")
        pr = cProfile.Profile()
        pr.enable()
        run(steps)
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
        print(f"cProfile of {steps} async steps (divide by {steps} for a step):")
        print(buf.getvalue())
    finally:
        for obj, name in phases:
            delattr(obj, name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:qwen2.5-7b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prefill-tokens", type=int, default=8192, help="tokens of the profiled prefill step")
    p.add_argument("--bandwidth", type=float, default=4.26e12)
    p.add_argument("--flops", type=float, default=781e12)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--quantization", default=None, choices=["fp8"], help="weights (issue 19's workloads: fp8)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="the engine's batch limit (default: --batch); CUDA graphs are captured up to it")
    p.add_argument("--json", default=None)
    p.add_argument("--trace", default=None,
                   help="also write a Chrome trace (CPU ops, CUDA runtime calls, kernels, the engine's phases) of a "
                        "few async steps here, and print a cProfile of the host's work per step")
    args = p.parse_args(argv)

    from engine import LLM, SamplingParams
    from engine import model_runner

    steps = args.steps
    per_prefill = max(1, args.prefill_tokens // args.input_len)
    # Every request decodes through the fill (the first prompts decode while the last are prefilled) and all three
    # modes' runs.
    fill_steps = -(-args.batch * args.input_len // args.prefill_tokens)
    max_tokens = 8 * steps + 64 + fill_steps
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.input_len + max_tokens + 16,
              max_num_seqs=args.max_num_seqs or max(args.batch, per_prefill),
              max_num_batched_tokens=args.prefill_tokens, enable_prefix_caching=False,
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)
    eng = llm.engine
    cfg = eng.runner.hf_config
    g = torch.Generator().manual_seed(0)
    cuda = eng.runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    from torch.profiler import ProfilerActivity, profile

    def kernel_times(prof, n: int) -> tuple[dict, dict]:
        """(ms per step by kind, ms per step by kernel name), from a profile of n steps."""
        by_kind: dict[str, float] = defaultdict(float)
        top: dict[str, float] = defaultdict(float)
        for e in prof.events():
            if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
                us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            elif not cuda and e.cpu_parent is None:  # a CPU smoke run: the top-level ops
                us = e.cpu_time_total
            else:
                continue
            by_kind[kind_of(e.name)] += us / n / 1e3
            top[e.name] += us / n / 1e3
        return (dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
                dict(sorted(top.items(), key=lambda kv: -kv[1])[:15]))

    # One prefill step of --prefill-tokens tokens (prompts of --input-len), synchronous, after one warm-up step.
    eng.async_scheduling = False
    prefill = {}
    for attempt in range(2):
        pp = torch.randint(10, cfg.vocab_size - 10, (per_prefill, args.input_len), generator=g).tolist()
        for i, pr in enumerate(pp):
            eng.add_request(f"pre{attempt}-{i}", pr, SamplingParams(temperature=0.0, max_tokens=1))
        sync()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            eng.step()
            sync()
        wall = time.perf_counter() - t0
        while eng.has_unfinished_requests():
            eng.step()
    by_kind, top = kernel_times(prof, 1)
    gpu = sum(by_kind.values())
    pflops = 2 * per_prefill * args.input_len * sum(
        t.numel() for n, t in eng.runner.model.named_parameters() if "embed" not in n and "lm_head" not in n)
    prefill = dict(tokens=per_prefill * args.input_len, wall_ms=wall * 1e3, gpu_ms=gpu, by_kind_ms=by_kind,
                   top_kernels_ms=top, gemm_tflop=pflops / 1e12)
    prompts = torch.randint(10, cfg.vocab_size - 10, (args.batch, args.input_len), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, pr in enumerate(prompts):
        eng.add_request(f"r{i}", pr, params)
    while not (len(eng.scheduler.running) == args.batch
               and all(r.num_output_tokens >= 2 for r in eng.scheduler.running)):
        eng.step()
    for _ in range(5):
        eng.step()
    ctx = sum(r.num_tokens for r in eng.scheduler.running) / len(eng.scheduler.running) + 1.5 * steps

    # The host's wait for the device's tokens, to split wall time into host work and waiting.
    waited = [0.0]
    orig_result = model_runner.StepHandle.result

    def timed_result(self):
        t = time.perf_counter()
        try:
            return orig_result(self)
        finally:
            waited[0] += time.perf_counter() - t

    model_runner.StepHandle.result = timed_result

    def run(n: int) -> tuple[float, float]:
        sync()
        waited[0] = 0.0
        t0 = time.perf_counter()
        for _ in range(n):
            eng.step()
        sync()
        wall = time.perf_counter() - t0
        return wall / n, (wall - waited[0]) / n

    results = {}
    graphs = eng.runner.graphs
    for name, mode, use_graphs in (("sync", False, True), ("async", True, True), ("async eager", True, False)):
        eng.async_scheduling = mode
        eng.runner.graphs = graphs if use_graphs else None
        run(3)
        wall, host = run(steps)
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            run(steps)
        by_kind, top = kernel_times(prof, steps)
        gpu = sum(by_kind.values())
        results[name] = dict(
            wall_ms=wall * 1e3, host_busy_ms=host * 1e3, gpu_ms=gpu, gpu_idle_pct=100 * max(0.0, 1 - gpu / (wall * 1e3)),
            by_kind_ms=by_kind, top_kernels_ms=top)

    if args.trace:
        host_trace(eng, run, steps, args.trace, ProfilerActivity, profile, graphs)

    # The floor: weights + the batch's KV once over the bandwidth; the GEMM FLOPs over the matmul rate.
    weight_bytes = sum(t.numel() * t.element_size() for t in eng.runner.model.parameters())
    assert len(eng.scheduler.running) == args.batch, "requests finished before the last measured step"
    kv_bytes = eng.runner.kv_bytes_per_block / eng.runner.block_size * ctx * args.batch
    embed = cfg.vocab_size * cfg.hidden_size
    params = sum(t.numel() for t in eng.runner.model.parameters())  # (fp8 weights: 1 byte each, so count values)
    gemm_flops = 2 * args.batch * (params - embed)
    floor_ms = max((weight_bytes + kv_bytes) / args.bandwidth, gemm_flops / args.flops) * 1e3

    print(f"\nmodel {args.model} {eng.runner.dtype}, batch {args.batch}, mean context {ctx:.0f} tokens")
    print(f"floor: bytes {(weight_bytes + kv_bytes) / 1e9:.1f} GB -> {(weight_bytes + kv_bytes) / args.bandwidth * 1e3:.2f} ms;"
          f" GEMM {gemm_flops / 1e12:.2f} TFLOP -> {gemm_flops / args.flops * 1e3:.2f} ms; floor {floor_ms:.2f} ms")
    for mode, r in results.items():
        print(f"\n[{mode}] wall {r['wall_ms']:.2f} ms/step, host busy {r['host_busy_ms']:.2f} ms, GPU kernels "
              f"{r['gpu_ms']:.2f} ms, GPU idle {r['gpu_idle_pct']:.0f}%")
        for k, v in r["by_kind_ms"].items():
            print(f"  {k:12s} {v:7.3f} ms  {100 * v / r['gpu_ms']:5.1f}%")
    print(f"\n[prefill step] {prefill['tokens']} tokens: wall {prefill['wall_ms']:.1f} ms, GPU kernels "
          f"{prefill['gpu_ms']:.1f} ms; GEMM work {prefill['gemm_tflop']:.1f} TFLOP = "
          f"{prefill['gemm_tflop'] / args.flops * 1e15:.1f} ms at {args.flops / 1e12:.0f} TFLOP/s")
    for k, v in prefill["by_kind_ms"].items():
        print(f"  {k:12s} {v:7.3f} ms  {100 * v / prefill['gpu_ms']:5.1f}%")
    for k, v in list(prefill["top_kernels_ms"].items())[:8]:
        print(f"  {v:7.3f} ms  {k[:110]}")
    print("\ntop kernels (async):")
    for k, v in results["async"]["top_kernels_ms"].items():
        print(f"  {v:7.3f} ms  {k[:110]}")
    if args.json:
        write_json(args.json, dict(model=args.model, quantization=args.quantization,
                                   kv_cache_dtype=args.kv_cache_dtype, batch=args.batch, input_len=args.input_len, mean_context=ctx,
                                   floor_ms=floor_ms, results=results, prefill=prefill, commit=git_commit()["sha"],
                                   date=time.strftime("%Y-%m-%d")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
