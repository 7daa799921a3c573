"""Offline throughput: Tandem's `LLM.generate` against transformers' `generate` (and vLLM's) on the same random prompts.

Mirrors vLLM's benchmarks/benchmark_throughput.py (random dataset): `--num-prompts` prompts of `--input-len` random
token ids, `--output-len` greedy tokens each with EOS ignored. Both backends load the same safetensors directory,
run in the same process on the same prompts, after an untimed warm-up on other prompts. Prints a table (and the
number of prompts whose greedy tokens agree between the backends) and writes JSON with the machine, commit and date.

    .venv/bin/python bench/offline.py --model smollm2 --num-prompts 32 --input-len 128 --output-len 64
    .venv/bin/python bench/offline.py --backend tandem,vllm --vllm-python ../vllm-venv/bin/python ...

vLLM (`vllm`, optional, never a dependency) runs its own `LLM.generate` in the Python of its own venv
(bench/vllm_backend.py; bench/vllm_cpu_setup.sh makes one for the CPU) on the same token ids, after its own warm-up;
its CPU time is not measured (its engine runs in other processes).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `engine` and `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import format_table, write_json
from engine import LLM, SamplingParams
from engine.loader import load_tokenizer, resolve_model
from engine.config import resolve_dtype

WARMUP_PROMPTS, WARMUP_OUTPUT_LEN = 2, 4
BACKENDS = ("tandem", "hf", "vllm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="model spec (alias, HF dir, .gguf, random:<preset>)")
    p.add_argument("--num-prompts", type=int, default=32, help="number of prompts")
    p.add_argument("--input-len", type=int, default=128, help="prompt length in tokens")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per prompt (EOS ignored)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and of the engine")
    p.add_argument("--backend", type=_backends, default="tandem,hf",
                   help="comma-separated: tandem, hf (transformers), vllm; both = tandem,hf (default: tandem,hf)")
    p.add_argument("--vllm-python", default=None,
                   help="python of vLLM's venv for --backend vllm (default: $VLLM_PYTHON, else ../vllm-venv)")
    p.add_argument("--dtype", default="auto", help="auto (the engine's rule: float32 on CPU), float32, float16, bfloat16")
    p.add_argument("--hf-max-batch-size", type=int, default=None,
                   help="prompts per transformers generate() call (default: all of them)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")
    args = p.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    for name in ("hf_max_batch_size", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    return args


def _backends(value: str) -> list[str]:
    names = ["tandem", "hf"] if value == "both" else [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in BACKENDS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{value!r}: must be a comma-separated list of {', '.join(BACKENDS)}")
    return names


def random_prompts(num: int, length: int, vocab_size: int, special_ids: set[int], seed: int) -> list[list[int]]:
    """`num` lists of `length` token ids drawn uniformly from the vocabulary, special tokens excluded."""
    allowed = torch.tensor([t for t in range(vocab_size) if t not in special_ids])
    gen = torch.Generator().manual_seed(seed)
    return allowed[torch.randint(len(allowed), (num, length), generator=gen)].tolist()


class Timer:
    """Wall time and the process's CPU time (all threads): on a shared machine CPU time is the steadier number,
    exact with --threads 1, while other processes' load stretches wall time."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def result(name: str, timer: Timer, prompts: list[list[int]], outputs: list[list[int]]) -> dict:
    n_in = sum(map(len, prompts))
    n_out = sum(map(len, outputs))
    elapsed = timer.wall
    return {"backend": name, "elapsed_s": elapsed, "cpu_s": timer.cpu,
            "output_tokens_per_cpu_s": n_out / timer.cpu, "num_prompts": len(prompts), "input_tokens": n_in,
            "output_tokens": n_out, "output_tokens_per_s": n_out / elapsed,
            "total_tokens_per_s": (n_in + n_out) / elapsed, "requests_per_s": len(prompts) / elapsed}


def run_tandem(args, prompts, warmup) -> tuple[dict, list[list[int]]]:
    llm = LLM(model=args.model, dtype=args.dtype, seed=args.seed)
    llm.generate(prompt_token_ids=warmup,
                 sampling_params=SamplingParams(max_tokens=WARMUP_OUTPUT_LEN, ignore_eos=True, temperature=0))
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    with Timer() as timer:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return result("tandem", timer, prompts, tokens), tokens


def run_vllm(args, prompts, resolved) -> tuple[dict, list[list[int]]]:
    from bench.vllm_backend import default_python, run_vllm_offline

    python = default_python(args.vllm_python)
    if python is None or resolved.weights_dir is None:
        raise SystemExit("--backend vllm: needs a vLLM venv (--vllm-python, $VLLM_PYTHON or ../vllm-venv; "
                         "bench/vllm_cpu_setup.sh) and a checkpoint directory (not random:)")
    dtype = "float32" if args.dtype == "auto" and not torch.cuda.is_available() else args.dtype
    tokens, elapsed, _ = run_vllm_offline(python, resolved.weights_dir, prompts, args.output_len, dtype=dtype,
                                          max_model_len=max(2048, args.input_len + args.output_len))
    timer = Timer()
    timer.wall, timer.cpu = elapsed, float("nan")
    return result("vllm", timer, prompts, tokens), tokens


