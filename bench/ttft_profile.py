"""Where one prompt's TTFT goes on the host: the offline engine's time to first token for a single prompt, then a
cProfile of those calls (the host's Python) next to the device's kernel time.

  python bench/ttft_profile.py --model random:qwen2.5-7b --dtype bfloat16 --input-len 512

A 512-token prefill of a 7B model is ~11 ms of kernels on the H200; everything above that in TTFT is the host
launching ~500 kernels from Python, preparing inputs and reading the token. --variants times the prefill replayed as
a CUDA graph (the default, engine/cuda_graphs.PrefillGraphs) and eagerly, with the prefill attention's ways of
reading the step's own keys (kernels.paged_attention.PREFILL_NEW_KV: 0 cache, 2 TMA); the cProfile is of the first.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:qwen2.5-7b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--num-iters", type=int, default=7)
    p.add_argument("--variants", default="graph,eager,eager-tma",
                   help="comma-separated: graph (prefill CUDA graphs), eager, eager-tma (PREFILL_NEW_KV=2)")
    p.add_argument("--top", type=int, default=22)
    args = p.parse_args(argv)

    from engine import LLM, SamplingParams
    import kernels.paged_attention as pa

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.input_len + 64, max_num_seqs=8,
              enable_prefix_caching=False)
    vocab = llm.engine.runner.hf_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, vocab - 10, (args.input_len,), generator=g).tolist()
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def ttft() -> float:
        sync()
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=[prompt], sampling_params=params)
        return time.perf_counter() - t0

    runner = llm.engine.runner
    graphs = runner.prefill_graphs

    def use(variant: str) -> None:
        runner.prefill_graphs = graphs if variant == "graph" else None
        pa.PREFILL_NEW_KV = 2 if variant == "eager-tma" else 0

    rows = []
    variants = args.variants.split(",")
    for v in variants:
        if v == "graph" and graphs is None:
            print("graph: no prefill CUDA graphs here (CPU, or --max-prefill-cudagraph-tokens 0)")
            continue
        use(v)
        for _ in range(3):
            ttft()  # compile and warm up this variant
        times = [ttft() for _ in range(args.num_iters)]
        rows.append((v, statistics.median(times) * 1e3, min(times) * 1e3))
    for v, med, lo in rows:
        print(f"{v:10s}: TTFT median {med:.2f} ms (min {lo:.2f})")

    use(rows[0][0])
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        ttft()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
    lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
    print(f"cProfile of 3 TTFT calls ({rows[0][0]}), by own time:")
    for ln in lines[:6 + args.top]:
        print(ln[:160])
    return 0


if __name__ == "__main__":
    sys.exit(main())
