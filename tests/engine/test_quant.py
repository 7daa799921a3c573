"""engine/quant.py: online fp8 weight quantization (`--quantization fp8`) on the CPU path, and on CUDA where present."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

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


# --- the norms and the activation write the fp8 linears' inputs (engine/fp8_fusion.py) ----------------------------

def fused_modules(llm: LLM) -> list[str]:
    from engine.fp8_fusion import Fp8InputMLP, Fp8InputRMSNorm

    return [name for name, m in llm.engine.runner.model.named_modules()
            if isinstance(m, (Fp8InputRMSNorm, Fp8InputMLP))]


def test_fused_fp8_input_quant_is_off_on_the_cpu_by_default(monkeypatch):
    monkeypatch.delenv("TANDEM_FUSED_FP8_QUANT", raising=False)
    llm = LLM("random:tiny-qwen2", device="cpu", kv_cache_memory=0.01, max_model_len=256, quantization="fp8")
    assert fused_modules(llm) == []
    monkeypatch.setenv("TANDEM_FUSED_FP8_QUANT", "yes")
    with pytest.raises(ValueError, match=r"TANDEM_FUSED_FP8_QUANT='yes': must be 0 or 1"):
        LLM("random:tiny-qwen2", device="cpu", kv_cache_memory=0.01, max_model_len=256, quantization="fp8")


def test_fused_fp8_input_quant_forced_on_the_cpu_gives_the_same_logits(monkeypatch):
    """TANDEM_FUSED_FP8_QUANT=1 on the CPU: every layer's two norms and its MLP are swapped (the parameters keep their
    names and tensors), the Fp8Linears get QuantizedActivations, and the logits at every position equal the unfused
    model's bit for bit (the CPU runs the references: rms_norm_ref / silu_and_mul_ref, then per_token_quant_fp8_ref,
    the same arithmetic as the CPU kernels then Fp8Linear's quantizer). The kernels themselves are tested against
    the unfused pair under the interpreter in tests/kernels (the model dispatches to Triton on CUDA only)."""
    kw = dict(device="cpu", kv_cache_memory=0.02, max_model_len=256, quantization="fp8")
    monkeypatch.setenv("TANDEM_FUSED_FP8_QUANT", "0")
    base = LLM("random:tiny-qwen2", **kw)
    monkeypatch.setenv("TANDEM_FUSED_FP8_QUANT", "1")
    fused = LLM("random:tiny-qwen2", **kw)
    n_layers = len(fused.engine.runner.model.model.layers)
    assert len(fused_modules(fused)) == 3 * n_layers and fused_modules(base) == []
    a_params = dict(base.engine.runner.model.named_parameters())
    b_params = dict(fused.engine.runner.model.named_parameters())
    assert a_params.keys() == b_params.keys() and all(torch.equal(a_params[k], b_params[k]) for k in a_params)
    seen = []
    orig = Fp8Linear.forward

    def spy(self, x):
        seen.append(type(x).__name__)
        return orig(self, x)

    monkeypatch.setattr(Fp8Linear, "forward", spy)
    tokens = list(range(300, 341))
    ref = step_logits(base, tokens)
    assert set(seen) == {"Tensor"}
    seen.clear()
    got = step_logits(fused, tokens)
    assert seen.count("QuantizedActivation") == 3 * n_layers and seen.count("Tensor") == n_layers  # o_proj
    assert torch.equal(got, ref)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton kernels: TRITON_INTERPRET=1")
def test_fused_fp8_input_quant_with_the_interpreted_kernels(monkeypatch):
    """The same model with every norm, activation and quantizer sent to its Triton launcher (interpreted on the CPU,
    as CUDA would dispatch them): the fused kernels inside the model give the unfused kernels' logits bit for bit."""
    import kernels
    from kernels.activation import silu_and_mul_quant_fp8_triton, silu_and_mul_triton
    from kernels.norm import (fused_add_rms_norm_quant_fp8_triton, fused_add_rms_norm_triton,
                              rms_norm_quant_fp8_triton, rms_norm_triton)
    from kernels.quant_fp8 import per_token_quant_fp8_triton

    kw = dict(device="cpu", kv_cache_memory=0.02, max_model_len=256, quantization="fp8")
    monkeypatch.setenv("TANDEM_FUSED_FP8_QUANT", "0")
    base = LLM("random:tiny-qwen2", **kw)
    monkeypatch.setenv("TANDEM_FUSED_FP8_QUANT", "1")
    fused = LLM("random:tiny-qwen2", **kw)
    for name, fn in (("rms_norm", rms_norm_triton), ("fused_add_rms_norm", fused_add_rms_norm_triton),
                     ("silu_and_mul", silu_and_mul_triton), ("rms_norm_quant_fp8", rms_norm_quant_fp8_triton),
                     ("fused_add_rms_norm_quant_fp8", fused_add_rms_norm_quant_fp8_triton),
                     ("silu_and_mul_quant_fp8", silu_and_mul_quant_fp8_triton)):
        monkeypatch.setattr(kernels, name, lambda *a, fn=fn, name=name: calls.append(name) or fn(*a))
    monkeypatch.setattr(quant, "per_token_quant_fp8_ref", per_token_quant_fp8_triton)  # Fp8Linear's CPU quantizer
    calls: list[str] = []
    tokens = list(range(300, 341))
    got = step_logits(fused, tokens)
    n = len(fused.engine.runner.model.model.layers)
    assert sorted(set(calls)) == ["fused_add_rms_norm", "fused_add_rms_norm_quant_fp8", "rms_norm_quant_fp8",
                                  "silu_and_mul_quant_fp8"] and calls.count("silu_and_mul_quant_fp8") == n
    calls.clear()
    assert torch.equal(got, step_logits(base, tokens))
    assert "rms_norm" in calls and "silu_and_mul" in calls and not any(c.endswith("quant_fp8") for c in calls)


