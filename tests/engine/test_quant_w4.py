"""engine/quant_w4.py: 4-bit checkpoints (AWQ, GPTQ, compressed-tensors pack-quantized) loaded as they are.

Each checkpoint is written here from a tiny random float model, by the format's own specification: the weights are
quantized per group (scales rounded to the format's dtype first, so the dequantized weights are exactly
(q - z) * s), then packed the way the format's writer packs them (AutoAWQ's WQLinear_GEMM.from_linear loop with its
[0, 2, 4, 6, 1, 3, 5, 7] order; GPTQ's pack along K with zero points stored minus 1 in the v1 format;
compressed-tensors' pack_to_int32 of the signed values + 8, zero points packed along the outputs). The packers use
numpy's uint32 as those writers do, and share no code with the engine's unpacking. The same weights, dequantized,
are written as a plain float32 checkpoint: transformers runs it as the reference, and Tandem's 4-bit model must
give the same greedy tokens (and its logits agree with Tandem's own float32 run of the dequantized weights).
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.quant_w4 import W4Linear

sys.path.insert(0, str(Path(__file__).parent))
from test_cuda_parity import step_logits  # noqa: E402
from test_llm_exact import hf_greedy  # noqa: E402

LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")
# A layer's linears that read the same input: act order (a permutation of that input) is shared within each
INPUT_OF = {"self_attn.q_proj": "attn_in", "self_attn.k_proj": "attn_in", "self_attn.v_proj": "attn_in",
            "self_attn.o_proj": "o_in", "mlp.gate_proj": "mlp_in", "mlp.up_proj": "mlp_in", "mlp.down_proj": "down_in"}
AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's gemm.py
KW = dict(device="cpu", kv_cache_memory=0.01, max_model_len=256)
PROBE = [(i * 29) % 500 + 3 for i in range(40)]


# --- quantizing and packing, by the formats' specifications -------------------------------------------------------

def quantize_groups(w: torch.Tensor, group: int, sym: bool, scale_dtype: torch.dtype, order: torch.Tensor | None,
                    zero_min: int = 0):
    """w [N, K] float32 -> (q [N, K] in 0..15, z [N, NG] in zero_min..15, s [N, NG] float32 holding scale_dtype values,
    g [K] the group of each input). Group i holds the inputs order[i*G:(i+1)*G] (act order), or consecutive ones.
    Asymmetric: min/max per group (with 0 inside); symmetric: zero point 8, scale amax / 7.5."""
    n, k = w.shape
    g_size = k if group == -1 else group
    order = torch.arange(k) if order is None else order
    g = torch.empty(k, dtype=torch.long)
    g[order] = torch.arange(k) // g_size
    q = torch.empty(n, k, dtype=torch.long)
    z = torch.empty(n, k // g_size, dtype=torch.long)
    s = torch.empty(n, k // g_size)
    for i in range(k // g_size):
        cols = order[i * g_size:(i + 1) * g_size]
        block = w[:, cols]
        if sym:
            scale = (block.abs().amax(dim=1) / 7.5).clamp(min=1e-4)
            zero = torch.full((n,), 8)
        else:
            lo, hi = block.amin(dim=1).clamp(max=0), block.amax(dim=1).clamp(min=0)
            scale = ((hi - lo) / 15).clamp(min=1e-4)
        scale = scale.to(scale_dtype).float()  # the stored scale is what dequantizes
        if not sym:
            zero = torch.round(-lo / scale).clamp(zero_min, 15).long()
        q[:, cols] = torch.clamp(torch.round(block / scale[:, None]) + zero[:, None], 0, 15).long()
        z[:, i], s[:, i] = zero, scale
    return q, z, s, g


def dequantize(q, z, s, g) -> torch.Tensor:
    return (q - z[:, g]).float() * s[:, g]


def _u32(t: torch.Tensor) -> np.ndarray:
    return t.numpy().astype(np.uint32)


def _i32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int32))


def awq_pack_columns(intweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's WQLinear_GEMM.from_linear: [R, C] -> int32 [R, C/8], nibble i of word col = value col*8 + order[i]
    (its loop `qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)`, over every col at once)."""
    v = _u32(intweight)
    packed = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for i in range(8):
        packed |= v[:, AWQ_ORDER_MAP[i]::8] << (i * 4)
    return _i32(packed)


