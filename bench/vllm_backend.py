"""vLLM as an optional baseline: runs vLLM's offline `LLM.generate` in the Python of a venv of its own (vLLM is
never a dependency of Tandem, and its pinned torch need not be Tandem's; bench/vllm_cpu_setup.sh makes one for the
CPU) on token-id prompts, and returns the greedy tokens and the generate time.

    tokens, seconds = run_vllm_offline(python, model_dir, prompts, max_tokens=32)

The venv is found from --vllm-python, else $VLLM_PYTHON, else ../vllm-venv/bin/python beside the repo.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# What runs inside vLLM's venv: argv[1] is a JSON request file, argv[2] where the answer goes.
_CHILD = r"""
import json, sys, time


def main():
    req = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams, TokensPrompt
    import vllm

    llm = LLM(model=req["model"], dtype=req["dtype"], seed=0, max_model_len=req["max_model_len"],
              enforce_eager=req["enforce_eager"])
    params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
    warm = [TokensPrompt(prompt_token_ids=p[::-1]) for p in req["prompts"][:2]]  # no prefix hits later
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    json.dump({"tokens": [list(o.outputs[0].token_ids) for o in outs], "elapsed_s": elapsed,
               "version": vllm.__version__}, open(sys.argv[2], "w"))


if __name__ == "__main__":  # vLLM spawns its engine processes, which import this file again
    main()
"""


def default_python(given: str | None = None) -> str | None:
    """The vLLM venv's python: `given`, $VLLM_PYTHON, or ../vllm-venv beside the repo; None when none exists."""
    for candidate in (given, os.environ.get("VLLM_PYTHON"), str(REPO.parent / "vllm-venv" / "bin" / "python")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def vllm_env(kv_cache_gib: float = 2.0) -> dict[str, str]:
    """The environment vLLM's CPU build needs here (bench/vllm_cpu_setup.sh says why), offline."""
    return {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ""}


def run_vllm_offline(python: str, model_dir: str | Path, prompts: list[list[int]], max_tokens: int,
                     dtype: str = "float32", max_model_len: int = 2048, enforce_eager: bool = False,
                     timeout_s: float = 1800.0) -> tuple[list[list[int]], float, str]:
    """(greedy tokens per prompt, generate seconds, vLLM's version); RuntimeError with its output's tail if it
    fails."""
    with tempfile.TemporaryDirectory(prefix="tandem-vllm-") as tmp:
        req, out, script = Path(tmp) / "req.json", Path(tmp) / "out.json", Path(tmp) / "child.py"
        req.write_text(json.dumps({"model": str(model_dir), "dtype": dtype, "prompts": prompts,
                                   "max_tokens": max_tokens, "max_model_len": max_model_len,
                                   "enforce_eager": enforce_eager}))
        script.write_text(_CHILD)
        proc = subprocess.run([python, str(script), str(req), str(out)], env=vllm_env(), cwd=tmp,
                              capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"vLLM ({python}) exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}")
        answer = json.loads(out.read_text())
    return answer["tokens"], answer["elapsed_s"], answer["version"]
