"""Tensor parallelism applied from outside the plain model (gpt-fast's tp.py pattern), for any world size.

Megatron's split of a Llama-family layer across `world` ranks of a torch.distributed group (NCCL on GPUs, gloo on
the CPU): q/k/v and gate/up are split by output rows (each rank owns num_heads/world query heads, num_kv_heads/world
KV heads and intermediate/world MLP columns), o_proj and down_proj by input columns, followed by one all-reduce
each. Embeddings, norms and lm_head stay replicated. Each rank's KV cache then holds only its own KV heads.

fp8 linears (engine/quant.py's Fp8Linear) split the same way: a column-parallel piece takes its output channels'
fp8 rows, scales and bias; a row-parallel piece takes its input columns of the fp8 weight and keeps every output
channel's scale whole. 4-bit linears (engine/quant_w4.py's W4Linear) likewise: a column-parallel piece takes its
outputs' packed columns, scales and zero points, a row-parallel one whole groups of inputs (act order is refused
above one rank). A checkpoint's static input_scale is one per tensor, so every rank keeps it. With dynamic
activation scales a row-parallel piece quantizes its own slice of each token (vLLM does the same): its scales come
from that slice's amax, so tp > 1 differs from tp = 1 by that rounding (tests/engine/test_tp.py). Online fp8
(`--quantization fp8`) quantizes before the split, load -> quantize_model -> shard_model -> fuse_projections, so the
ranks hold exactly the fp8 weights and scales one process would; an fp8 checkpoint is loaded in fp8 already.

Status: the engine drives it (`--tensor-parallel-size N`, `LLM(..., tensor_parallel_size=N)`): engine/tp_executor.py
spawns ranks 1..N-1 (engine/tp_worker.py), engine/loader.build_model splits each layer as it loads (shard_layer), and
every step runs on every rank. Tested: 2 gloo ranks equal one process at the model level (tests/engine/test_tp.py,
16-bit and fp8) and through the engine, token for token (tests/engine/test_tp_engine.py, on the CPU and, with NCCL, CUDA
graphs and async scheduling, on two GPUs in float32 and bf16; where it last ran: bench/RESULTS.md). The prefill and
decode workers run it too: their KV transfers move whole blocks, gathered from and scattered to the ranks
(engine/sharded_kv.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.model import Linear, LlamaForCausalLM
from engine.quant import Fp8Linear, check_fp8_shape
from engine.quant_w4 import W4Linear


def _rows(linear: nn.Module, start: int, end: int) -> nn.Module:
    """The column-parallel piece of `linear`: output channels [start, end), with their scales and bias."""
    if isinstance(linear, W4Linear):
        return linear.rows(start, end)
    if isinstance(linear, Fp8Linear):
        if linear.weight.is_cuda:
            check_fp8_shape(f"a column-parallel shard of {linear.out_features} rows", end - start, linear.in_features)
        return Fp8Linear(linear.weight[start:end].clone(), linear.weight_scale[:, start:end].clone(),
                         None if linear.bias is None else linear.bias[start:end].clone(),
                         None if linear.input_scale is None else linear.input_scale.clone())
    out = Linear(linear.in_features, end - start, bias=linear.bias is not None, device=linear.weight.device,
                 dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(linear.weight[start:end])
        if linear.bias is not None:
            out.bias.copy_(linear.bias[start:end])
    return out


def _columns(linear: nn.Module, start: int, end: int) -> nn.Module:
    """The row-parallel piece of `linear`: input features [start, end); an fp8 piece keeps every output channel's
    scale (each rank's partial sums share it)."""
    assert linear.bias is None, "row-parallel layers of this family carry no bias"
    if isinstance(linear, W4Linear):
        return linear.columns(start, end)
    if isinstance(linear, Fp8Linear):
        if linear.weight.is_cuda:
            check_fp8_shape(f"a row-parallel shard of {linear.in_features} columns", linear.out_features, end - start)
        return Fp8Linear(linear.weight[:, start:end].contiguous(), linear.weight_scale.clone(), None,
                         None if linear.input_scale is None else linear.input_scale.clone())
    out = Linear(end - start, linear.out_features, bias=False, device=linear.weight.device,
                 dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(linear.weight[:, start:end])
    return out


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T): a linear whose input features are split across the group."""

    def __init__(self, linear: nn.Module, rank: int, world: int, group=None):
        super().__init__()
        cols = linear.in_features // world
        self.linear = _columns(linear, rank * cols, (rank + 1) * cols)  # nn.Linear or Fp8Linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        dist.all_reduce(y, group=self.group)
        return y


def check_tensor_parallel(config, world: int, device: torch.device | None = None, local: int | None = None) -> None:
    """ValueError naming the field when `world` ranks cannot split this model (or, on CUDA, find their GPUs: `local`
    of them on this host, all of them by default)."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        n = getattr(config, name)
        if n % world:
            raise ValueError(f"tensor_parallel_size={world}: must divide {name}={n}")
    local = world if local is None else local
    if device is not None and device.type == "cuda" and local > 1:
        base, count = device.index or 0, torch.cuda.device_count()
        if base + local > count:
            raise ValueError(f"tensor_parallel_size={world}: ranks on cuda:{base}..cuda:{base + local - 1} need "
                             f"{base + local} GPUs, torch.cuda.device_count()={count}")


@torch.no_grad()
def shard_layer(layer: nn.Module, rank: int, world: int, group=None) -> None:
    """Splits one loaded, unfused decoder layer in place for `rank` of `world` (engine/loader.build_model calls this
    on each layer as it loads, so the whole model never sits on one device)."""
    attn, mlp = layer.self_attn, layer.mlp
    assert attn.qkv_proj is None and mlp.gate_up_proj is None, "shard before fuse_projections()"
    hq, hkv, d = attn.num_heads // world, attn.num_kv_heads // world, attn.head_dim
    attn.q_proj = _rows(attn.q_proj, rank * hq * d, (rank + 1) * hq * d)
    attn.k_proj = _rows(attn.k_proj, rank * hkv * d, (rank + 1) * hkv * d)
    attn.v_proj = _rows(attn.v_proj, rank * hkv * d, (rank + 1) * hkv * d)
    attn.o_proj = RowParallelLinear(attn.o_proj, rank, world, group)
    attn.num_heads, attn.num_kv_heads = hq, hkv
    inter = mlp.gate_proj.out_features // world
    mlp.gate_proj = _rows(mlp.gate_proj, rank * inter, (rank + 1) * inter)
    mlp.up_proj = _rows(mlp.up_proj, rank * inter, (rank + 1) * inter)
    mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, world, group)


@torch.no_grad()
def shard_model(model: LlamaForCausalLM, rank: int, world: int, group=None) -> LlamaForCausalLM:
    """Splits a loaded, unfused model (16-bit or fp8 linears) in place for `rank` of `world`; fuse_projections() may
    follow."""
    check_tensor_parallel(model.config, world)
    if world == 1:
        return model
    for layer in model.model.layers:
        shard_layer(layer, rank, world, group)
    return model
