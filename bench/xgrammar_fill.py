"""xgrammar's token-bitmask fill and accept on the host, without a model: bench/structured_mask.py's schemas against
a tokenizer, logits --vocab-size wide (the synthetic tokenizer of that size, or --tokenizer DIR padded to it).

--batch-size matchers (request i follows schema i % --num-schemas, as in structured_mask) walk --steps tokens,
each drawn uniformly from what its grammar allows (a random model's sampling, roughly); every step times the
batch fill (xgrammar's BatchGrammarMatcher on --threads threads, the engine's path) and the matchers accepting
their tokens. --no-max-length drops the records' string maxLength. Prints ms per step and per row.

  python bench/xgrammar_fill.py                                     # synthetic, 152,064 tokens
  python bench/xgrammar_fill.py --tokenizer .carry/smollm2-tokenizer  # SmolLM2's 49,152, padded to 152,064
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.structured_mask import schema  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the synthetic tokenizer)")
    p.add_argument("--vocab-size", type=int, default=152064, help="logits width (random:qwen2.5-7b's)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--num-schemas", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=1, help="BatchGrammarMatcher threads")
    p.add_argument("--no-max-length", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import xgrammar as xgr
    from transformers import AutoTokenizer

    from engine.tokenizer import synthetic_tokenizer

    tok = (AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True) if args.tokenizer
           else synthetic_tokenizer(args.vocab_size))
    vocab = args.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiled = []
    for k in range(args.num_schemas):
        s = schema(k, 64)
        if args.no_max_length:
            s["properties"]["items"]["items"]["properties"][f"name{k}"].pop("maxLength")
        compiled.append(compiler.compile_grammar(xgr.Grammar.from_json_schema(json.dumps(s), any_whitespace=False)))
    matchers = [xgr.GrammarMatcher(compiled[i % args.num_schemas]) for i in range(args.batch_size)]
    mask = torch.empty(args.batch_size, (vocab + 31) // 32, dtype=torch.int32)
    batch = xgr.BatchGrammarMatcher(args.threads)
    rng = random.Random(args.seed)
    fill, accept = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, mask.numpy())
        fill.append(time.perf_counter() - t0)
        bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        tokens = []
        for row in bits:
            allowed = np.flatnonzero(row)
            tokens.append(int(allowed[rng.randrange(len(allowed))]))
        t0 = time.perf_counter()
        for m, t in zip(matchers, tokens):
            assert m.accept_token(t)
        accept.append(time.perf_counter() - t0)
    b = args.batch_size
    print(f"tokenizer {args.tokenizer or 'synthetic'} ({len(tok)} tokens, logits {vocab} wide), batch {b}, "
          f"{args.num_schemas} schemas, maxLength {'none' if args.no_max_length else 24}, {args.threads} thread(s), "
          f"{args.steps} steps")
    for name, xs in (("fill", fill), ("accept", accept)):
        ms = sorted(1e3 * x for x in xs)
        print(f"  {name}: ms per step mean {statistics.mean(ms):.2f} median {statistics.median(ms):.2f} "
              f"max {ms[-1]:.2f}; per row mean {statistics.mean(ms) / b * 1e3:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
