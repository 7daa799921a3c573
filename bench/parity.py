"""Greedy parity on the CPU: Tandem, transformers and (when a vLLM venv is there) vLLM on the same 21 prompts of
SmolLM2 (English, Chinese, code, chat), token for token.

    python bench/parity.py [--max-tokens 32] [--vllm-python VENV/bin/python | --no-vllm] [--json out.json]

Every backend gets the same token ids (chat prompts through the model's chat template), float32, greedy, EOS
ignored; a prompt agrees when all of its tokens do. tests/engine/test_smollm2_parity.py checks Tandem against
transformers on the same prompts in CI (which has no vLLM).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `engine` and `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import format_table, write_json

ENGLISH = ["The capital of France is", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of",
           "The best way to learn a new language is", "In 1969, the first humans to walk on the Moon",
           "A healthy breakfast usually includes", "The theory of relativity was proposed by"]
CHINESE = ["中国的首都是", "从前有一座山，山里有一座庙，", "人工智能是", "春天来了，", "请介绍一下长城。"]
CODE = ["def fibonacci(n):", "import numpy as np\n\ndef softmax(x):", "SELECT name, age FROM users WHERE",
        "#include <stdio.h>\n\nint main(void) {"]
CHAT = ["What is the capital of Japan?", "Write a haiku about the sea.", "How do I reverse a list in Python?",
        "用一句话解释什么是机器学习。"]


def prompt_ids(tokenizer) -> tuple[list[str], list[list[int]]]:
    """(label, token ids) of the 21 prompts: plain text, then the chat ones through the chat template."""
    labels, ids = [], []
    for kind, texts in (("en", ENGLISH), ("zh", CHINESE), ("code", CODE)):
        for t in texts:
            labels.append(f"{kind}: {t[:28]!r}")
            ids.append(tokenizer(t).input_ids)
    for t in CHAT:
        labels.append(f"chat: {t[:26]!r}")
        ids.append(list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                      tokenize=True, return_dict=False)))
    return labels, ids


def tandem_greedy(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from engine import LLM, SamplingParams

    llm = LLM("smollm2", dtype="float32", device="cpu")
    try:
        outs = llm.generate(prompt_token_ids=prompts,
                            sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.close()


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' generate, one prompt at a time (no padding), EOS neither stopping nor masked."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                               temperature=None, top_p=None, top_k=None, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
    return outs


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    from bench.vllm_backend import default_python, run_vllm_offline
    from engine.loader import load_tokenizer, resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--vllm-python", default=None, help="python of a venv with vLLM (default: $VLLM_PYTHON or "
                                                       "../vllm-venv/bin/python; none: vLLM is left out)")
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    resolved = resolve_model("smollm2")
    labels, prompts = prompt_ids(load_tokenizer(resolved))
    tokens = {"tandem": tandem_greedy(prompts, args.max_tokens),
              "transformers": hf_greedy(resolved.weights_dir, prompts, args.max_tokens)}
    python = None if args.no_vllm else default_python(args.vllm_python)
    version = None
    if python:
        tokens["vllm"], _, version = run_vllm_offline(python, resolved.weights_dir, prompts, args.max_tokens)
    others = [k for k in tokens if k != "tandem"]
    rows = [[label, len(ids), *[("=" if tokens[k][i] == tokens["tandem"][i]
                                 else f"differs at {first_difference(tokens[k][i], tokens['tandem'][i])}")
                                for k in others]]
            for i, (label, ids) in enumerate(zip(labels, prompts))]
    print(format_table(["prompt", "tokens", *[f"{k} vs tandem" for k in others]], rows))
    agree = {k: sum(a == b for a, b in zip(tokens[k], tokens["tandem"])) for k in others}
    if "vllm" in tokens:
        agree["vllm vs transformers"] = sum(a == b for a, b in zip(tokens["vllm"], tokens["transformers"]))
    print(f"greedy, {args.max_tokens} tokens, float32, load {os.getloadavg()[0]:.1f}"
          + (f", vLLM {version}" if version else ", no vLLM venv found") + ": "
          + "; ".join(f"{k}: {n}/{len(prompts)}" for k, n in agree.items()))
    if args.json:
        write_json(args.json, {"max_tokens": args.max_tokens, "vllm_version": version, "labels": labels,
                               "prompts": prompts, "tokens": tokens, "agree": agree})
    return 0 if all(n == len(prompts) for n in agree.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
