"""The engine on CUDA (Triton kernels on the hot path) against transformers and against itself across dtypes.

Runs only where CUDA is available (the H200); the CPU suite covers the same paths with the torch references.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def build_random_dir(tmp_path, preset: str, seed: int, std: float, bf16_exact: bool = False):
    from transformers import AutoModelForCausalLM

    from engine.presets import preset_config
    from engine.tokenizer import synthetic_tokenizer

    cfg = preset_config(preset)
    cfg.initializer_range = std
    cfg.dtype = "float32"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if getattr(cfg, "architectures", ["x"])[0] == "Qwen2ForCausalLM":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, std)
    if bf16_exact:  # weights representable in bf16: the fp32 and bf16 runs then compute with the same model
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(tmp_path, safe_serialization=True)
    synthetic_tokenizer(cfg.vocab_size).save_pretrained(tmp_path)
    return tmp_path


def prompts_for(vocab: int, lens=(5, 37, 130, 300)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(300, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def smollm2_shape_dir(tmp_path_factory):
    return build_random_dir(tmp_path_factory.mktemp("smollm2-shape"), "smollm2-135m", seed=0, std=0.05,
                            bf16_exact=True)


@pytest.fixture(scope="module")
def smollm2_shape_bf16_dir(tmp_path_factory):
    """transformers' own init (std 0.02), weights rounded to bf16: 30 layers of random weights amplify rounding, and
    at std 0.05 even transformers' bf16 is 65% off its fp32 logits; at 0.02 it is about 1.5%."""
    return build_random_dir(tmp_path_factory.mktemp("smollm2-shape-bf16"), "smollm2-135m", seed=0, std=0.02,
                            bf16_exact=True)


@pytest.fixture(scope="module")
def tiny_qwen2_cuda_dir(tmp_path_factory):
    return build_random_dir(tmp_path_factory.mktemp("tiny-qwen2"), "tiny-qwen2", seed=1, std=0.1)