def test_fused_fp8_input_quant_leaves_static_input_scales_alone(monkeypatch):
    """A linear with a static input_scale keeps its own quantizer: its norm (or activation) is not swapped."""
    from engine.fp8_fusion import Fp8InputMLP, Fp8InputRMSNorm, fuse_fp8_input_quant

    monkeypatch.setenv("TANDEM_FUSED_FP8_QUANT", "0")
    llm = LLM("random:tiny-qwen2", device="cpu", kv_cache_memory=0.01, max_model_len=256, quantization="fp8")
    model = llm.engine.runner.model
    layer = model.model.layers[0]
    layer.self_attn.qkv_proj.input_scale = nn.Parameter(torch.ones(1), requires_grad=False)
    layer.mlp.down_proj.input_scale = nn.Parameter(torch.ones(1), requires_grad=False)
    monkeypatch.setenv("TANDEM_FUSED_FP8_QUANT", "1")
    assert fuse_fp8_input_quant(model, torch.device("cpu")) == 3 * len(model.model.layers) - 2
    assert type(layer.input_layernorm).__name__ == "RMSNorm" and type(layer.mlp).__name__ == "MLP"
    assert isinstance(layer.post_attention_layernorm, Fp8InputRMSNorm)
    assert isinstance(model.model.layers[1].mlp, Fp8InputMLP)
    assert fuse_fp8_input_quant(model, torch.device("cpu")) == 0  # already swapped: nothing more


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("use_gemv", [False, True])
def test_cuda_fused_fp8_input_quant_is_bit_identical(tmp_path, use_gemv, monkeypatch):
    """On CUDA (the default there) the fused norm / activation kernels write what the unfused pair writes, so the
    fp8 model's logits at every position and its greedy tokens (prefill and decode replayed as CUDA graphs) equal
    those with TANDEM_FUSED_FP8_QUANT=0 exactly. use_gemv: decode at <= 16 rows takes the fp8 GEMV on 16-bit x, so
    the norms fall back to the plain kernel there, inside the same graphs."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_parity import build_random_dir

    if use_gemv:  # tiny-qwen2's four linears at 1..16 rows (as test_cuda_llm_fp8_runs_with_graphs_and_agrees)
        fma_split, dot = gemv.GemvConfig(8, 32, 2, 4, 2, "fma"), gemv.GemvConfig(16, 64, 1, 4, 3, "dot")
        monkeypatch.setattr(gemv, "CONFIGS_FP8", {
            (128, 64): ((4, gemv.GemvConfig(8, 64, 1, 4, 1, "fma_late")), (16, dot)),
            (64, 64): ((16, dot),), (256, 64): ((2, fma_split), (16, dot)), (64, 128): ((16, fma_split),)})
    model_dir = str(build_random_dir(tmp_path, "tiny-qwen2", seed=1, std=0.1))
    kw = dict(dtype="bfloat16", max_model_len=512, kv_cache_memory=1.0, quantization="fp8")
    monkeypatch.setenv("TANDEM_FUSED_FP8_QUANT", "0")
    base = LLM(model_dir, **kw)
    monkeypatch.delenv("TANDEM_FUSED_FP8_QUANT")
    fused = LLM(model_dir, **kw)
    assert fused_modules(base) == [] and len(fused_modules(fused)) == 3 * len(fused.engine.runner.model.model.layers)
    assert fused.engine.runner.graphs is not None
    prompts = [list(range(300, 300 + n)) for n in (5, 37, 130)] + [list(range(400, 420))] * 20  # decode at 23 rows
    ref, got = greedy(base, prompts, 16), greedy(fused, prompts, 16)
    assert got == ref
    for p, cont in zip(prompts[:3], ref):
        assert torch.equal(step_logits(fused, p + cont), step_logits(base, p + cont))


# --- checkpoints stored in fp8 -------------------------------------------------------------------------------------

LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")


def quantization_config(method: str, per_channel: bool = True, static: bool = False, ignore=()) -> dict:
    """config.json's quantization_config as vLLM's Fp8Config or llm-compressor's FP8_DYNAMIC / FP8 schemes write it."""
    if method == "fp8":
        assert not per_channel, "vLLM's fp8 format has one weight scale per tensor"
        return {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
                "ignored_layers": list(ignore)}
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None}
    acts = ({**fp8, "strategy": "tensor", "dynamic": False, "observer": "minmax"} if static
            else {**fp8, "strategy": "token", "dynamic": True, "observer": None})
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {**fp8, "strategy": "channel" if per_channel else "tensor", "dynamic": False,
                        "observer": "minmax"},
            "input_activations": acts, "output_activations": None}},
        "ignore": ["lm_head", *ignore], "kv_cache_scheme": None, "sparsity_config": {},
    }


