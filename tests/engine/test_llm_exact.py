"""Greedy tokens from our engine equal HuggingFace transformers' generate, token for token.

One batch of prompts of lengths 1..300 decodes together, under every scheduling regime that changes the code path:
chunked prefill (a token budget smaller than the prompts), block sizes 16 and 1, prefix caching on and off, and a
KV pool small enough to force preemption and recompute.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams

PROMPT_LENS = [1, 7, 16, 17, 33, 64, 150, 300]
MAX_TOKENS = 12


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    # Two prompts sharing a long prefix, so prefix caching has something to hit.
    prompts.append(prompts[-1][:200] + torch.randint(3, vocab, (20,), generator=g).tolist())
    return prompts


def hf_greedy(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    # ignore_eos on our side: HF must neither stop at EOS nor mask it (min_new_tokens would mask it).
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:  # one at a time: no padding effects in the reference
            ids = torch.tensor([p])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                               do_sample=False, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
    return outs


REGIMES = {
    "default": dict(),
    "chunked": dict(max_num_batched_tokens=64),
    "block1": dict(block_size=1, max_num_batched_tokens=97),
    "no_prefix_cache": dict(enable_prefix_caching=False, max_num_batched_tokens=128),
    # 40 blocks of 16 = 640 tokens for ~1000 prompt tokens + outputs: forces preemption, with the admission
    # watermark off (it would hold requests back instead: "small_pool").
    "preempt": dict(num_gpu_blocks_override=40, max_num_batched_tokens=256, max_model_len=512, new_token_ratio=0.0),
    "small_pool": dict(num_gpu_blocks_override=40, max_num_batched_tokens=256, max_model_len=512),
    # Async scheduling (CUDA's default): each step launched before the previous one's tokens are read.
    "async_chunked": dict(async_scheduling=True, max_num_batched_tokens=64),
    "async_preempt": dict(async_scheduling=True, num_gpu_blocks_override=40, max_num_batched_tokens=256,
                          max_model_len=512, new_token_ratio=0.0),
}


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama3_dir"])
def model_case(request):
    model_dir = request.getfixturevalue(request.param)
    cfg = AutoModelForCausalLM.from_pretrained(model_dir).config
    prompts = make_prompts(cfg.vocab_size)
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_TOKENS)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_matches_transformers(model_case, regime):
    model_dir, prompts, expected = model_case
    llm = LLM(str(model_dir), dtype="float32", device="cpu", **REGIMES[regime])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    got = [o.outputs[0].token_ids for o in outs]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}): {g} != {e}"
    if regime.endswith("preempt"):
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    if llm.engine.kv.enable_caching and not regime.endswith(("preempt", "small_pool")):
        # The same prompt again: everything but the last block comes from the prefix cache, same tokens.
        again = llm.generate(prompt_token_ids=[prompts[-1]], sampling_params=params)[0]
        assert again.outputs[0].token_ids == expected[-1]
        bs = llm.engine.kv.block_size
        assert again.num_cached_tokens == (len(prompts[-1]) - 1) // bs * bs
    assert llm.engine.kv.usage() == 0.0 or llm.engine.kv.enable_caching
    assert all(b == 0 for b in llm.engine.kv.pool.ref_cnt), "a block leaked"


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_dir):
    tok_prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    llm = LLM("smollm2", dtype="float32", device="cpu")
    tok = llm.get_tokenizer()
    prompts = [tok(p).input_ids for p in tok_prompts]
    expected = hf_greedy(smollm2_dir, prompts, 32)
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
