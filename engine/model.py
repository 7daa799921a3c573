"""Llama-family decoder (Llama, Mistral, Qwen2) over the paged KV cache. The architecture and nothing else.

Parameter names are HuggingFace's, so checkpoints load by name. The forward pass takes a flat batch of tokens from
many requests (prefill chunks and decodes mixed) with their positions and the step's AttentionMetadata.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from engine.config import SUPPORTED_ARCHITECTURES
import kernels
from kernels.gemv import linear as small_batch_linear



@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int


@dataclass
class LayerKV:
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim] (a strided view)
    v_cache: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0
    k_scale_cache: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads] float32: an int8 cache's
    v_scale_cache: torch.Tensor | None = None  # scale per slot and KV head (a strided view: after each block's values)


def rope_parameters(config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    scaling = getattr(config, "rope_scaling", None)
    if scaling and "rope_type" not in params:
        params.update(scaling)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def build_cos_sin_cache(config, head_dim: int, max_position: int) -> torch.Tensor:
    """[max_position, head_dim] float32: cos of the rotary angles in the first half, sin in the second."""
    p = rope_parameters(config)
    base = p["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = p["rope_type"]
    if rope_type == "llama3":
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old_len = p["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif rope_type != "default":
        raise NotImplementedError(f"rope_type={rope_type!r}: supported are default and llama3")
    t = torch.arange(max_position, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


class Linear(nn.Linear):
    """nn.Linear whose products of a few rows (decode at batch 1-16, on CUDA) take kernels/gemv.py's GEMV where the
    H200 measured it faster than cuBLAS for this weight's shape and row count; F.linear everywhere else. On the CPU,
    engine/cpu_linear.py may give it a oneDNN-packed copy of its weight for products of up to packed_max_rows rows."""

    packed: torch.Tensor | None = None  # (a plain attribute, not a buffer: the weight's second layout)
    packed_max_rows: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] <= self.packed_max_rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return small_batch_linear(x, self.weight, self.bias)


@torch.no_grad()
def concat_linears(linears: list[nn.Module]) -> nn.Module:
    """One linear whose output is the linears' outputs side by side (fused q/k/v, gate/up). A linear that is not an
    nn.Linear (engine/quant.py's Fp8Linear, from an fp8 checkpoint) concatenates itself: type(...).concat(linears)."""
    if not isinstance(linears[0], nn.Linear):
        return type(linears[0]).concat(linears)
    w = torch.cat([m.weight for m in linears])
    has_bias = linears[0].bias is not None
    fused = Linear(w.shape[1], w.shape[0], bias=has_bias, device=w.device, dtype=w.dtype)
    fused.weight.copy_(w)
    if has_bias:
        fused.bias.copy_(torch.cat([m.bias for m in linears]))
    return fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim ** -0.5
        hidden = config.hidden_size
        bias = getattr(config, "attention_bias", False) or config.architectures[0] == "Qwen2ForCausalLM"
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=False)

        self.qkv_proj: nn.Linear | None = None  # set by fuse(): one GEMM instead of three

    def fuse(self) -> None:
        self.qkv_proj = concat_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, positions, x, cos_sin_cache, kv: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(
                [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim],
                dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        q, k = kernels.rotary_embedding_write_kv(positions, q, k, v, cos_sin_cache, kv.k_cache, kv.v_cache,
                                                 meta.slot_mapping, kv.k_scale, kv.v_scale,
                                                 k_scale_cache=kv.k_scale_cache, v_scale_cache=kv.v_scale_cache)
        o = kernels.paged_attention(q, kv.k_cache, kv.v_cache, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, meta.max_query_len, meta.max_seq_len, self.scale,
                                    kv.k_scale, kv.v_scale, k=k, v=v, k_scale_cache=kv.k_scale_cache,
                                    v_scale_cache=kv.v_scale_cache)  # [T, H, D]
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)
        self.gate_up_proj: nn.Linear | None = None  # set by fuse()

    def fuse(self) -> None:
        self.gate_up_proj = concat_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
        else:
            gate_up = torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)
        return self.down_proj(kernels.silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual, cos_sin_cache, kv, meta):
        if residual is None:
            # The residual stream stays in float32 whatever the weights' dtype: rounding it to bf16 after each of the
            # 2 x num_layers adds was most of the bf16 logits' error. Each norm still hands its matmul x's dtype.
            residual = x.float()
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, cos_sin_cache, kv, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, cos_sin_cache, kv_layers: list[LayerKV], meta) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer, kv in zip(self.layers, kv_layers):
            x, residual = layer(positions, x, residual, cos_sin_cache, kv, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """Also Mistral and Qwen2 (q/k/v biases)."""

    def __init__(self, config):
        super().__init__()
        arch = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not supported: supported are {', '.join(SUPPORTED_ARCHITECTURES)}")
        config.architectures = [arch]
        self.config = config
        self.model = LlamaModel(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.head_dim = head_dim
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(config, head_dim, config.max_position_embeddings),
                             persistent=False)

    def fuse_projections(self) -> None:
        """After loading: q/k/v and gate/up become one GEMM each (applied from outside; names stay HF's until then)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_layers: list[LayerKV],
                meta: AttentionMetadata) -> torch.Tensor:  # [num_tokens, hidden]
        return self.model(input_ids, positions, self.cos_sin_cache, kv_layers, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab]
        if self.lm_head is not None:  # untied, or a packed copy of the tied embedding (engine/cpu_linear.py)
            return self.lm_head(hidden)
        return small_batch_linear(hidden, self.model.embed_tokens.weight)