def calibrate_input_scales(src: Path) -> dict[str, float]:
    """Static activation scales as a calibration would give them: amax of each layer linear's input over a prompt,
    / 448 (transformers runs the 16-bit model). k_proj's and up_proj's are raised, so the fused q/k/v and gate/up
    shards differ and the largest must serve each group."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    hooks = [m.register_forward_pre_hook(lambda m, args, name=name: amax.__setitem__(name, args[0].abs().max().item()))
             for name, m in model.named_modules() if name.endswith(LAYER_LINEARS)]
    with torch.no_grad():
        model(torch.tensor([[(i * 37) % 500 + 3 for i in range(64)]]))
    for h in hooks:
        h.remove()
    bump = {"self_attn.k_proj": 1.5, "mlp.up_proj": 1.25}
    return {n: a / FP8_MAX * next((f for s, f in bump.items() if n.endswith(s)), 1.0) for n, a in amax.items()}


def write_fp8_checkpoint(src: Path, out: Path, method: str, per_channel: bool = True, static: bool = False,
                         scale_dtype: torch.dtype = torch.float32, ignore: tuple[str, ...] = (),
                         dequantized: Path | None = None) -> Path:
    """The 16-bit model in `src` as an fp8 checkpoint in `out`, as vLLM's `fp8` or `compressed-tensors` stores it: each
    layer linear (but those in `ignore`) as float8_e4m3fn weight + weight_scale (per output channel [N, 1], or per
    tensor: [] for fp8, [1] for compressed-tensors) in scale_dtype, + input_scale when static.

    Every row's largest weight maps to 448, so the fp8 weights are what `--quantization fp8` makes of their
    dequantization (W_q * scale, written in float32 to `dequantized`): per channel that is the online rule itself;
    per tensor, each row's largest |w| is first raised to the tensor's. The two checkpoints then hold one model."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    fp8, deq = dict(tensors), dict(tensors)
    input_scales = calibrate_input_scales(src) if static else {}
    for key, w in tensors.items():
        module = key.removesuffix(".weight")
        if not module.endswith(LAYER_LINEARS) or key == module or module in ignore:
            continue
        w = w.float().clone()
        n, k = w.shape
        if not per_channel:  # one amax for every row: the per-tensor scale is then every row's own
            w[torch.arange(n), torch.arange(n) % k] = w.abs().max()
        w_q, scale = quantize_weight_fp8(w)  # scale [N, 1]
        scale = scale.to(scale_dtype).float()
        w_q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # the stored scale's own rounding
        assert torch.equal(w_q.float().abs().amax(dim=1), torch.full((n,), FP8_MAX))
        if per_channel:
            stored = scale
        else:
            assert torch.equal(scale, scale[:1].expand_as(scale))
            stored = scale[0, 0] if method == "fp8" else scale[0]
        fp8[key], fp8[f"{module}.weight_scale"] = w_q, stored.to(scale_dtype)
        if static:
            s = torch.tensor(input_scales[module], dtype=torch.float32)
            fp8[f"{module}.input_scale"] = s if method == "fp8" else s.reshape(1)
        deq[key] = w_q.float() * scale
    config = json.loads((src / "config.json").read_text())
    for d, ts, qc in ((out, fp8, quantization_config(method, per_channel, static, ignore)), (dequantized, deq, None)):
        if d is None:
            continue
        d.mkdir(parents=True)
        for f in src.iterdir():
            if f.suffix != ".safetensors" and f.name != "config.json":
                shutil.copy(f, d / f.name)
        (d / "config.json").write_text(json.dumps({**config, "quantization_config": qc} if qc else config, indent=2))
        save_file(ts, str(d / "model.safetensors"), metadata={"format": "pt"})
    return out


