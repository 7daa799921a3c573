"""int8 KV cache (a float32 scale per token and KV head, stored in each block after its values) on the CPU path:
the pool's bytes, the scales beside the values, greedy agreement with the full-precision cache, prefix caching
moving scales with their blocks, and stacking with 4-bit and fp8 weights."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model_runner import allocate_kv_cache
from kernels.quant_int8 import dequantize_int8_rows_ref, int8_cache_views

PROMPTS = ["hello there", "the quick brown fox jumps over", "1 2 3 4 5 6 7", "a b c", "Once upon a time",
           "what is the capital of France?", "zzz", "int8 caches keep a scale per row"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def tiny(kv_cache_dtype, **kw):
    return LLM("random:tiny", device="cpu", kv_cache_memory=0.01, max_model_len=256, kv_cache_dtype=kv_cache_dtype,
               **kw)


def test_pool_counts_the_scales_bytes():
    a, b = tiny("auto"), tiny("int8")
    ra, rb = a.engine.runner, b.engine.runner
    d = ra.head_dim  # 16 for random:tiny: fp32 rows of 64 bytes become 16 int8 values + a 4-byte scale
    assert rb.kv_cache.dtype == torch.int8 and rb.kv_cache.shape[-1] == d + 4
    assert rb.kv_bytes_per_block * 4 * d == ra.kv_bytes_per_block * (d + 4)
    assert rb.num_blocks == int(0.01 * (1 << 30) // rb.kv_bytes_per_block)
    assert rb.kv_cache[0].numel() == rb.kv_bytes_per_block  # what a KV transfer moves per block


def test_cache_holds_each_rows_scale_and_dequantizes_to_the_written_kv():
    llm = tiny("int8")
    r = llm.engine.runner
    r.kv_cache.zero_()
    llm.generate(["hello there, how are you"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    kv = r.kv_layers[1]
    assert kv.k_scale_cache is not None and kv.k_scale_cache.data_ptr() > r.kv_cache.data_ptr()
    values, scales = int8_cache_views(r.kv_cache[:, 1, 0])
    assert torch.equal(values, kv.k_cache) and torch.equal(scales, kv.k_scale_cache)
    written = scales > 0
    assert written.sum() > 0 and values.abs().amax() == 127  # each row's largest |x| maps to 127
    # Every written row uses its full range: its largest |value| is 127 (or the row is all zeros).
    row_max = values.abs().amax(dim=-1)
    assert (row_max[written] == 127).all()
    deq = dequantize_int8_rows_ref(values, scales)
    assert torch.isfinite(deq).all()


def test_greedy_agreement_with_the_fp32_cache():
    """Free-running greedy tokens equal to the fp32 cache's, position by position (a random model's logits are near
    ties: one flip changes the rest of that output). bench/kv_quant_accuracy.py measured 233 of 256 (8 prompts x 32
    tokens) for int8 and 137 of 256 for fp8 (docs/kernels.md); the bound here leaves room for other prompts."""
    outs = {kv: [o.outputs[0].token_ids for o in tiny(kv).generate(PROMPTS, GREEDY)] for kv in ("auto", "int8")}
    same = sum(x == y for a, b in zip(outs["auto"], outs["int8"]) for x, y in zip(a, b))
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(outs["auto"],
                                                                                          outs["int8"])]
    assert same >= 0.75 * 24 * len(PROMPTS), (same, first)
    assert sum(f == 24 for f in first) >= len(PROMPTS) // 2, first  # most prompts agree on every token


def test_prefix_caching_reuses_blocks_with_their_scales():
    prefix = list(range(30, 30 + 48))  # three full blocks of 16
    prompts = [{"prompt_token_ids": prefix + [7, 8, 9]}, {"prompt_token_ids": prefix + [11, 12]}]
    cold = [o.outputs[0].token_ids for o in tiny("int8", enable_prefix_caching=False).generate(prompts, GREEDY)]
    llm = tiny("int8", enable_prefix_caching=True)
    warm = [llm.generate([p], GREEDY)[0] for p in prompts]
    assert warm[1].num_cached_tokens == 48  # the second prompt read the first one's blocks (and their scales)
    assert [o.outputs[0].token_ids for o in warm] == cold


def test_each_block_region_holds_its_values_then_its_scales():
    """The "block" layout (kernels/quant_int8.py): each (block, layer, K/V) region of the cache is its values
    [block_size, kv_heads, head_dim] int8, then its scales [kv_heads, block_size] float32; the layer views read
    exactly those bytes, and every value row is 16-byte aligned."""
    from engine.model_runner import layer_kv_views
    nb, layers, bs, heads, d = 3, 2, 16, 2, 16
    cache = allocate_kv_cache(nb, layers, bs, heads, d, torch.int8, "cpu", zero=True)
    assert cache.shape == (nb, layers, 2, bs, heads, d + 4)
    kv = layer_kv_views(cache)
    gen = torch.Generator().manual_seed(0)
    for l in range(layers):
        for c, sc in ((kv[l].k_cache, kv[l].k_scale_cache), (kv[l].v_cache, kv[l].v_scale_cache)):
            c.copy_(torch.randint(-127, 128, c.shape, generator=gen, dtype=torch.int8))
            sc.copy_(torch.rand(sc.shape, generator=gen) + 0.5)
            assert c.stride(1) % 16 == 0 and c.stride(2) % 16 == 0 and c.data_ptr() % 16 == 0
    region = bs * heads * (d + 4)
    for b in range(nb):
        for l in range(layers):
            for t, (c, sc) in enumerate(((kv[l].k_cache, kv[l].k_scale_cache), (kv[l].v_cache, kv[l].v_scale_cache))):
                raw = cache[b, l, t].reshape(region)
                assert torch.equal(raw[:bs * heads * d].view(bs, heads, d), c[b])
                assert torch.equal(raw[bs * heads * d:].view(torch.float32).view(heads, bs), sc[b].t())


def test_head_dim_not_a_multiple_of_4_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype=int8: head_dim=18 must be a multiple of 4"):
        allocate_kv_cache(1, 1, 16, 1, 18, torch.int8, "cpu")


@pytest.mark.slow
def test_int8_kv_next_token_agrees_on_smollm2(smollm2_dir):
    """Teacher-forced over a chat prompt (as test_fp8_kv.py): the argmax at each position with the int8 cache equals
    the fp32 cache's at >= 97% of positions; docs/kernels.md has the measured numbers."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_parity import step_logits

    msgs = [{"role": "user", "content": "Explain how a bicycle works."}]
    logits = {}
    for kv in ("auto", "int8"):
        llm = LLM("smollm2", device="cpu", kv_cache_memory=0.2, max_model_len=2048, kv_cache_dtype=kv)
        tok = llm.get_tokenizer()
        ids = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False).input_ids
        logits[kv] = step_logits(llm, ids)
    a, b = logits["auto"], logits["int8"]
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    rel = ((b - a).norm(dim=-1) / a.norm(dim=-1)).mean().item()
    print(f"smollm2 int8 KV vs float32 KV, teacher-forced over {a.shape[0]} positions: argmax agreement {agree:.1%}, "
          f"mean logits relative error {rel:.2%}")
    assert agree >= 0.97, f"next-token agreement {agree:.1%}"
    assert rel < 0.05, f"mean logits relative error {rel:.3f}"


