"""fp8 (e4m3) KV cache on the CPU path: the pool holds twice the tokens, and next-token choices stay with fp32 KV."""
from __future__ import annotations

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


@pytest.mark.slow
def test_fp8_kv_next_token_agrees_on_smollm2(smollm2_dir):
    """Teacher-forced over a chat prompt: the argmax at each position with fp8 KV equals fp32 KV's at >= 95% of
    positions (measured 2026-11-30: 97.2%, 35 of 36; mean logits relative error 7.8%). Free-running greedy output
    diverges early (token 7 on two prompts), as any near-tie flips the rest of the sequence."""
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