def fake_quant_inputs(model, input_scales: dict[str, float]) -> None:
    """Forward pre-hooks on the 16-bit model's fused linears: each input becomes fp8 at the checkpoint's static
    scale and back (x_q * s), s the largest of the fused shards' scales, as the fp8 model quantizes it."""
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for name, m in model.model.layers.named_modules():
        parent, _, attr = name.rpartition(".")
        if not isinstance(m, nn.Linear):
            continue
        s = max(input_scales[f"model.layers.{parent}.{shard}"] for shard in fused.get(attr, (attr,)))
        s = torch.tensor([s])
        m.register_forward_pre_hook(lambda m, args, s=s: ((quant.static_quant_fp8(args[0], s).float() * s)
                                                          .to(args[0].dtype),))


CHECKPOINTS = {  # id: (method, per_channel, static, scale dtype)
    "fp8-dynamic": ("fp8", False, False, torch.float32),
    "ct-channel": ("compressed-tensors", True, False, torch.float32),
    "ct-channel-bf16-scales": ("compressed-tensors", True, False, torch.bfloat16),
    "ct-tensor": ("compressed-tensors", False, False, torch.float32),
}
PROBE = [(i * 29) % 500 + 3 for i in range(48)]
KW = dict(device="cpu", kv_cache_memory=0.01, max_model_len=256)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("fmt", list(CHECKPOINTS))
def test_fp8_checkpoint_equals_online_fp8_of_its_dequantized_weights(request, tmp_path, fixture, fmt):
    """A checkpoint stored in fp8 loads without --quantization and runs the same model as `--quantization fp8` on its
    dequantized weights: the same fp8 weights (scales within an ulp: amax * float32(1/448) of W_q * s), so the
    logits at every position agree to float32 rounding and greedy decoding gives the same tokens."""
    method, per_channel, static, scale_dtype = CHECKPOINTS[fmt]
    src = request.getfixturevalue(fixture)
    ckpt = write_fp8_checkpoint(src, tmp_path / "fp8", method, per_channel, static, scale_dtype,
                                dequantized=tmp_path / "deq")
    got, ref = LLM(str(ckpt), **KW), LLM(str(tmp_path / "deq"), quantization="fp8", **KW)
    model, ref_model = got.engine.runner.model, ref.engine.runner.model
    for layer, ref_layer in zip(model.model.layers, ref_model.model.layers):
        for a, b in ((layer.self_attn.qkv_proj, ref_layer.self_attn.qkv_proj), (layer.mlp.down_proj,
                                                                               ref_layer.mlp.down_proj)):
            assert isinstance(a, Fp8Linear) and a.input_scale is None
            assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8)), "the same fp8 weights"
            torch.testing.assert_close(a.weight_scale, b.weight_scale, rtol=3e-7, atol=0)
    if not per_channel:  # each of q, k, v kept its own per-tensor scale, broadcast over its rows
        qkv = model.model.layers[0].self_attn.qkv_proj.weight_scale[0]
        q, k, v = qkv.split([64, 32, 32])
        assert all(torch.equal(t, t[:1].expand_as(t)) for t in (q, k, v)) and len({q[0], k[0], v[0]}) == 3
    a, b = step_logits(got, PROBE), step_logits(ref, PROBE)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    prompts = [PROBE[:5], PROBE[7:30]]
    assert greedy(got, prompts, 8) == greedy(ref, prompts, 8)
    # --quantization fp8 with an fp8 checkpoint is the same model
    again = LLM(str(ckpt), quantization="fp8", **KW)
    assert torch.equal(step_logits(again, PROBE), a)


