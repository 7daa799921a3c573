"""Tensor parallelism applied from outside the plain model (gpt-fast's tp.py pattern), for any world size.

Megatron's split of a Llama-family layer across `world` ranks of a torch.distributed group (NCCL on GPUs, gloo on
the CPU): q/k/v and gate/up are split by output rows (each rank owns num_heads/world query heads, num_kv_heads/world
KV heads and intermediate/world MLP columns), o_proj and down_proj by input columns, followed by one all-reduce
each. Embeddings, norms and lm_head stay replicated. Each rank's KV cache then holds only its own KV heads.

Status: the model-level split is tested (tests/engine/test_tp.py: 2 gloo ranks equal one process). The engine does
not drive several ranks yet: that needs a driver broadcasting each step's inputs to worker processes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.model import LlamaForCausalLM


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T): a linear whose input features are split across the group."""

    def __init__(self, linear: nn.Linear, rank: int, world: int, group=None):
        super().__init__()
        assert linear.bias is None, "row-parallel layers of this family carry no bias"
        cols = linear.in_features // world
        self.weight = nn.Parameter(linear.weight[:, rank * cols:(rank + 1) * cols].clone(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y


def _rows(linear: nn.Linear, start: int, end: int) -> nn.Linear:
    out = nn.Linear(linear.in_features, end - start, bias=linear.bias is not None, device=linear.weight.device,
                    dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(linear.weight[start:end])
        if linear.bias is not None:
            out.bias.copy_(linear.bias[start:end])
    return out


@torch.no_grad()
def shard_model(model: LlamaForCausalLM, rank: int, world: int, group=None) -> LlamaForCausalLM:
    """Splits a loaded, unfused model in place for `rank` of `world`; fuse_projections() may follow."""
    cfg = model.config
    for name, n in (("num_attention_heads", cfg.num_attention_heads), ("num_key_value_heads", cfg.num_key_value_heads),
                    ("intermediate_size", cfg.intermediate_size)):
        if n % world:
            raise ValueError(f"tensor_parallel_size={world}: must divide {name}={n}")
    if world == 1:
        return model
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.qkv_proj is None and mlp.gate_up_proj is None, "shard before fuse_projections()"
        hq, hkv, d = attn.num_heads // world, attn.num_kv_heads // world, attn.head_dim
        attn.q_proj = _rows(attn.q_proj, rank * hq * d, (rank + 1) * hq * d)
        attn.k_proj = _rows(attn.k_proj, rank * hkv * d, (rank + 1) * hkv * d)
        attn.v_proj = _rows(attn.v_proj, rank * hkv * d, (rank + 1) * hkv * d)
        attn.o_proj = RowParallelLinear(attn.o_proj, rank, world, group)
        attn.num_heads, attn.num_kv_heads = hq, hkv
        inter = cfg.intermediate_size // world
        mlp.gate_proj = _rows(mlp.gate_proj, rank * inter, (rank + 1) * inter)
        mlp.up_proj = _rows(mlp.up_proj, rank * inter, (rank + 1) * inter)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, world, group)
    return model
