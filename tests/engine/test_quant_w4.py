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
    """AutoAWQ's WQLinear_GEMM.from_linear: [R, C] -> int32 [R, C/8], nibble i of word col = value col*8 + order[i]."""
    v = _u32(intweight)
    packed = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for col in range(v.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= v[:, col * 8 + AWQ_ORDER_MAP[i]] << (i * 4)
    return _i32(packed)


def gptq_pack_rows(intweight: torch.Tensor) -> torch.Tensor:
    """GPTQ's QuantLinear.pack of qweight: [K, N] -> int32 [K/8, N], row i holding rows 8i..8i+7 at bits 4j."""
    v = _u32(intweight)
    packed = np.zeros((v.shape[0] // 8, v.shape[1]), dtype=np.uint32)
    for i in range(v.shape[0] // 8):
        for j in range(8):
            packed[i] |= v[i * 8 + j] << (4 * j)
    return _i32(packed)


def gptq_pack_columns(zeros: torch.Tensor) -> torch.Tensor:
    """GPTQ's qzeros: [NG, N] -> int32 [NG, N/8], column c holding columns 8c..8c+7 at bits 4j."""
    v = _u32(zeros)
    packed = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for c in range(v.shape[1] // 8):
        for j in range(8):
            packed[:, c] |= v[:, c * 8 + j] << (4 * j)
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
                        actorder: str | None = None) -> dict:
    """config.json's quantization_config as transformers' AwqConfig / GPTQConfig or llm-compressor's W4A16 writes it."""
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act, "sym": sym,
                "damp_percent": 0.01, "true_sequential": True, "static_groups": False, "lm_head": False,
                "checkpoint_format": "gptq_v2" if v2 else "gptq", "use_exllama": True}
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, "dynamic": False, "observer": "minmax",
               "strategy": "group" if group != -1 else "channel", "group_size": group if group != -1 else None,
               "block_structure": None, "actorder": actorder}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": None}


def write_w4_checkpoint(src: Path, out: Path, fmt: str, group: int, sym: bool = False, act_order: bool = False,
                        v2: bool = False, seed: int = 0, dequantized: Path | None = None,
                        distinct_orders: bool = False) -> Path:
    """The float model in `src` as a 4-bit checkpoint of `fmt` in `out` (and its dequantized weights, float32, in
    `dequantized`). act_order: each input of a layer gets a random order, shared by the linears reading it (or, with
    distinct_orders, a different one for each linear)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    quant, deq = {}, {}
    gen = torch.Generator().manual_seed(seed)
    orders: dict[tuple[str, str], torch.Tensor] = {}
    scale_dtype = torch.bfloat16 if fmt == "compressed-tensors" else torch.float16
    for key, t in tensors.items():
        module = key.rsplit(".", 1)[0]
        linear = next((m for m in LAYER_LINEARS if module.endswith(m)), None)
        if linear is None:
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
    qc = quantization_config(fmt, group, sym, desc_act=act_order, v2=v2, actorder="group" if act_order else None)
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
