"""Engine flags with vLLM's names, so a vLLM command line carries over. One source for the CLI and the offline API."""
from __future__ import annotations

import argparse
import ast
import inspect
from dataclasses import dataclass, fields

from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig

_COMPONENTS = (ModelConfig, CacheConfig, SchedulerConfig, DeviceConfig, ParallelConfig)


@dataclass
class EngineArgs:
    """Every component's fields, flat, each default taken from its component dataclass (vLLM's EngineArgs)."""
    model: str = "smollm2"  # (ModelConfig.model has none: a command line without --model runs the bundled SmolLM2)
    served_model_name: str | None = ModelConfig.served_model_name
    dtype: str = ModelConfig.dtype
    max_model_len: int | None = ModelConfig.max_model_len
    seed: int = ModelConfig.seed
    enforce_eager: bool = ModelConfig.enforce_eager
    max_prefill_cudagraph_tokens: int = ModelConfig.max_prefill_cudagraph_tokens
    quantization: str | None = ModelConfig.quantization
    block_size: int = CacheConfig.block_size
    kv_cache_memory: float | None = CacheConfig.kv_cache_memory
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    kv_cache_dtype: str = CacheConfig.kv_cache_dtype
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    num_gpu_blocks_override: int | None = CacheConfig.num_gpu_blocks_override
    swap_space: float = CacheConfig.swap_space
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    async_scheduling: bool | None = SchedulerConfig.async_scheduling
    new_token_ratio: float = SchedulerConfig.new_token_ratio
    preemption_mode: str = SchedulerConfig.preemption_mode
    device: str = DeviceConfig.device
    tensor_parallel_size: int = ParallelConfig.tensor_parallel_size

    def create_engine_config(self) -> EngineConfig:
        def build(cls):
            return cls(**{f.name: getattr(self, f.name) for f in fields(cls)})

        return EngineConfig(model=build(ModelConfig), cache=build(CacheConfig), scheduler=build(SchedulerConfig),
                            device=build(DeviceConfig), parallel=build(ParallelConfig))

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})


def _field_docs(cls) -> dict[str, str]:
    """The string literal under each dataclass field is its help text."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for prev, node in zip(body, body[1:]):
        if isinstance(prev, ast.AnnAssign) and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docs[prev.target.id] = str(node.value.value)
    return docs


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("engine")
    defaults = EngineArgs()
    for cls in _COMPONENTS:
        docs = _field_docs(cls)
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            default = getattr(defaults, f.name)
            help_text = docs.get(f.name, "")
            if f.type in ("bool", bool, "bool | None"):
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
                continue
            kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(f.type), str)
            group.add_argument(flag, type=kind, default=default, help=f"{help_text} (default: {default})")
    return parser