@pytest.mark.parametrize("method", ["fp8", "compressed-tensors"])
def test_fp8_checkpoint_with_static_input_scales(tiny_qwen2_dir, tmp_path, method):
    """activation_scheme 'static' / input_activations static per tensor: every linear's input is quantized with the
    checkpoint's input_scale (a fused group's largest): the logits equal the 16-bit dequantized model's with its
    inputs fake-quantized at those scales (x -> e4m3(x / s) * s), to float32 rounding."""
    from safetensors import safe_open

    ckpt = write_fp8_checkpoint(tiny_qwen2_dir, tmp_path / "fp8", method, per_channel=False, static=True,
                                dequantized=tmp_path / "deq")
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        scales = {k.removesuffix(".input_scale"): f.get_tensor(k).item() for k in f.keys() if k.endswith("input_scale")}
    assert len(scales) == 3 * len(LAYER_LINEARS)
    got, ref = LLM(str(ckpt), **KW), LLM(str(tmp_path / "deq"), **KW)
    qkv = got.engine.runner.model.model.layers[1].self_attn.qkv_proj
    assert qkv.input_scale.item() == scales["model.layers.1.self_attn.k_proj"] > scales["model.layers.1.self_attn.q_proj"]
    fake_quant_inputs(ref.engine.runner.model, scales)
    a, b = step_logits(got, PROBE), step_logits(ref, PROBE)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # and it is the fp8 model, not the 16-bit one: dynamic per-token scales give other logits
    dyn = LLM(str(tmp_path / "deq"), quantization="fp8", **KW)
    assert not torch.allclose(step_logits(dyn, PROBE), a, rtol=1e-3, atol=1e-3)


def test_fp8_linear_static_input_scale_forward():
    lin = linear(96, 48, bias=True)
    w_q, s_w = quantize_weight_fp8(lin.weight.detach())
    s_in = torch.tensor([0.004])
    f = Fp8Linear(w_q, s_w, lin.bias, input_scale=s_in)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(4))
    x_q = (x / s_in).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    assert (x.abs() / s_in > FP8_MAX).any(), "some inputs clamp at 448"
    expected = (x_q.float() * s_in) @ (w_q.float() * s_w).t() + lin.bias
    torch.testing.assert_close(f(x), expected.detach(), rtol=1e-5, atol=1e-6)


def test_checkpoint_ignore_list_keeps_linears_16_bit(tiny_llama_dir, tmp_path):
    """A linear in quantization_config's ignore list is stored and served in 16 bits, also under --quantization fp8;
    every other one is fp8, and the model equals the dequantized one quantized online but for that linear."""
    kept = "model.layers.1.mlp.down_proj"
    ckpt = write_fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8", "compressed-tensors", ignore=(kept,),
                                dequantized=tmp_path / "deq")
    got = LLM(str(ckpt), quantization="fp8", **KW)
    layers = got.engine.runner.model.model.layers
    assert type(layers[1].mlp.down_proj).__name__ == "Linear" and layers[1].mlp.down_proj.weight.dtype == torch.float32
    assert isinstance(layers[0].mlp.down_proj, Fp8Linear) and isinstance(layers[1].mlp.gate_up_proj, Fp8Linear)
    ref = LLM(str(tmp_path / "deq"), **KW)
    for name, module in list(ref.engine.runner.model.model.layers.named_modules()):
        if isinstance(module, nn.Linear) and f"model.layers.{name}" != kept:
            parent, _, attr = name.rpartition(".")
            setattr(ref.engine.runner.model.model.layers.get_submodule(parent), attr, Fp8Linear.from_linear(module))
    torch.testing.assert_close(step_logits(got, PROBE), step_logits(ref, PROBE), rtol=1e-4, atol=1e-4)