def gptq_pack_rows(intweight: torch.Tensor) -> torch.Tensor:
    """GPTQ's QuantLinear.pack of qweight: [K, N] -> int32 [K/8, N], word i holding rows 8i + j at bits 4j."""
    v = _u32(intweight)
    packed = np.zeros((v.shape[0] // 8, v.shape[1]), dtype=np.uint32)
    for j in range(8):
        packed |= v[j::8] << (4 * j)
    return _i32(packed)


def gptq_pack_columns(zeros: torch.Tensor) -> torch.Tensor:
    """GPTQ's qzeros: [NG, N] -> int32 [NG, N/8], word c holding columns 8c + j at bits 4j."""
    v = _u32(zeros)
    packed = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for j in range(8):
        packed |= v[:, j::8] << (4 * j)
    return _i32(packed)


def ct_pack_to_int32(value: torch.Tensor, packed_dim: int = 1) -> torch.Tensor:
    """compressed-tensors' pack_to_int32 (4 bits): signed int8 -> + 8 -> 8 per int32 along packed_dim, value i of a
    word at bits 4i (value[:, i::8] or value[i::8, :])."""
    assert value.dtype == torch.int8
    v = (value.to(torch.int32) + 8).numpy().astype(np.uint32)
    if packed_dim == 1:
        packed = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
        for i in range(8):
            packed |= v[:, i::8] << 4 * i
    else:
        packed = np.zeros((v.shape[0] // 8, v.shape[1]), dtype=np.uint32)
        for i in range(8):
            packed |= v[i::8, :] << 4 * i
    return _i32(packed)


# --- checkpoints ---------------------------------------------------------------------------------------------------

def quantization_config(fmt: str, group: int, sym: bool = True, desc_act: bool = False, v2: bool = False,
                        actorder: str | None = None, ignore: tuple[str, ...] = ()) -> dict:
    """config.json's quantization_config as transformers' AwqConfig / GPTQConfig or llm-compressor's W4A16 writes it.
    `ignore`: in-layer names (mlp.down_proj) kept in 16 bits, as each format says it."""
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": list(ignore) or None}
    if fmt == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act, "sym": sym,
              "damp_percent": 0.01, "true_sequential": True, "static_groups": False, "lm_head": False,
              "checkpoint_format": "gptq_v2" if v2 else "gptq", "use_exllama": True}
        if ignore:  # optimum's list of lists, in the order GPTQ quantizes them
            qc["modules_in_block_to_quantize"] = [[m for m in LAYER_LINEARS[:3] if m not in ignore],
                                                  [m for m in LAYER_LINEARS[3:] if m not in ignore]]
        return qc
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, "dynamic": False, "observer": "minmax",
               "strategy": "group" if group != -1 else "channel", "group_size": group if group != -1 else None,
               "block_structure": None, "actorder": actorder}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head", *(f"re:.*{m}$" for m in ignore)], "kv_cache_scheme": None, "sparsity_config": {},
            "global_compression_ratio": None}


def write_w4_checkpoint(src: Path, out: Path, fmt: str, group: int, sym: bool = False, act_order: bool = False,
                        v2: bool = False, seed: int = 0, dequantized: Path | None = None,
                        distinct_orders: bool = False, ignore: tuple[str, ...] = ()) -> Path:
    """The float model in `src` as a 4-bit checkpoint of `fmt` in `out` (and its dequantized weights, float32, in
    `dequantized`). act_order: each input of a layer gets a random order, shared by the linears reading it (or, with
    distinct_orders, a different one for each linear). `ignore`: in-layer linears kept as they are."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    quant, deq = {}, {}
    gen = torch.Generator().manual_seed(seed)
    orders: dict[tuple[str, str], torch.Tensor] = {}
    scale_dtype = torch.bfloat16 if fmt == "compressed-tensors" else torch.float16
    for key, t in tensors.items():
        module = key.rsplit(".", 1)[0]
        linear = next((m for m in LAYER_LINEARS if module.endswith(m)), None)
        if linear is None or linear in ignore:
            quant[key] = deq[key] = t
            continue
        if key.endswith(".bias"):  # AWQ and GPTQ store 16-bit biases; both checkpoints hold the same values
            b = t.half().float() if fmt != "compressed-tensors" else t
            quant[key], deq[key] = (b.half() if fmt != "compressed-tensors" else b), b
            continue
        w = t.float()
        n, k = w.shape
        order = None
        if act_order:
            layer = module.rsplit(".", 2)[0]
            shared = (layer, module if distinct_orders else INPUT_OF[linear])
            order = orders.setdefault(shared, torch.randperm(k, generator=gen))
        zero_min = 1 if fmt == "gptq" and not v2 else 0  # v1 stores zero - 1: a zero point of 0 is not storable
        q, z, s, g = quantize_groups(w, group, sym, scale_dtype, order, zero_min)
        deq[key] = dequantize(q, z, s, g)
        if fmt == "awq":
            quant[f"{module}.qweight"] = awq_pack_columns(q.t().contiguous())
            quant[f"{module}.qzeros"] = awq_pack_columns(z.t().contiguous())
            quant[f"{module}.scales"] = s.t().contiguous().half()
        elif fmt == "gptq":
            quant[f"{module}.qweight"] = gptq_pack_rows(q.t().contiguous())
            quant[f"{module}.qzeros"] = gptq_pack_columns((z.t() - (0 if v2 else 1)).contiguous())
            quant[f"{module}.scales"] = s.t().contiguous().half()
            quant[f"{module}.g_idx"] = g.to(torch.int32)
        else:
            quant[f"{module}.weight_packed"] = ct_pack_to_int32((q - 8).to(torch.int8))
            quant[f"{module}.weight_scale"] = s.to(torch.bfloat16)
            quant[f"{module}.weight_shape"] = torch.tensor([n, k])
            if not sym:
                quant[f"{module}.weight_zero_point"] = ct_pack_to_int32((z - 8).to(torch.int8), packed_dim=0)
            if act_order:
                quant[f"{module}.weight_g_idx"] = g.to(torch.int32)
    config = json.loads((src / "config.json").read_text())
    qc = quantization_config(fmt, group, sym, desc_act=act_order, v2=v2, actorder="group" if act_order else None,
                             ignore=ignore)
    for d, ts, c in ((out, quant, {**config, "quantization_config": qc}), (dequantized, deq, config)):
        if d is None:
            continue
        d.mkdir(parents=True)
        for f in src.iterdir():
            if f.suffix != ".safetensors" and f.name != "config.json":
                shutil.copy(f, d / f.name)
        (d / "config.json").write_text(json.dumps(c, indent=2))
        save_file(ts, str(d / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def tiny_qwen2_wide_dir(tiny_qwen2_dir, tmp_path_factory) -> Path:
    """tiny_qwen2_dir's config 128 wide (hidden 128, MLP 256, random weights of std 0.1 with biases):
    room for AWQ's usual group size, 128."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.tokenizer import synthetic_tokenizer

    config = AutoConfig.from_pretrained(tiny_qwen2_dir)
    config.hidden_size, config.intermediate_size = 128, 256
    torch.manual_seed(4)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, config.initializer_range)
    out = tmp_path_factory.mktemp("tiny-qwen2-wide")
    model.save_pretrained(out, safe_serialization=True)
    synthetic_tokenizer(config.vocab_size).save_pretrained(out)
    return out


def greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


# id: (model fixture, format, group size, symmetric, act order, GPTQ v2)
CASES = {
    "awq-g32-llama": ("tiny_llama_dir", "awq", 32, False, False, False),
    "awq-g32-qwen2": ("tiny_qwen2_dir", "awq", 32, False, False, False),
    "awq-g128": ("tiny_qwen2_wide_dir", "awq", 128, False, False, False),
    "gptq-sym-g32": ("tiny_llama_dir", "gptq", 32, True, False, False),
    "gptq-asym-desc_act-g32": ("tiny_qwen2_dir", "gptq", 32, False, True, False),
    "gptq-sym-desc_act-g64": ("tiny_qwen2_wide_dir", "gptq", 64, True, True, False),
    "gptq_v2-asym-channel": ("tiny_llama_dir", "gptq", -1, False, False, True),
    "ct-sym-g32": ("tiny_qwen2_dir", "compressed-tensors", 32, True, False, False),
    "ct-asym-channel": ("tiny_llama_dir", "compressed-tensors", -1, False, False, False),
    "ct-sym-actorder-g64": ("tiny_qwen2_wide_dir", "compressed-tensors", 64, True, True, False),
}
PROMPTS = [PROBE[:5], PROBE[3:30], PROBE[10:11]]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_transformers_on_the_dequantized_weights(request, tmp_path, case):
    """The 4-bit checkpoint loads without --quantization, every layer linear a W4Linear (fused q/k/v and gate/up),
    and decodes the tokens transformers decodes from the dequantized float32 weights; its logits at every position
    equal Tandem's float32 run of those weights to float32 rounding (the CPU path dequantizes exactly)."""
    fixture, fmt, group, sym, act_order, v2 = CASES[case]
    src = request.getfixturevalue(fixture)
    ckpt = write_w4_checkpoint(src, tmp_path / "w4", fmt, group, sym, act_order, v2, dequantized=tmp_path / "deq")
    llm = LLM(str(ckpt), **KW)
    layers = llm.engine.runner.model.model.layers
    for layer in layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(linear, W4Linear), type(linear).__name__
            assert linear.group_size == (linear.in_features if group == -1 else group)
            assert (linear.perm is not None) == (act_order and linear.in_features > linear.group_size)
            assert (linear.qzeros is not None) == (not sym)  # GPTQ sym's stored 8s are dropped
            assert linear.scales.dtype in (torch.float16, torch.bfloat16)  # the stored scales, exactly, in 2 bytes
    assert greedy(llm, PROMPTS, 8) == hf_greedy(tmp_path / "deq", PROMPTS, 8)
    ref = LLM(str(tmp_path / "deq"), **KW)
    torch.testing.assert_close(step_logits(llm, PROBE), step_logits(ref, PROBE), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["awq", "gptq", "compressed-tensors"])
