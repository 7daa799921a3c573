"""Engine flags with vLLM's names, so a vLLM command line carries over. One source for the CLI and the offline API."""
from __future__ import annotations

import argparse
import ast
import inspect
from dataclasses import MISSING, dataclass, fields

from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig

_COMPONENTS = (ModelConfig, CacheConfig, SchedulerConfig, DeviceConfig, ParallelConfig)


@dataclass
class EngineArgs:
    model: str = "smollm2"
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    enforce_eager: bool = False
    max_prefill_cudagraph_tokens: int = 1024
    quantization: str | None = None
    block_size: int = 16
    kv_cache_memory: float | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    async_scheduling: bool | None = None
    device: str = "auto"
    tensor_parallel_size: int = 1

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


def add_engine_args(parser: argparse.ArgumentParser, *, model_default: str = "smollm2") -> argparse.ArgumentParser:
    group = parser.add_argument_group("engine")
    defaults = EngineArgs()
    for cls in _COMPONENTS:
        docs = _field_docs(cls)
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            default = model_default if f.name == "model" else getattr(defaults, f.name)
            help_text = docs.get(f.name, "")
            if f.type in ("bool", bool, "bool | None"):
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
                continue
            kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(f.type), str)
            group.add_argument(flag, type=kind, default=default, help=f"{help_text} (default: {default})")
    return parser