def _edit_config(d: Path, edit) -> Path:
    """Applies edit to d's quantization_config."""
    config = json.loads((d / "config.json").read_text())
    edit(config["quantization_config"])
    (d / "config.json").write_text(json.dumps(config))
    return d


def _group(qc: dict) -> dict:
    return qc["config_groups"]["group_0"]


def _mix_formats(qc: dict) -> None:
    """group_0 in the packed 4-bit format, a copy of it as group_1 in fp8's."""
    _group(qc)["format"] = "pack-quantized"
    qc["config_groups"]["group_1"] = {**_group(qc), "format": "float-quantized"}


@pytest.mark.parametrize("method, edit, message", [
    ("fp8", lambda qc: qc.update(quant_method="bitsandbytes"),
     r"quantization_config.quant_method='bitsandbytes': Tandem loads fp8 checkpoints"),
    ("fp8", lambda qc: qc.update(weight_block_size=[128, 128]),
     r"quantization_config.weight_block_size=\[128, 128\]: block-wise fp8 scales \(weight_scale_inv"),
    ("fp8", lambda qc: qc.pop("activation_scheme"),
     r"quantization_config.activation_scheme=None: must be 'dynamic' or 'static'"),
    ("compressed-tensors", lambda qc: qc.update(format="pack-quantized"),  # fp8 args in a 4-bit format
     r"quantization_config.config_groups.group_0.weights.num_bits=8: Tandem loads 4-bit weights only"),
    ("compressed-tensors", lambda qc: _mix_formats(qc),
     r"config_groups: formats \['float-quantized', 'pack-quantized'\] mix packed 4-bit weights with others"),
    ("compressed-tensors", lambda qc: _group(qc)["weights"].update(strategy="block"),
     r"group_0.weights.strategy='block': must be 'channel' or 'tensor'"),
    ("compressed-tensors", lambda qc: _group(qc)["weights"].update(num_bits=4, type="int"),
     r"group_0.weights.num_bits=4: must be 8"),
    ("compressed-tensors", lambda qc: _group(qc).update(input_activations=None),
     r"group_0.input_activations=None: fp8 weights with 16-bit activations \(W8A16\) are not supported"),
    ("compressed-tensors", lambda qc: _group(qc)["input_activations"].update(dynamic=False),
     r"group_0.input_activations: dynamic=False with strategy='token' is not supported"),
    ("compressed-tensors", lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float"}),
     r"quantization_config.kv_cache_scheme=.*--kv-cache-dtype fp8"),
])
def test_bad_fp8_checkpoint_configs_name_the_field(tiny_llama_dir, tmp_path, method, edit, message):
    ckpt = write_fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8", method, per_channel=method != "fp8")
    _edit_config(ckpt, edit)
    with pytest.raises(ValueError, match=message):
        LLM(str(ckpt), **KW)