def test_int8_kv_stacks_on_4_bit_and_fp8_weights(tiny_qwen2_dir, tmp_path):
    """--kv-cache-dtype int8 with a 4-bit (AWQ) checkpoint and with --quantization fp8: both load and decode.
    Teacher-forced against the same weights with float32 KV, measured (2026-12-02, CPU): float weights 99.7% argmax
    agreement / 0.82% mean logits error, AWQ g32 98.3% / 0.75%, fp8 weights 89.4% / 7.4% (fp8 weights quantize
    each activation row to fp8, which turns the cache's small differences into whole fp8 steps; not investigated
    further). docs/quantization.md."""
    from test_cuda_parity import step_logits
    from test_quant_w4 import PROBE, teacher_forced, write_w4_checkpoint

    ckpt = write_w4_checkpoint(tiny_qwen2_dir, tmp_path / "w4", "awq", 32)
    kw = dict(device="cpu", kv_cache_memory=0.02, max_model_len=512)
    gen = torch.Generator().manual_seed(3)
    probes = [torch.randint(300, 512, (n,), generator=gen).tolist() + PROBE[:24] for n in (9, 30, 64, 150)]
    measured = {}
    for name, model, extra in (("float", str(tiny_qwen2_dir), {}), ("awq-g32", str(ckpt), {}),
                               ("fp8-weights", str(tiny_qwen2_dir), {"quantization": "fp8"})):
        base, int8 = LLM(model, **kw, **extra), LLM(model, kv_cache_dtype="int8", **kw, **extra)
        assert int8.engine.runner.kv_dtype == torch.int8
        assert len(int8.generate([{"prompt_token_ids": PROBE[:5]}], GREEDY)[0].outputs[0].token_ids) == 24
        measured[name] = teacher_forced([step_logits(base, p) for p in probes], [step_logits(int8, p) for p in probes])
    print("int8 KV vs float32 KV on the same weights (argmax agreement, mean logits rel. error):", measured)
    bounds = {"float": (0.97, 0.02), "awq-g32": (0.95, 0.02), "fp8-weights": (0.85, 0.10)}
    for name, (agree, rel) in measured.items():
        assert agree >= bounds[name][0] and rel < bounds[name][1], (name, agree, rel)