def run_hf(args, prompts, warmup, weights_dir: Path, dtype: torch.dtype, pad_id: int) -> tuple[dict, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=dtype).to(device).eval()
    # No EOS: generation never stops early and EOS is never masked, like Tandem's ignore_eos.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = pad_id
    batch = args.hf_max_batch_size or len(prompts)

    def generate(batch_prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(map(len, batch_prompts))
        # Left padding, so every row's last prompt token sits at the end.
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch_prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_prompts], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, temperature=None, top_p=None,
                                 top_k=None)
        return out[:, width:].tolist()

    generate(warmup, WARMUP_OUTPUT_LEN)
    tokens: list[list[int]] = []
    with Timer() as timer:
        for i in range(0, len(prompts), batch):
            tokens += generate(prompts[i:i + batch], args.output_len)
        if device == "cuda":
            torch.cuda.synchronize()
    return result("hf", timer, prompts, tokens), tokens


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    resolved = resolve_model(args.model)
    tokenizer = load_tokenizer(resolved)
    vocab_size = resolved.config.vocab_size
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    prompts = random_prompts(args.num_prompts, args.input_len, vocab_size, special, args.seed)
    # Warm-up prompts differ from the measured ones, so no prefix cache hit is carried into the timed run.
    warmup = random_prompts(WARMUP_PROMPTS, args.input_len, vocab_size, special, args.seed + 1)

    results, tokens = {}, {}
    if "tandem" in args.backend:
        results["tandem"], tokens["tandem"] = run_tandem(args, prompts, warmup)
    if "vllm" in args.backend:
        results["vllm"], tokens["vllm"] = run_vllm(args, prompts, resolved)
    if "hf" in args.backend:
        if resolved.weights_dir is None:
            raise SystemExit(f"--model={args.model}: --backend hf needs a checkpoint directory; random models "
                             "have none (use --backend tandem)")
        dtype = resolve_dtype(args.dtype, resolved.config, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        results["hf"], tokens["hf"] = run_hf(args, prompts, warmup, resolved.weights_dir, dtype, pad_id)

    summary: dict = {"config": vars(args), "results": list(results.values())}
    rows = [[r["backend"], r["num_prompts"], r["input_tokens"], r["output_tokens"], r["elapsed_s"],
             r["output_tokens_per_s"], r["total_tokens_per_s"], r["cpu_s"], r["output_tokens_per_cpu_s"]]
            for r in results.values()]
    print(f"model={args.model} num_prompts={args.num_prompts} input_len={args.input_len} "
          f"output_len={args.output_len} dtype={args.dtype} threads={torch.get_num_threads()} "
          f"load_average_1m={os.getloadavg()[0]:.1f}")
    print(format_table(["backend", "prompts", "in tok", "out tok", "elapsed s", "out tok/s", "total tok/s",
                        "cpu s", "out tok/cpu s"], rows))
    for other in [k for k in ("vllm",) if k in results and "tandem" in results]:
        same = sum(a == b for a, b in zip(tokens["tandem"], tokens[other]))
        ratio = results["tandem"]["output_tokens_per_s"] / results[other]["output_tokens_per_s"]
        summary[f"ratio_tandem_over_{other}"], summary[f"identical_greedy_prompts_{other}"] = ratio, same
        print(f"throughput ratio tandem/{other}: {ratio:.2f}x (wall time); identical greedy tokens: "
              f"{same}/{len(prompts)} prompts")
    if "tandem" in results and "hf" in results:
        ratio = results["tandem"]["output_tokens_per_s"] / results["hf"]["output_tokens_per_s"]
        cpu_ratio = results["hf"]["cpu_s"] / results["tandem"]["cpu_s"]
        same = sum(a == b for a, b in zip(tokens["tandem"], tokens["hf"]))
        first_diff = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
                      for a, b in zip(tokens["tandem"], tokens["hf"])]
        summary.update(ratio_tandem_over_hf=ratio, cpu_time_ratio_hf_over_tandem=cpu_ratio, identical_greedy_prompts=same,
                       first_divergence=first_diff)
        print(f"throughput ratio tandem/hf: {ratio:.2f}x (wall time), {cpu_ratio:.2f}x (CPU time)")
        print(f"identical greedy tokens: {same}/{len(prompts)} prompts"
              + ("" if same == len(prompts) else
                 f" (first divergent position per prompt: {first_diff})"))
    if args.json:
        write_json(args.json, summary)
        print(f"wrote {args.json}")
    return summary


if __name__ == "__main__":
    main()