def test_checkpoint_tensors_that_disagree_with_the_config(tiny_llama_dir, tmp_path):
    """Stored tensors against the config: fp8 weights without a quantization_config, per-channel scales under a
    per-tensor scheme, a static scheme without input_scale, and fused shards in two formats are errors that name them."""
    ckpt = write_fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8", "compressed-tensors")
    original = json.loads((ckpt / "config.json").read_text())
    static = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    cases = [
        (lambda c: c.pop("quantization_config"),
         r"quant_method=None\): \['model.layers.0.mlp.down_proj.weight: checkpoint float8_e4m3fn vs model float32'"),
        (lambda c: _group(c["quantization_config"])["weights"].update(strategy="tensor"),
         r"model.layers.0.mlp.down_proj.weight_scale: checkpoint \(64, 1\) vs one scale per tensor"),
        (lambda c: _group(c["quantization_config"]).update(input_activations=static),
         r"missing=\['model.layers.0.mlp.down_proj.input_scale'"),
        (lambda c: c["quantization_config"].update(ignore=["lm_head", "model.layers.2.self_attn.v_proj"]),
         r"model.layers.2.self_attn.q_proj is fp8 \(dynamic activations\), .*v_proj is 16-bit; they run fused"),
    ]
    for edit, message in cases:
        config = json.loads(json.dumps(original))
        edit(config)
        (ckpt / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            LLM(str(ckpt), **KW)


def test_checkpoint_scale_shapes():
    from engine.quant import checkpoint_scale

    w_scale, in_scale = torch.empty(1, 4), torch.empty(1)
    s = torch.tensor(0.5)
    assert torch.equal(checkpoint_scale(s, w_scale, per_channel=False), torch.full((1, 4), 0.5))
    assert torch.equal(checkpoint_scale(s.reshape(1), w_scale, per_channel=False), torch.full((1, 4), 0.5))
    per_row = torch.arange(4.0)
    assert torch.equal(checkpoint_scale(per_row[:, None], w_scale, per_channel=True), per_row[None])
    assert torch.equal(checkpoint_scale(per_row, w_scale, per_channel=True), per_row[None])
    assert checkpoint_scale(per_row[:, None], w_scale, per_channel=False) is None
    assert checkpoint_scale(s.reshape(1), w_scale, per_channel=True) is None
    assert checkpoint_scale(torch.ones(3, 1), w_scale, per_channel=True) is None
    assert torch.equal(checkpoint_scale(s, in_scale, per_channel=True), torch.tensor([0.5]))


@cuda_only
@pytest.mark.gpu
def test_cuda_fp8_linear_static_input_scale(monkeypatch):
    """The static input scale on CUDA: torch quantizes x with it and _scaled_mm takes it as every row's scale."""
    monkeypatch.setattr(gemv, "CONFIGS_FP8", {})
    lin = linear(3584, 4608, bias=True).to("cuda", torch.bfloat16)
    w_q, s_w = quantize_weight_fp8(lin.weight.detach())
    x = torch.randn(300, 3584, device="cuda", dtype=torch.bfloat16)
    s_in = (x.float().abs().amax() / FP8_MAX * 0.5).reshape(1)  # half the amax: the largest inputs clamp
    f = Fp8Linear(w_q, s_w, lin.bias, input_scale=s_in)
    x_q = (x.float() / s_in).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    ref = fp8_linear_ref(x_q, s_in.expand(300, 1), f.weight, f.weight_scale, f.bias, torch.float32)
    y = f(x)
    assert y.dtype == torch.bfloat16
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("method, per_channel, static", [("compressed-tensors", True, False), ("fp8", False, True)])
def test_cuda_fp8_checkpoint_runs_with_graphs(tmp_path, method, per_channel, static):
    """An fp8 checkpoint on CUDA (bf16, decode and prefill steps as CUDA graphs): greedy generation runs, and its
    teacher-forced next tokens agree with the CPU's float32 run of the same checkpoint (the same fp8 weights and
    scales; the activations' dtype and the GEMM's accumulation differ). The CPU in bf16 against float32 agrees at
    88.6% (compressed-tensors) and 84.5% (fp8 static) of 220 positions (2026-11-30): near-ties flip."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_parity import build_random_dir

    src = build_random_dir(tmp_path / "src", "tiny-qwen2", seed=1, std=0.1)
    ckpt = write_fp8_checkpoint(src, tmp_path / "fp8", method, per_channel, static)
    gpu = LLM(str(ckpt), dtype="bfloat16", max_model_len=512, kv_cache_memory=1.0)
    cpu = LLM(str(ckpt), **KW)
    assert gpu.engine.runner.graphs is not None
    assert isinstance(gpu.engine.runner.model.model.layers[0].mlp.down_proj, Fp8Linear)
    prompts = [list(range(300, 300 + n)) for n in (5, 37, 130)]
    got = greedy(gpu, prompts, 16)
    assert [len(t) for t in got] == [16] * len(prompts)
    agree = total = 0
    for p, cont in zip(prompts, got):
        a, b = step_logits(cpu, p + cont).cpu(), step_logits(gpu, p + cont).cpu()
        agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
        total += a.shape[0]
    assert agree / total >= 0.7, f"teacher-forced agreement {agree}/{total}"
