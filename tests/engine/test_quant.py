"""engine/quant.py: online fp8 weight quantization (`--quantization fp8`) on the CPU path, and on CUDA where present."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import engine.quant as quant
import kernels.gemv as gemv
from engine import LLM, EngineArgs, SamplingParams
from engine.quant import (Fp8Linear, check_fp8_support, fp8_linear_ref, quantize_model, quantize_weight_fp8,
                          scaled_mm_fp8)
from kernels._checks import FP8_DTYPE, FP8_MAX
from kernels.quant_fp8 import per_token_quant_fp8_ref

ON_CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")


def linear(n_in: int, n_out: int, bias: bool, seed: int = 0) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        # Rows of very different magnitudes: each output channel gets its own scale.
        lin.weight.copy_(torch.randn(n_out, n_in, generator=g) * torch.logspace(-3, -1, n_out)[:, None])
        if bias:
            lin.bias.copy_(torch.randn(n_out, generator=g) * 0.1)
    return lin


def test_weight_round_trip_per_channel():
    w = linear(512, 256, bias=False).weight.detach()
    before = w.clone()
    q, s = quantize_weight_fp8(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and s.shape == (256, 1) and s.dtype == torch.float32
    assert torch.equal(w, before), "quantizing must not touch the source weight"
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((256,), FP8_MAX)), "each row's amax maps to 448"
    err = q.float() * s - w
    # Round to nearest with 3 mantissa bits: at most half an ulp of the top binade [256, 448) = 16/448 of the amax.
    assert (err.abs().amax(dim=1) <= w.abs().amax(dim=1) * 16 / FP8_MAX * (1 + 1e-6)).all()
    # Measured: per-row relative RMS error 2.63% mean, 2.88% max (e4m3's 3 mantissa bits, whatever the row's scale).
    rel = err.norm(dim=1) / w.norm(dim=1)
    assert rel.mean() < 0.03 and rel.max() < 0.035, (rel.mean(), rel.max())


def test_zero_rows_quantize_to_zero():
    q, s = quantize_weight_fp8(torch.zeros(16, 32))
    assert (q.float() == 0).all() and torch.isfinite(s).all() and (s > 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_close_to_the_linear(dtype, bias):
    lin = linear(512, 256, bias).to(dtype)
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(1)).to(dtype)
    f = Fp8Linear.from_linear(lin)
    assert f.weight.dtype == FP8_DTYPE and f.weight_scale.shape == (1, 256) and f.weight.is_contiguous()
    with torch.no_grad():
        y, y_ref = f(x), lin(x)
    assert y.dtype == dtype and y.shape == (64, 256)
    # Both operands rounded to e4m3 (about 2.6% RMS each): measured 3.6% relative error (fp32), 3.6% (bf16).
    rel = ((y.float() - y_ref.float()).norm() / y_ref.float().norm()).item()
    assert rel < 0.05, rel
    # Leading dims pass through.
    torch.testing.assert_close(f(x.reshape(4, 16, 512)), y.reshape(4, 16, 256))


def test_cpu_path_is_the_dequantized_product():
    """The CPU forward equals (x_q * s_x) @ (w_q * s_w)^T + b computed in float32 on dequantized operands."""
    lin = linear(96, 48, bias=True)
    f = Fp8Linear.from_linear(lin)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(2))
    x_q, x_s = per_token_quant_fp8_ref(x)
    expected = (x_q.float() * x_s) @ (f.weight.float() * f.weight_scale.t()).t() + f.bias
    torch.testing.assert_close(f(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(ON_CUDA, reason="checks torch's CPU _scaled_mm; the CUDA one is checked below")
def test_scaled_mm_arguments_agree_with_the_reference_on_cpu():
    """The exact call the CUDA forward makes (layouts, scale shapes, bias, output dtype), run by torch's CPU
    _scaled_mm where this torch build has one, against the float32 reference."""
    f = Fp8Linear.from_linear(linear(128, 64, bias=True).to(torch.bfloat16))
    x_q, x_s = per_token_quant_fp8_ref(torch.randn(9, 128).bfloat16())
    try:
        y = scaled_mm_fp8(x_q, x_s, f.weight, f.weight_scale, f.bias, torch.bfloat16, use_fast_accum=False)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm on the CPU: {e}")
    ref = fp8_linear_ref(x_q, x_s, f.weight, f.weight_scale, f.bias, torch.bfloat16)
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_quantize_model_replaces_the_layer_linears_only():
    llm = LLM("random:tiny-qwen2", device="cpu", kv_cache_memory=0.01, max_model_len=256, quantization="fp8")
    model = llm.engine.runner.model
    for layer in model.model.layers:
        for name in ("qkv_proj", "o_proj"):
            assert isinstance(getattr(layer.self_attn, name), Fp8Linear), name
        for name in ("gate_up_proj", "down_proj"):
            assert isinstance(getattr(layer.mlp, name), Fp8Linear), name
        assert layer.self_attn.qkv_proj.bias is not None  # Qwen2's q/k/v biases stay, in the model dtype
    assert not any(isinstance(m, nn.Linear) for m in model.model.layers.modules())
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert quantize_model(model, None) is model


def test_bad_quantization_names_the_field():
    with pytest.raises(ValueError, match=r"quantization='int4': must be one of None, fp8"):
        EngineArgs(model="random:tiny", quantization="int4").create_engine_config()
    with pytest.raises(ValueError, match=r"quantization='fp16': must be one of None, fp8"):
        LLM("random:tiny", device="cpu", quantization="fp16")


def test_cuda_requirements_are_named(monkeypatch):
    """Checked without a GPU: the checks read only the device's capability and name."""
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"quantization='fp8' with dtype=float32: .*bfloat16 or float16"):
        check_fp8_support(cuda, torch.float32)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"NVIDIA A100-SXM4-80GB \(cuda\) is sm_80; fp8 GEMMs need compute "
                                         r"capability >= 8.9"):
        check_fp8_support(cuda, torch.bfloat16)
    check_fp8_support(torch.device("cpu"), torch.float32)  # the CPU path takes any dtype


def greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def step_logits(llm: LLM, tokens: list[int]) -> torch.Tensor:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_parity import step_logits as logits_at_every_position

    return logits_at_every_position(llm, tokens)


def test_greedy_tokens_agree_with_the_unquantized_model(tiny_qwen2_dir):
    """Tiny Qwen2 (3 layers, random weights, fp32 on the CPU), 8 prompts x 24 greedy tokens through the offline API.
    Measured (2026-11-30), fp8 against the unquantized model, bf16 weights against it as a yardstick:
    - teacher-forced over prompt + the unquantized continuation: next-token argmax equal at 78.7% (477 of 606)
      positions; bf16 97.5%. Mean relative error of the logits 12.2%; bf16 1.2%. Weights alone (activations
      unquantized) give 9.3%, activations alone 7.4%: e4m3's 3 mantissa bits through 12 random linears, whose
      logits lie close together (top-2 margins 0.02-0.7 against a spread of 0.8).
    - free-running: first tokens equal for 5 of 8 prompts, position-wise 26% (50 of 192); bf16 8 of 8 and 85%.
      After the first flipped near-tie the continuations differ."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(300, 512, (n,), generator=g).tolist() for n in (3, 9, 17, 30, 41, 64, 100, 150)]
    kw = dict(device="cpu", kv_cache_memory=0.02, max_model_len=512)
    base, fp8 = LLM(str(tiny_qwen2_dir), **kw), LLM(str(tiny_qwen2_dir), quantization="fp8", **kw)
    ref = greedy(base, prompts, 24)
    got = greedy(fp8, prompts, 24)
    assert [len(t) for t in got] == [24] * len(prompts)
    agree = total = 0
    rel = []
    for p, cont in zip(prompts, ref):
        a, b = step_logits(base, p + cont), step_logits(fp8, p + cont)
        agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
        total += a.shape[0]
        rel.append(((b - a).norm(dim=-1) / a.norm(dim=-1)).mean().item())
    assert agree / total >= 0.7, f"teacher-forced agreement {agree}/{total}"
    assert sum(rel) / len(rel) < 0.16, f"mean logits relative error {sum(rel) / len(rel):.3f}"
    first = sum(a[0] == b[0] for a, b in zip(ref, got))
    assert first >= 4, f"first tokens: {first} of {len(prompts)}"


@pytest.mark.slow
def test_fp8_next_token_agrees_on_smollm2(smollm2_dir):
    """SmolLM2-135M-Instruct, teacher-forced over a chat (prompt and a fixed answer, 120 positions). Measured
    (2026-11-30): argmax equal at 87.5% (105 of 120) positions, logits relative error 18.4%; bf16 weights against
    fp32: 98.3%, 1.7%. Weights alone give 9.7% (93.3%), activations alone 9.5% (95.0%): down_proj's inputs carry
    per-token outliers up to 25,000x the row's median, which push the small entries into e4m3's subnormals."""
    msgs = [{"role": "user", "content": "Explain how a bicycle works."},
            {"role": "assistant", "content": "A bicycle turns the push of your legs into forward motion. The pedals "
             "turn a crank, the crank turns the front sprocket, and a chain carries that rotation to a smaller "
             "sprocket on the rear wheel, so one turn of the pedals turns the wheel more than once. You steer with "
             "the handlebars, and the brakes press pads against the rim or a disc to slow you down."}]
    logits = {}
    for q in (None, "fp8"):
        llm = LLM("smollm2", device="cpu", kv_cache_memory=0.2, max_model_len=2048, quantization=q)
        tok = llm.get_tokenizer()
        ids = tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False).input_ids
        logits[q] = step_logits(llm, ids)
    a, b = logits[None], logits["fp8"]
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    rel = ((b - a).norm(dim=-1) / a.norm(dim=-1)).mean().item()
    assert agree >= 0.83, f"next-token agreement {agree:.1%}"
    assert rel < 0.22, f"mean logits relative error {rel:.3f}"


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 3584, 4608), (300, 18944, 3584), (17, 64, 48)])
def test_cuda_fp8_linear_matches_the_reference(shape, monkeypatch):
    """torch._scaled_mm + the Triton activation quantizer against the float32 reference on the same operands."""
    monkeypatch.setattr(gemv, "CONFIGS_FP8", {})  # no GEMV at small M: the quantizer + _scaled_mm path at every M
    m, k, n = shape
    lin = linear(k, n, bias=True).to("cuda", torch.bfloat16)
    f = Fp8Linear.from_linear(lin)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x_q, x_s = per_token_quant_fp8_ref(x)
    ref = fp8_linear_ref(x_q, x_s, f.weight, f.weight_scale, f.bias, torch.float32)
    y = f(x)
    assert y.dtype == torch.bfloat16
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel  # bf16 output rounding (~0.3%) and fast accumulation
    rel_lin = ((y.float() - lin(x).float()).norm() / lin(x).float().norm()).item()
    assert rel_lin < 0.05, rel_lin


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_fp8_linear_small_m_uses_the_gemv(m, bias, monkeypatch):
    """Where CONFIGS_FP8 has a config, Fp8Linear runs the fp8-weight GEMV on unquantized x: no activation quantizer,
    and the result matches the dequantized-weight reference at bf16 output rounding; against the unquantized linear
    it is closer than the quantizer + _scaled_mm path (weights rounded to e4m3, activations not)."""
    k, n = 3584, 4608
    lin = linear(k, n, bias=bias).to("cuda", torch.bfloat16)
    f = Fp8Linear.from_linear(lin)
    split, dot = gemv.GemvConfig(8, 512, 3, 4, 2, "fma"), gemv.GemvConfig(64, 128, 2, 4, 3, "dot")
    monkeypatch.setattr(gemv, "CONFIGS_FP8", {(n, k): ((2, split), (16, dot))})
    calls = []

    def spy(*args, **kw):
        calls.append(kw["config"])
        return gemv.gemv_triton(*args, **kw)

    monkeypatch.setattr(quant, "gemv_triton", spy)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y = f(x)
        exact = lin(x).float()
        monkeypatch.setattr(gemv, "CONFIGS_FP8", {})
        y_mm = f(x).float()  # the quantizer + _scaled_mm on the same module
    assert calls == [split if m <= 2 else dot]
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = gemv.gemv_ref(x, f.weight, f.bias, weight_scale=f.weight_scale).float()  # float32 dequantized, x unquantized
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel  # bf16 output rounding (~0.3%): the large-M path's tolerance against its own reference
    rel_lin = ((y.float() - exact).norm() / exact.norm()).item()
    rel_mm = ((y_mm - exact).norm() / exact.norm()).item()
    assert rel_lin < 0.05 and rel_lin < rel_mm, (rel_lin, rel_mm)


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("use_gemv", [False, True])
def test_cuda_llm_fp8_runs_with_graphs_and_agrees(tmp_path, use_gemv, monkeypatch):
    """The engine on CUDA with fp8 GEMMs (decode and prefill steps replayed as CUDA graphs): greedy generation runs,
    and teacher-forced next tokens agree with bf16 weights about as on the CPU (78.7% there, fp8 against fp32).
    use_gemv: CONFIGS_FP8 holds tiny-qwen2's four linears at 1..16 rows (split-K for two of them), so the decode
    graphs capture the fp8-weight GEMV (its split-K counters made in the warm-up before capture)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_parity import build_random_dir

    calls = []
    if use_gemv:  # tiny-qwen2: hidden 64, intermediate 128, 4 + 2 * 2 heads of 16
        fma_split, dot = gemv.GemvConfig(8, 32, 2, 4, 2, "fma"), gemv.GemvConfig(16, 64, 1, 4, 3, "dot")
        monkeypatch.setattr(gemv, "CONFIGS_FP8", {
            (128, 64): ((4, gemv.GemvConfig(8, 64, 1, 4, 1, "fma_late")), (16, dot)),
            (64, 64): ((16, dot),), (256, 64): ((2, fma_split), (16, dot)), (64, 128): ((16, fma_split),)})

        def spy(*args, **kw):
            calls.append(args[0].shape[0])
            return gemv.gemv_triton(*args, **kw)

        monkeypatch.setattr(quant, "gemv_triton", spy)
    model_dir = str(build_random_dir(tmp_path, "tiny-qwen2", seed=1, std=0.1))
    kw = dict(dtype="bfloat16", max_model_len=512, kv_cache_memory=1.0)
    base, fp8 = LLM(model_dir, **kw), LLM(model_dir, quantization="fp8", **kw)
    assert fp8.engine.runner.graphs is not None
    prompts = [list(range(300, 300 + n)) for n in (5, 37, 130)]
    ref, got = greedy(base, prompts, 16), greedy(fp8, prompts, 16)
    assert [len(t) for t in got] == [16] * len(prompts)
    agree = total = 0
    for p, cont in zip(prompts, ref):
        a, b = step_logits(base, p + cont), step_logits(fp8, p + cont)
        agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
        total += a.shape[0]
    assert agree / total >= 0.7, f"teacher-forced agreement {agree}/{total}"
    assert bool(calls) == use_gemv and all(m <= 16 for m in calls)
    with pytest.raises(ValueError, match="quantization='fp8' with dtype=float32"):
        LLM(model_dir, dtype="float32", quantization="fp8", max_model_len=512, kv_cache_memory=1.0)
