"""fp8 (e4m3) KV cache on the CPU path: the pool holds twice the tokens, and next-token choices stay with fp32 KV."""
from __future__ import annotations

import math

import pytest

from engine import LLM, SamplingParams


def test_fp8_doubles_the_pool_for_the_same_memory():
    a = LLM("random:tiny", device="cpu", kv_cache_memory=0.01, max_model_len=256)
    b = LLM("random:tiny", device="cpu", kv_cache_memory=0.01, max_model_len=256, kv_cache_dtype="fp8")
    # An fp32 model on the CPU: 4 bytes per element become 1 (on a GPU, bf16's 2 become 1).
    assert a.engine.runner.kv_bytes_per_block == 4 * b.engine.runner.kv_bytes_per_block
    assert b.engine.runner.num_blocks // 4 == a.engine.runner.num_blocks
    out = b.generate(["hello"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 8


def test_fp8_scales_are_calibrated_powers_of_two():
    # Per-layer scales from a calibration prompt (engine/model_runner.py): powers of two, so x / scale is exact, and
    # the K/V a real prompt writes use e4m3's range without saturating (with scale 1.0 this small model's values
    # would sit far below it, among the subnormals).
    llm = LLM("random:tiny", device="cpu", kv_cache_memory=0.01, max_model_len=256, kv_cache_dtype="fp8")
    r = llm.engine.runner
    for s in r.k_scales + r.v_scales:
        assert s > 0 and math.log2(s) == round(math.log2(s)), f"scale {s} is not a power of two"
    k1, v1 = r.calibrate_kv_scales(headroom=1.0)
    assert r.k_scales == [4 * s for s in k1] and r.v_scales == [4 * s for s in v1]  # headroom 4 = two binades
    r.kv_cache.zero_()  # the pool is uninitialized: only what this prompt writes may count
    llm.generate(["hello there, how are you"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    used = r.kv_cache.float().abs().flatten(2).amax(dim=(0, 2))  # [num_layers]
    assert (used < 448).all(), f"saturated: {used.tolist()}"
    assert (used > 448 / 64).all(), f"values far below e4m3's range: {used.tolist()}"


@pytest.mark.slow
def test_fp8_kv_next_token_agrees_on_smollm2(smollm2_dir):
    """Teacher-forced over a chat prompt: the argmax at each position with fp8 KV equals fp32 KV's at >= 95% of
    positions (measured 2026-11-30: 97.2%, 35 of 36; mean logits relative error 7.8%).

    Longer measurement (2026-11-30, bf16 weights, 4 chat prompts x 256 greedy tokens, fp8 vs bf16 KV): teacher-forced
    98.0% with calibrated scales (98.1% with scale 1.0); free-running position-wise agreement only 19.2% (12.6%),
    but bf16 against fp32 weights agrees on 24.7% free-running (first differences at tokens 7, 0, 28, 182): once a
    near-tie flips one token the rest of the output differs, whatever the rounding that flipped it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_parity import step_logits

    msgs = [{"role": "user", "content": "Explain how a bicycle works."}]
    logits = {}
    for kv in ("auto", "fp8"):
        llm = LLM("smollm2", device="cpu", kv_cache_memory=0.2, max_model_len=2048, kv_cache_dtype=kv)
        tok = llm.get_tokenizer()
        ids = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False).input_ids
        logits[kv] = step_logits(llm, ids)
    a, b = logits["auto"], logits["fp8"]
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    rel = ((b - a).norm(dim=-1) / a.norm(dim=-1)).mean().item()
    assert agree >= 0.95, f"next-token agreement {agree:.1%}"
    assert rel < 0.15, f"mean logits relative error {rel:.3f}"
