"""Accuracy of the quantized KV caches against the full-precision one: teacher-forced next-token agreement and logit
error, and free-running greedy tokens that match, over a few prompts.

  python bench/kv_quant_accuracy.py --model smollm2 --num-prompts 4 --output-len 48 --json out.json

Cache modes: `int8` (the engine's: a scale per token and KV head, computed as each row is written), `int8-static`
(one calibrated scale per layer and KV head, the alternative the int8 design was measured against: amax of a
256-token calibration prompt x --static-headroom, rows past it saturate at +-127; stored in the same per-row
slots, so attention runs unchanged), `fp8` (the engine's: per-layer e4m3 scales). The reference is `auto` (the
model dtype; float32 on the CPU). Numbers go to docs/kernels.md and bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import format_table, write_json  # noqa: E402

PROMPTS = ["Explain how a bicycle works.", "Write a short poem about the sea.",
           "What is the capital of France, and why is it famous?", "List three uses of a paperclip.",
           "Describe the water cycle to a child.", "How do I sort a list in Python?",
           "Why is the sky blue?", "Give me a recipe for pancakes."]


def static_int8_writer(runner, headroom: float):
    """A write_kv_ref replacement that quantizes with one calibrated scale per (layer, K/V, KV head)."""
    from engine.model import AttentionMetadata
    from engine.model_runner import allocate_kv_cache, layer_kv_views
    from kernels.kv_write import write_kv_ref as plain_write

    n, bs, dev = 256, runner.block_size, runner.device
    ids = torch.randint(0, runner.hf_config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    nb = -(-n // bs)
    scratch = allocate_kv_cache(nb, runner.num_layers, bs, runner.num_kv_heads, runner.head_dim, runner.dtype, dev,
                                zero=True)
    meta = AttentionMetadata(slot_mapping=torch.arange(n, device=dev),
                             block_tables=torch.arange(nb, dtype=torch.int32, device=dev)[None],
                             seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
                             max_query_len=n, max_seq_len=n)
    with torch.inference_mode():
        runner.model(ids.to(dev), torch.arange(n, device=dev), layer_kv_views(scratch), meta)
    amax = scratch.float().abs().amax(dim=(0, 3, 5))  # [num_layers, 2, num_kv_heads]
    scales = (amax * headroom / 127.0).clamp(min=1e-12)
    by_ptr = {}
    for l, kv in enumerate(runner.kv_layers):
        by_ptr[kv.k_cache.data_ptr()] = scales[l, 0]
        by_ptr[kv.v_cache.data_ptr()] = scales[l, 1]

    def write(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0, *, k_scale_cache=None,
              v_scale_cache=None):
        if k_scale_cache is None:
            return plain_write(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        valid = slot_mapping >= 0
        slots = slot_mapping[valid].long()
        blocks, offs = slots // k_cache.shape[1], slots % k_cache.shape[1]
        for x, cache, sc in ((k[valid], k_cache, k_scale_cache), (v[valid], v_cache, v_scale_cache)):
            s = by_ptr[cache.data_ptr()]  # [num_kv_heads]
            cache[blocks, offs] = torch.round(x.float() / s[:, None]).clamp(-127, 127).to(torch.int8)
            sc[blocks, offs] = s.expand(x.shape[0], -1)

    return write


def build(model: str, mode: str, args):
    from engine import LLM

    llm = LLM(model, device=args.device, kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
              kv_cache_dtype="int8" if mode.startswith("int8") else mode, dtype=args.dtype)
    return llm


def teacher_forced_logits(llm, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, as one prefill (the cache written and read in the same step)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "engine"))
    from test_cuda_parity import step_logits

    return step_logits(llm, ids)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--modes", default="int8,int8-static,fp8")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--static-headroom", type=float, default=1.0)
    p.add_argument("--kv-cache-memory", type=float, default=0.25)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import kernels.rotary
    from engine import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompts = PROMPTS[:args.num_prompts]
    results, ref = {}, None
    for mode in ["auto", *args.modes.split(",")]:
        llm = build(args.model, mode, args)
        original = kernels.rotary.write_kv_ref
        if mode == "int8-static":
            kernels.rotary.write_kv_ref = static_int8_writer(llm.engine.runner, args.static_headroom)
        try:
            tok = llm.get_tokenizer()
            ids = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                               add_generation_prompt=True), add_special_tokens=False).input_ids
                   if getattr(tok, "chat_template", None) else tok(q).input_ids for q in prompts]
            logits = [teacher_forced_logits(llm, x) for x in ids]
            outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": x} for x in ids], greedy)]
        finally:
            kernels.rotary.write_kv_ref = original
        print(f"{mode}: done", flush=True)
        if ref is None:
            ref = (logits, outs)
            continue
        agree = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(ref[0], logits))
        positions = sum(a.shape[0] for a in logits)
        rel = sum(((b - a).norm(dim=-1) / a.norm(dim=-1)).sum().item() for a, b in zip(ref[0], logits)) / positions
        same = sum(x == y for a, b in zip(ref[1], outs) for x, y in zip(a, b))
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ref[1], outs)]
        results[mode] = dict(teacher_forced_agree=agree, positions=positions, mean_logit_rel_err=rel,
                             greedy_tokens_equal=same, greedy_tokens=sum(map(len, outs)), first_difference=first)
    rows = [[m, f"{r['teacher_forced_agree']}/{r['positions']}", f"{r['mean_logit_rel_err']:.4f}",
             f"{r['greedy_tokens_equal']}/{r['greedy_tokens']}", " ".join(map(str, r["first_difference"]))]
            for m, r in results.items()]
    print(f"{args.model}, {len(prompts)} prompts x {args.output_len} greedy tokens, against the {args.dtype} "
          "(auto) cache")
    print(format_table(["cache", "teacher-forced argmax equal", "mean logit rel. error", "greedy tokens equal",
                        "first differing token per prompt"], rows))
    if args.json:
        write_json(args.json, {"model": args.model, "num_prompts": len(prompts), "output_len": args.output_len,
                               "static_headroom": args.static_headroom, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
