"""Decode CUDA graphs at every captured batch size give the eager step's tokens: 1,000 short prompts decoded at
--max-num-seqs 1024 (graphs up to 1024 rows) against --enforce-eager, greedy. Prints the agreement.

  python bench/graph_check.py [--model random:smollm2-135m] [--num-prompts 1000] [--max-model-len 128]

--max-model-len past kernels/paged_attention.py SHORT_DECODE_CONTEXT (e.g. 1024) checks the short-context decode
graphs too (the steps' contexts stay under 64 keys).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.throughput import make_prompts  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=128)
    p.add_argument("--variant", choices=["graphs", "eager"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from engine import LLM, SamplingParams
    from engine.loader import resolve_model

    prompts = make_prompts(args.num_prompts, 32, resolve_model(args.model).config.vocab_size, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    if args.variant is not None:  # one engine per process: the GPU memory an engine held is not all given back
        llm = LLM(args.model, max_model_len=args.max_model_len, max_num_seqs=1024,
                  enforce_eager=args.variant == "eager",
                  enable_prefix_caching=False)
        out = [list(o.outputs[0].token_ids) for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        print(json.dumps(out))
        return 0
    outs = {}
    for eager in (False, True):
        run = subprocess.run([sys.executable, __file__, "--model", args.model, "--num-prompts", str(args.num_prompts),
                              "--output-len", str(args.output_len), "--max-model-len", str(args.max_model_len),
                              "--variant", "eager" if eager else "graphs"],
                             capture_output=True, text=True, check=True)
        outs[eager] = json.loads(run.stdout.strip().splitlines()[-1])
    same_seq = sum(a == b for a, b in zip(outs[False], outs[True]))
    same_tok = sum(x == y for a, b in zip(outs[False], outs[True]) for x, y in zip(a, b))
    total = sum(len(a) for a in outs[True])
    print(f"graphs vs eager at batch {args.num_prompts}: {same_seq}/{args.num_prompts} sequences identical, "
          f"{same_tok}/{total} tokens")
    return 0 if same_seq >= 0.99 * args.num_prompts else 1


if __name__ == "__main__":
    sys.exit(main())