def test_linears_the_config_keeps_in_16_bits(tiny_qwen2_dir, tmp_path, fmt):
    """AWQ's modules_to_not_convert, GPTQ's modules_in_block_to_quantize and compressed-tensors' ignore list leave
    down_proj in 16 bits (stored as .weight): it loads as a plain linear, the rest in 4 bits."""
    ckpt = write_w4_checkpoint(tiny_qwen2_dir, tmp_path / "w4", fmt, 32, ignore=("mlp.down_proj",),
                               dequantized=tmp_path / "deq")
    llm = LLM(str(ckpt), **KW)
    layer = llm.engine.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, W4Linear) and isinstance(layer.mlp.gate_up_proj, W4Linear)
    assert isinstance(layer.mlp.down_proj, torch.nn.Linear)
    assert greedy(llm, PROMPTS, 8) == hf_greedy(tmp_path / "deq", PROMPTS, 8)


def test_fused_shards_and_tensor_parallel_pieces():
    """W4Linear.concat is the shards side by side (a 16-bit and a float32-scaled shard: scales widened, missing zero
    points filled with 8); rows() and columns() are the column- and row-parallel pieces: their outputs are the
    whole one's columns, and the row-parallel partial sums add up to it."""
    from kernels.w4a16 import pack_w4

    gen = torch.Generator().manual_seed(0)

    def linear(n, zeros, scale_dtype, k=64, g=16, bias=True):
        return W4Linear(pack_w4(torch.randint(0, 16, (k, n), generator=gen)),
                        (torch.rand(k // g, n, generator=gen) * 0.1).to(scale_dtype),
                        torch.randint(0, 16, (k // g, n), generator=gen).to(torch.uint8) if zeros else None, None,
                        torch.randn(n, generator=gen) if bias else None)

    a, b = linear(24, True, torch.float16), linear(16, False, torch.float32)
    x = torch.randn(5, 64, generator=gen)
    fused = W4Linear.concat([a, b])
    assert fused.scales.dtype == torch.float32 and fused.qzeros[:, 24:].eq(8).all()
    torch.testing.assert_close(fused(x), torch.cat([a(x), b(x)], dim=-1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused.rows(8, 32)(x), fused(x)[:, 8:32], rtol=1e-6, atol=1e-6)
    whole = linear(24, True, torch.float16, bias=False)
    parts = whole.columns(0, 32)(x[:, :32]) + whole.columns(32, 64)(x[:, 32:])
    torch.testing.assert_close(parts, whole(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"splits its groups of 16 inputs"):
        whole.columns(0, 24)
    channel = linear(24, True, torch.float16, g=64, bias=False)  # one group per row: the shards keep its scales
    parts = channel.columns(0, 32)(x[:, :32]) + channel.columns(32, 64)(x[:, 32:])
    torch.testing.assert_close(parts, channel(x), rtol=1e-5, atol=1e-5)
    acted = W4Linear(whole.qweight, whole.scales, whole.qzeros, torch.randperm(64).to(torch.int32), None)
    with pytest.raises(ValueError, match=r"act order .* tensor_parallel_size=1"):
        acted.columns(0, 32)


@pytest.fixture(scope="module")
def checkpoints(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    """One small checkpoint of each format, written once: tests copy it before editing it."""
    root = tmp_path_factory.mktemp("w4")
    return {fmt: write_w4_checkpoint(tiny_llama_dir, root / fmt, fmt, 32, sym=fmt != "awq")
            for fmt in ("awq", "gptq", "compressed-tensors")}


def edited(checkpoints, tmp_path, fmt: str, edit) -> Path:
    """A copy of the `fmt` checkpoint with edit(quantization_config) applied."""
    d = shutil.copytree(checkpoints[fmt], tmp_path / fmt)
    config = json.loads((d / "config.json").read_text())
    edit(config["quantization_config"])
    (d / "config.json").write_text(json.dumps(config))
    return d


def _weights(qc: dict) -> dict:
    return qc["config_groups"]["group_0"]["weights"]


def _set(d: dict, **kw):
    d.update(kw)


@pytest.mark.parametrize("fmt, edit, message", [
    ("awq", lambda qc: _set(qc, bits=8), r"quantization_config.bits=8: Tandem loads 4-bit weights only"),
    ("awq", lambda qc: qc.pop("bits") and _set(qc, w_bit=3), r"quantization_config.w_bit=3: Tandem loads 4-bit"),
    ("awq", lambda qc: _set(qc, zero_point=False),
     r"quantization_config.zero_point=False: AWQ without zero points is not supported"),
    ("awq", lambda qc: _set(qc, version="gemv"), r"quantization_config.version='gemv': only AutoAWQ's GEMM layout"),
    ("awq", lambda qc: _set(qc, group_size=40), r"quantization_config.group_size=40: must be -1 \(one group per row\)"),
    ("awq", lambda qc: _set(qc, backend="llm-awq"), r"quantization_config.backend='llm-awq'"),
    ("gptq", lambda qc: _set(qc, bits=3), r"quantization_config.bits=3: Tandem loads 4-bit weights only"),
    ("gptq", lambda qc: _set(qc, bits=8), r"quantization_config.bits=8: Tandem loads 4-bit weights only"),
    ("gptq", lambda qc: _set(qc, checkpoint_format="marlin"),
     r"quantization_config.checkpoint_format='marlin': must be 'gptq' \(v1: zero points stored minus 1\)"),
    ("gptq", lambda qc: _set(qc, lm_head=True), r"quantization_config.lm_head=True: a 4-bit lm_head"),
    ("gptq", lambda qc: _set(qc, dynamic={r"+:.*\.1\..*": {"bits": 8}}),
     r"quantization_config.dynamic=.*: per-module overrides"),
    ("gptq", lambda qc: _set(qc, desc_act="yes"), r"quantization_config.desc_act='yes': must be true or false"),
    ("compressed-tensors", lambda qc: _set(_weights(qc), num_bits=8),
     r"config_groups.group_0.weights.num_bits=8: Tandem loads 4-bit weights only"),
    ("compressed-tensors", lambda qc: _set(_weights(qc), type="float"),
     r"group_0.weights.type='float': must be 'int'"),
    ("compressed-tensors", lambda qc: _set(_weights(qc), strategy="tensor"),
     r"group_0.weights.strategy='tensor': must be 'group' or 'channel'"),
    ("compressed-tensors", lambda qc: _set(_weights(qc), actorder="random"),
     r"group_0.weights.actorder='random': must be one of"),
    ("compressed-tensors", lambda qc: _set(qc["config_groups"]["group_0"], input_activations={
        "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
     r"group_0.input_activations=.*quantized activations \(W4A8\) are not supported"),
    ("compressed-tensors", lambda qc: _set(qc, kv_cache_scheme={"num_bits": 8, "type": "float"}),
     r"quantization_config.kv_cache_scheme=.*--kv-cache-dtype fp8"),
    ("awq", lambda qc: _set(qc, quant_method="bitsandbytes"),
     r"quant_method='bitsandbytes': Tandem loads fp8 checkpoints .* and 4-bit ones \(awq, gptq"),
])
def test_unsupported_variants_name_the_field(checkpoints, tmp_path, fmt, edit, message):
    """Refused when the config is read (resolve_model), before any weight: the error names the field."""
    with pytest.raises(ValueError, match=message):
        LLM(str(edited(checkpoints, tmp_path, fmt, edit)), **KW)


def test_load_time_errors_name_the_linear_or_the_tensors(tiny_llama_dir, checkpoints, tmp_path):
    """Shapes the format cannot pack, tensors the config does not describe, half a fused group in 16 bits, and
    fused shards with different act orders fail at load, naming what."""
    cases = [
        ("awq", lambda qc: _set(qc, group_size=128),
         r"model.layers.0.self_attn.q_proj: 64 inputs do not split into groups of 128"),
        ("awq", lambda qc: _set(qc, modules_to_not_convert=["k_proj"]),
         r"self_attn.q_proj is 4-bit \(group_size 32\), .*k_proj is 16-bit, .*they run fused as one GEMM"),
        ("gptq", lambda qc: _set(qc, checkpoint_format="gptq_v2", sym=False), None),  # loads: another model
    ]
    for fmt, edit, message in cases:
        d = edited(checkpoints, tmp_path / str(len(message or "")), fmt, edit)
        if message is None:
            LLM(str(d), **KW)
            continue
        with pytest.raises(ValueError, match=message):
            LLM(str(d), **KW)
    # a 16-bit checkpoint that claims to be AWQ: the packed tensors are missing
    plain = shutil.copytree(tiny_llama_dir, tmp_path / "plain")
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config("awq", 32)}))
    with pytest.raises(ValueError, match=r"missing=\['model.layers.0.mlp.down_proj.qweight'.*unexpected=\["
                                         r"'model.layers.0.mlp.down_proj.weight'"):
        LLM(str(plain), **KW)
    # a packed tensor stored as floats
    from safetensors.torch import load_file, save_file

    bad = shutil.copytree(checkpoints["gptq"], tmp_path / "bad")
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.qweight"] = tensors["model.layers.1.mlp.up_proj.qweight"].float()
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.qweight: checkpoint float32 vs model int32"):
        LLM(str(bad), **KW)
    # act order that differs between q, k and v
    distinct = write_w4_checkpoint(tiny_llama_dir, tmp_path / "distinct", "gptq", 32, act_order=True,
                                   distinct_orders=True)
    with pytest.raises(ValueError, match=r"desc_act / actorder: model.layers.0.self_attn.q_proj, "
                                         r"model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj have "
                                         r"different g_idx"):
        LLM(str(distinct), **KW)


def test_quantization_flag_must_name_the_checkpoint_format(checkpoints):
    """--quantization awq / gptq / compressed-tensors loads a checkpoint of that format (the same model as without
    the flag); naming another, or fp8 on 4-bit weights, fails at load."""
    awq = str(checkpoints["awq"])
    plain, flagged = LLM(awq, **KW), LLM(awq, quantization="awq", **KW)
    assert torch.equal(step_logits(plain, PROBE), step_logits(flagged, PROBE))
    LLM(str(checkpoints["compressed-tensors"]), quantization="compressed-tensors", **KW)
    with pytest.raises(ValueError, match=r"quantization='gptq': model='.*awq' has quantization_config.quant_method="
                                         r"'awq'; --quantization gptq loads a checkpoint stored in that format"):
        LLM(awq, quantization="gptq", **KW)
    with pytest.raises(ValueError, match=r"quantization='fp8': model='.*awq' stores 4-bit weights .* drop "
                                         r"--quantization, or pass --quantization awq"):
        LLM(awq, quantization="fp8", **KW)
    with pytest.raises(ValueError, match=r"quantization='int4': must be one of None, fp8, awq, gptq, "
                                         r"compressed-tensors"):
        LLM(awq, quantization="int4", **KW)


def test_random_model_in_a_4_bit_format():
    """random:<preset> with a 4-bit --quantization (bench/latency.py's W4 runs) rounds each random linear to
    W4Linear: zero points for awq, none for gptq and compressed-tensors; the logits stay near the 16-bit model's."""
    from engine.quant_w4 import W4Linear, quantize_w4_rtn, random_w4_linears

    base = step_logits(LLM("random:tiny-qwen2", **KW), PROBE)
    for fmt, zeros in (("awq", True), ("gptq", False), ("compressed-tensors", False)):
        llm = LLM("random:tiny-qwen2", quantization=fmt, **KW)
        layers = llm.engine.runner.model.model.layers
        linears = [m for m in layers.modules() if isinstance(m, W4Linear)]
        assert len(linears) == 4 * len(layers) and not any(isinstance(m, torch.nn.Linear) for m in layers.modules())
        assert all((m.qzeros is not None) == zeros for m in linears)
        logits = step_logits(llm, PROBE)
        assert ((logits - base).norm() / base.norm()).item() < 0.25
    # groups of 128 inputs where K allows, the dequantized weight within half a step of the 16-bit one
    linear = torch.nn.Linear(256, 24, bias=True)
    for zp in (True, False):
        w4 = quantize_w4_rtn(linear, zero_points=zp)
        assert w4.group_size == 128 and torch.equal(w4.bias, linear.bias)
        from kernels.w4a16 import dequantize_w4_ref
        err = (dequantize_w4_ref(w4.qweight, w4.scales, w4.qzeros).t() - linear.weight).abs()
        step = w4.scales.float().repeat_interleave(128, dim=0).t()
        assert bool((err <= 0.51 * step + 1e-6).all())  # 0.5 of a step, the fp16 scale aside
    with pytest.raises(AssertionError):
        random_w4_linears(torch.nn.Sequential(linear), "fp8")


def test_weight_bytes_of_a_4_bit_checkpoint_equal_the_engines_model(checkpoints):
    """tandem plan sizes a 4-bit checkpoint as the engine holds it: half a byte per weight, a 2-byte scale and a
    1-byte zero point per group and output (AWQ is asymmetric), the rest in the model dtype."""
    from engine.plan import plan, weight_bytes_of

    llm = LLM(str(checkpoints["awq"]), **KW)
    held = sum(t.numel() * t.element_size() for t in llm.engine.runner.model.parameters())
    config = llm.engine.resolved.config
    assert held == weight_bytes_of(config, "float32") == weight_bytes_of(config, "float32", "awq")
    p = plan(str(checkpoints["awq"]), 2**30, 256, dtype="bfloat16")
    assert p.quantization == "awq" and p.weight_bytes == weight_bytes_of(config, "bfloat16")
    with pytest.raises(ValueError, match=r"quantization='fp8': the checkpoint stores 4-bit weights: must be None"):
        weight_bytes_of(config, "bfloat16", "fp8")


def teacher_forced(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    """(next-token argmax agreement, mean relative logits error) of b against a over every position."""
    a, b = torch.cat(a), torch.cat(b)
    return ((a.argmax(-1) == b.argmax(-1)).float().mean().item(),
            ((b - a).norm(dim=-1) / a.norm(dim=-1)).mean().item())


def test_fp8_kv_cache_on_4_bit_weights(tiny_qwen2_dir, tmp_path):
    """--kv-cache-dtype fp8 stacks on 4-bit weights: it loads, calibrates its scales through the 4-bit model and
    decodes. Its cost is the fp8 KV cache's own: measured (2026-12-02, AWQ g32 of tiny random Qwen2, 4 prompts
    teacher-forced over 349 positions) 90.8% argmax agreement and 4.3% logits error against the same 4-bit model with
    float32 KV, as fp8 KV on the float model (90.8%, 4.4%); the 4-bit weights themselves (RTN, no calibration) cost
    61.6% and 30.5% against the float model on these random weights (docs/quantization.md)."""
    ckpt = write_w4_checkpoint(tiny_qwen2_dir, tmp_path / "w4", "awq", 32)
    kw = dict(device="cpu", kv_cache_memory=0.02, max_model_len=512)
    w4, w4_fp8 = LLM(str(ckpt), **kw), LLM(str(ckpt), kv_cache_dtype="fp8", **kw)
    assert w4_fp8.engine.runner.kv_dtype == torch.float8_e4m3fn
    assert isinstance(w4_fp8.engine.runner.model.model.layers[0].mlp.down_proj, W4Linear)
    assert [len(t) for t in greedy(w4_fp8, PROMPTS, 8)] == [8] * len(PROMPTS)
    gen = torch.Generator().manual_seed(3)
    probes = [torch.randint(300, 512, (n,), generator=gen).tolist() + PROBE[:24] for n in (9, 30, 64, 150)]
    agree, rel = teacher_forced([step_logits(w4, p) for p in probes], [step_logits(w4_fp8, p) for p in probes])
    assert agree >= 0.85 and rel < 0.07, (agree, rel)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt, group, sym, act_order", [("awq", 32, False, False), ("gptq", 32, False, True),
                                                         ("compressed-tensors", -1, True, False)])
def test_cuda_4_bit_checkpoint_runs_the_kernels_with_graphs(tiny_qwen2_dir, tmp_path, fmt, group, sym, act_order):
    """On CUDA the 4-bit linears run kernels/w4a16.py (decode and prefill steps as CUDA graphs). In float32 (exact
    float32 dots) the greedy tokens equal the CPU reference's and the logits agree to 1e-3; in bf16 generation runs
    and its teacher-forced next tokens mostly agree with the CPU's float32 run (x and the sums' order differ)."""
    ckpt = write_w4_checkpoint(tiny_qwen2_dir, tmp_path / "w4", fmt, group, sym, act_order)
    cpu = LLM(str(ckpt), **KW)
    prompts = [list(range(300, 300 + n)) for n in (5, 37, 130)]
    want = greedy(cpu, prompts, 16)
    f32 = LLM(str(ckpt), device="cuda", dtype="float32", max_model_len=512, kv_cache_memory=1.0)
    assert f32.engine.runner.graphs is not None
    assert greedy(f32, prompts, 16) == want
    torch.testing.assert_close(step_logits(f32, PROBE).cpu(), step_logits(cpu, PROBE), rtol=1e-3, atol=1e-3)
    del f32
    bf16 = LLM(str(ckpt), device="cuda", dtype="bfloat16", max_model_len=512, kv_cache_memory=1.0)
    assert isinstance(bf16.engine.runner.model.model.layers[0].mlp.down_proj, W4Linear)
    got = greedy(bf16, prompts, 16)
    assert [len(t) for t in got] == [16] * len(prompts)
    agree, _ = teacher_forced([step_logits(cpu, p + c) for p, c in zip(prompts, got)],
                              [step_logits(bf16, p + c).cpu() for p, c in zip(prompts, got)])
    assert agree >= 0.7, agree


CHAT = [{"role": "user", "content": "Explain how a bicycle works."},  # test_quant.py's SmolLM2 chat (120 tokens)
        {"role": "assistant", "content": "A bicycle turns the push of your legs into forward motion. The pedals "
         "turn a crank, the crank turns the front sprocket, and a chain carries that rotation to a smaller "
         "sprocket on the rear wheel, so one turn of the pedals turns the wheel more than once. You steer with "
         "the handlebars, and the brakes press pads against the rim or a disc to slow you down."}]


@pytest.mark.slow
def test_fp8_kv_cache_on_4_bit_smollm2(smollm2_dir, tmp_path):
    """SmolLM2-135M-Instruct as an AWQ g64 checkpoint (round to nearest, no calibration), teacher-forced over a chat
    (120 positions). Measured (2026-12-02), next-token argmax agreement and mean relative logits error: fp8 KV on the
    4-bit weights against float32 KV on them 95.8% (115 of 120), 6.0%; fp8 KV on the float model 95.0%, 6.4%; the
    4-bit weights against the float model 59.2% (71 of 120), 64.8% (with fp8 KV too 60.8%, 63.3%): on this small
    model the 4-bit weights cost far more than the fp8 KV cache does."""
    ckpt = write_w4_checkpoint(smollm2_dir, tmp_path / "w4", "awq", 64)
    logits = {}
    for kv in ("auto", "fp8"):
        llm = LLM(str(ckpt), kv_cache_dtype=kv, device="cpu", kv_cache_memory=0.2, max_model_len=2048)
        tok = llm.get_tokenizer()
        logits[kv] = step_logits(llm, tok(tok.apply_chat_template(CHAT, tokenize=False),
                                          add_special_tokens=False).input_ids)
    agree, rel = teacher_forced([logits["auto"]], [logits["fp8"]])
    assert agree >= 0.9 and rel < 0.12, (agree, rel)


@pytest.mark.parametrize("fmt, file, own", [
    ("gptq", "quantize_config.json", {"bits": 4, "group_size": 32, "damp_percent": 0.01, "desc_act": False,
                                      "static_groups": False, "sym": True, "true_sequential": True,
                                      "model_name_or_path": None, "model_file_base_name": "model"}),
    ("awq", "quant_config.json", {"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"}),
])
def test_quantizer_config_file_beside_config_json(checkpoints, tmp_path, fmt, file, own):
    """AutoGPTQ's quantize_config.json and AutoAWQ's quant_config.json (their own keys, no quant_method) stand for a
    quantization_config that config.json lacks: the same model loads."""
    d = shutil.copytree(checkpoints[fmt], tmp_path / fmt)
    config = json.loads((d / "config.json").read_text())
    config.pop("quantization_config")
    (d / "config.json").write_text(json.dumps(config))
    (d / file).write_text(json.dumps(own))
    got = LLM(str(d), **KW)
    assert isinstance(got.engine.runner.model.model.layers[0].mlp.down_proj, W4Linear)
    torch.testing.assert_close(step_logits(got, PROBE), step_logits(LLM(str(checkpoints[fmt]), **KW), PROBE),
                               rtol=0, atol=0)


def test_all_zero_bias_of_a_biasless_linear_is_skipped(checkpoints, tmp_path):
    """GPTQ-for-LLaMa stored a zero bias for every 4-bit linear, Llama's included (which have none): those load as
    nothing (vLLM skips them too); a bias that is not all zero is still an unexpected tensor."""
    from safetensors.torch import load_file, save_file

    d = shutil.copytree(checkpoints["gptq"], tmp_path / "gptq")
    tensors = load_file(str(d / "model.safetensors"))
    for i in range(3):
        for m in LAYER_LINEARS:
            tensors[f"model.layers.{i}.{m}.bias"] = torch.zeros(tensors[f"model.layers.{i}.{m}.scales"].shape[1],
                                                                dtype=torch.float16)
    save_file(tensors, str(d / "model.safetensors"))
    torch.testing.assert_close(step_logits(LLM(str(d), **KW), PROBE), step_logits(LLM(str(checkpoints["gptq"]), **KW),
                                                                               PROBE), rtol=0, atol=0)
    tensors["model.layers.2.mlp.down_proj.bias"][3] = 0.5
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected=\['model.layers.2.mlp.down_proj.bias'\]"):
        LLM(str(d), **KW)