def hf_greedy_cuda(model_dir, prompts, max_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                               do_sample=False, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
    del model
    torch.cuda.empty_cache()
    return outs


@pytest.mark.parametrize("fixture", ["smollm2_shape_dir", "tiny_qwen2_cuda_dir"])
def test_fp32_greedy_matches_transformers_on_cuda(request, fixture):
    from engine import LLM, SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = request.getfixturevalue(fixture)
    llm = LLM(str(model_dir), dtype="float32", device="cuda", kv_cache_memory=2.0, max_num_batched_tokens=128,
              max_num_seqs=MAX_SEQS)
    prompts = prompts_for(llm.engine.runner.hf_config.vocab_size)
    expected = hf_greedy_cuda(model_dir, prompts, 64)
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    got = [o.outputs[0].token_ids for o in outs]
    agree = [sum(a == b for a, b in zip(g, e)) / len(e) for g, e in zip(got, expected)]
    assert got == expected, f"per-prompt agreement {agree}"


MAX_SEQS = 16  # a handful of decode CUDA graphs instead of one per 8 rows up to 256: each engine starts faster


def step_logits(llm, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, computed as one prefill through the engine's runner."""
    from engine.request import Request
    from engine.sampling_params import SamplingParams
    from engine.scheduler import SchedulerOutput

    eng = llm.engine
    req = Request("probe", tokens, SamplingParams(max_tokens=1), 1)
    assert eng.kv.allocate_slots(req, len(tokens))
    try:
        req.num_computed_tokens = len(tokens)  # as the scheduler leaves it: advanced past the step's tokens
        sched = SchedulerOutput(scheduled=[(req, len(tokens))], samples=[True])
        inputs = eng.runner.prepare_inputs(sched, [eng.kv.get_block_ids("probe")])
        with torch.inference_mode():
            hidden = eng.runner.model(inputs.input_ids, inputs.positions, eng.runner.kv_layers, inputs.meta)
            return eng.runner.model.compute_logits(hidden).float()
    finally:
        req.status = req.status.FINISHED_ABORTED
        eng.kv.free(req)


def hf_logits(model_dir, seq, dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    with torch.no_grad():
        out = model(torch.tensor([seq], device="cuda")).logits[0].float()
    del model
    torch.cuda.empty_cache()
    return out


def test_bf16_logits_within_1e2_of_fp32(smollm2_shape_bf16_dir):
    from engine import LLM, SamplingParams

    smollm2_shape_dir = smollm2_shape_bf16_dir
    llm32 = LLM(str(smollm2_shape_dir), dtype="float32", device="cuda", kv_cache_memory=1.0, max_num_seqs=MAX_SEQS)
    prompt = prompts_for(llm32.engine.runner.hf_config.vocab_size, lens=(200,))[0]
    out = llm32.generate(prompt_token_ids=[prompt],
                         sampling_params=SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))[0]
    seq = prompt + out.outputs[0].token_ids
    ref = step_logits(llm32, seq)
    del llm32
    llm16 = LLM(str(smollm2_shape_dir), dtype="bfloat16", device="cuda", kv_cache_memory=1.0, max_num_seqs=MAX_SEQS)
    got = step_logits(llm16, seq)
    rel = ((got - ref).norm(dim=-1) / ref.norm(dim=-1))[len(prompt) - 1:]  # each generated step
    print(f"bf16 vs fp32 logits: max relative error {rel.max().item():.3e}, mean {rel.mean().item():.3e}")
    hf32, hf16 = hf_logits(smollm2_shape_dir, seq, torch.float32), hf_logits(smollm2_shape_dir, seq, torch.bfloat16)
    hf_rel = ((hf16 - hf32).norm(dim=-1) / hf32.norm(dim=-1))[len(prompt) - 1:]
    print(f"  (transformers bf16 vs its fp32: max {hf_rel.max().item():.3e}, mean {hf_rel.mean().item():.3e}; "
          f"our fp32 vs transformers fp32: max {((ref - hf32).norm(dim=-1) / hf32.norm(dim=-1)).max().item():.3e})")
    # With the residual stream rounded to bf16 after every add this model measured 1.40e-2 on the H200
    # (transformers' own bf16: 1.45e-2); the float32 residual stream brought it to 8.1e-3 on the CPU.
    assert (ref - hf32).norm() / hf32.norm() < 1e-4
    assert rel.max().item() < 1e-2, f"max relative error {rel.max().item():.3e} (issue 4: each step within 1e-2)"


def greedy(llm, prompts, n):
    from engine import SamplingParams

    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0.0, max_tokens=n,
                                                                                 ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, list[int]]:
    """Position-wise agreement of two sets of free-running outputs, and where each pair first differs."""
    same = sum(x == y for ga, gb in zip(a, b) for x, y in zip(ga, gb)) / sum(len(g) for g in b)
    first = [next((i for i, (x, y) in enumerate(zip(ga, gb)) if x != y), len(gb)) for ga, gb in zip(a, b)]
    return same, first


def test_fp8_kv_agrees_with_bf16(smollm2_shape_bf16_dir):
    """fp8 KV (calibrated per-layer scales) against bf16 KV, bf16 weights, 4 prompts x 256 greedy tokens.

    Teacher-forced: the next-token choice at each position of the bf16 run's sequences, with fp8 KV (issue 4's 95%).
    Free-running: position-wise agreement of the two greedy outputs; once a near-tie flips one token, the rest of
    that output differs, so fp32 weights against bf16 weights (each with its own-dtype KV) are printed
    beside it as the yardstick of how fragile greedy decoding of this model is. Each disagreement's bf16 top-2 logit
    margin is printed too: a flip where fp8 moved the logits more than that margin is rounding, not a bug."""
    from engine import LLM

    prompts = prompts_for(49152, lens=(64, 64, 64, 64))
    n = 256
    runs, logits = {}, {}
    seqs = None
    for name, dtype, kv_dtype in (("bf16", "bfloat16", "auto"), ("fp8", "bfloat16", "fp8"),
                                  ("fp32", "float32", "auto")):
        llm = LLM(str(smollm2_shape_bf16_dir), dtype=dtype, device="cuda", kv_cache_memory=1.0,
                  kv_cache_dtype=kv_dtype, max_num_seqs=MAX_SEQS)
        runs[name] = greedy(llm, prompts, n)
        if seqs is None:
            seqs = [p + g for p, g in zip(prompts, runs[name])]
        if name != "fp32":
            logits[name] = torch.cat([step_logits(llm, s)[len(p) - 1:-1] for s, p in zip(seqs, prompts)])
        if kv_dtype == "fp8":
            r = llm.engine.runner
            print(f"fp8 KV scales, first layers: K {r.k_scales[:4]} V {r.v_scales[:4]}")
        del llm
        torch.cuda.empty_cache()
    a, b = logits["bf16"], logits["fp8"]
    teacher = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    rel = ((b - a).norm(dim=-1) / a.norm(dim=-1))
    free, first = agreement(runs["fp8"], runs["bf16"])
    yard, yard_first = agreement(runs["fp32"], runs["bf16"])
    top2 = a.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    flips = a.argmax(-1) != b.argmax(-1)
    moved = (b - a).abs().amax(dim=-1)
    print(f"fp8 vs bf16 KV: teacher-forced next-token agreement {teacher:.1%} over {len(a)} positions; logits "
          f"relative error max {rel.max().item():.3e} mean {rel.mean().item():.3e}; free-running agreement "
          f"{free:.1%} (first difference at {first})")
    print(f"  yardstick, fp32 vs bf16 weights (bf16 KV), free-running: {yard:.1%} (first difference at {yard_first})")
    print(f"  bf16 top-2 margin: median {margin.median().item():.3f}; at the {int(flips.sum())} flips "
          f"{[round(x, 3) for x in margin[flips].tolist()]}, fp8's largest logit change there "
          f"{[round(x, 3) for x in moved[flips].tolist()]}")
    # e4m3 keeps 3 mantissa bits (relative step 1/16): the logits move by a few percent, not more.
    assert rel.mean().item() < 0.1
    assert teacher >= 0.95, f"teacher-forced agreement {teacher:.1%} (issue 4: >= 95%)"


def test_int8_kv_decode_agrees_with_prefill(smollm2_shape_bf16_dir):
    """int8 KV on CUDA, bf16 weights, 4 prompts x 128 greedy tokens. Decode steps read the int8 cache in 32-bit words
    (fp16 dots, kernels/paged_attention.py); a prefill over the same sequences reads it value by value (bf16 dots).
    Teacher-forced over each run's own sequences, the prefill's next-token choice must equal what decode chose at
    >= 95% of positions (bf16 KV's own decode-vs-prefill agreement is printed beside it as the yardstick), and over
    the bf16 run's sequences int8's logits stay within 5% of bf16 KV's."""
    from engine import LLM

    prompts = prompts_for(49152, lens=(64, 64, 64, 64))
    n = 128
    agree, logits, seqs = {}, {}, None
    for kv_dtype in ("auto", "int8"):
        llm = LLM(str(smollm2_shape_bf16_dir), dtype="bfloat16", device="cuda", kv_cache_memory=1.0,
                  kv_cache_dtype=kv_dtype, max_num_seqs=MAX_SEQS)
        outs = greedy(llm, prompts, n)
        own = [p + g for p, g in zip(prompts, outs)]
        seqs = seqs or own
        forced = torch.cat([step_logits(llm, s)[len(p) - 1:-1] for s, p in zip(own, prompts)])  # [4 * n, vocab]
        chosen = torch.tensor([t for g in outs for t in g], device=forced.device)
        agree[kv_dtype] = (forced.argmax(-1) == chosen).float().mean().item()
        logits[kv_dtype] = torch.cat([step_logits(llm, s)[len(p) - 1:-1] for s, p in zip(seqs, prompts)]).float()
        del llm
        torch.cuda.empty_cache()
    a, b = logits["auto"], logits["int8"]
    rel = ((b - a).norm(dim=-1) / a.norm(dim=-1)).mean().item()
    print(f"decode's greedy tokens = prefill's argmax over the same sequences: int8 KV {agree['int8']:.1%}, bf16 KV "
          f"{agree['auto']:.1%}; int8 vs bf16 KV teacher-forced logits mean relative error {rel:.3e}")
    assert agree["int8"] >= 0.95, agree
    assert rel < 0.05, rel


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_kernels_on_the_engine_cache_layout(kv_dtype):
    """write_kv and paged_attention on strided views of one [blocks, layers, 2, block, kv_heads, dim] tensor,
    a prefill chunk and decodes in one batch, against the references on the same views."""
    import kernels
    from kernels import paged_attention_ref, write_kv_ref

    torch.manual_seed(0)
    nb, L, bs, hkv, d, h = 64, 3, 16, 4, 128, 28
    cache = torch.randn(nb, L, 2, bs, hkv, d, device="cuda").to(kv_dtype)
    ref_cache = cache.clone()
    layer = 1
    seq_lens = torch.tensor([100, 37, 250], dtype=torch.int32, device="cuda")
    q_lens = [100, 1, 1]
    qsl = torch.tensor([0, 100, 101, 102], dtype=torch.int32, device="cuda")
    perm = torch.randperm(nb, device="cuda")
    tables = torch.zeros(3, 16, dtype=torch.int32, device="cuda")
    tables[0, :7], tables[1, :3], tables[2, :16] = perm[:7], perm[7:10], perm[10:26]
    slots = []
    for i, (sl, ql) in enumerate(zip(seq_lens.tolist(), q_lens)):
        for p in range(sl - ql, sl):
            slots.append(int(tables[i, p // bs]) * bs + p % bs)
    slots = torch.tensor(slots, dtype=torch.int64, device="cuda")
    T = len(slots)
    k = torch.randn(T, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, hkv, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(T, h, d, device="cuda", dtype=torch.bfloat16)
    ks, vs = 0.5, 0.25
    kernels.write_kv(k, v, cache[:, layer, 0], cache[:, layer, 1], slots, ks, vs)
    write_kv_ref(k, v, ref_cache[:, layer, 0], ref_cache[:, layer, 1], slots, ks, vs)
    same = (cache.view(torch.uint8) == ref_cache.view(torch.uint8)).float().mean().item()
    assert same > 0.999, f"only {same:.4%} of the cache bytes equal the reference write"
    assert torch.equal(cache[:, 0].view(torch.uint8), ref_cache[:, 0].view(torch.uint8)), "another layer was touched"
    out = kernels.paged_attention(q, cache[:, layer, 0], cache[:, layer, 1], tables, seq_lens, qsl, 100, 250,
                                  d ** -0.5, ks, vs)
    ref = paged_attention_ref(q, ref_cache[:, layer, 0], ref_cache[:, layer, 1], tables, seq_lens, qsl, 100, 250,
                              d ** -0.5, ks, vs)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 2e-2, f"relative error {rel:.3e}"


def test_prefill_graphs_match_eager_on_cuda(tiny_qwen2_cuda_dir):
    """Prompt steps replayed as CUDA graphs (padded tokens, a padding sequence, empty rows) against the same steps
    run eagerly: same greedy tokens, logprobs within float32 GEMM reordering."""
    from engine import LLM, SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    outs = {}
    for graphs in (0, 1024):
        llm = LLM(str(tiny_qwen2_cuda_dir), dtype="float32", device="cuda", kv_cache_memory=1.0,
                  max_num_batched_tokens=256, max_num_seqs=MAX_SEQS, max_prefill_cudagraph_tokens=graphs)
        prompts = prompts_for(llm.engine.runner.hf_config.vocab_size, lens=(5, 37, 130, 300, 16, 17, 64, 250))
        pg = llm.engine.runner.prefill_graphs
        assert (pg is None) == (graphs == 0)
        replays = []
        if pg is not None:
            run = pg.run
            pg.run = lambda key, *a: replays.append(key) or run(key, *a)
        outs[graphs] = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        if pg is not None:
            assert len(replays) >= 3 and any(s > 2 for _, s in replays), replays
        del llm
        torch.cuda.empty_cache()
    for a, b in zip(outs[0], outs[1024]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok, lp in la.items():
                assert lb[tok] == pytest.approx(lp, abs=1e-3)
