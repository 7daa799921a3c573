"""Engine flags with vLLM's names, so a vLLM command line carries over. One source for the CLI and the offline API.

Every value a flag takes is checked when the command line is parsed, by the component dataclass that owns the field
(its __post_init__): a value it refuses is a usage error naming the flag ("argument --block-size: block_size=0: must
be in [1, 1024]"), never a worker that dies with a traceback at start. Fields with a fixed set of values list it as
argparse choices. A few vLLM flags name what Tandem always does (`--enable-chunked-prefill`) or does not have yet
(`--pipeline-parallel-size`): they take the one value that is true here and refuse the others at parse time.
What only loading can tell (the checkpoint's format for --quantization, a device that is not there) fails at load
with a ValueError naming the flag; the commands print it and exit 1.
"""
from __future__ import annotations

import argparse
import ast
import inspect
from dataclasses import MISSING, dataclass, fields

import torch

from engine.config import (_DTYPES, DTYPE_ALIASES, KV_CACHE_DTYPES, PREFILL_CPU_MAX_NUM_BATCHED_TOKENS,
                           QUANTIZATION_METHODS, CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig,
                           SchedulerConfig)

_COMPONENTS = (ModelConfig, CacheConfig, SchedulerConfig, DeviceConfig, ParallelConfig)
# The fields whose values are a fixed set (argparse lists them in --help and refuses the rest).
_CHOICES = {"dtype": ("auto", *_DTYPES, *DTYPE_ALIASES), "kv_cache_dtype": KV_CACHE_DTYPES,
            "quantization": QUANTIZATION_METHODS}
# The fields whose default depends on the engine's role and device: EngineArgs leaves them None, "not given", so that
# a worker can put its role's default in (serving/worker.py); create_engine_config gives the rest their component's.
# The value is the default --help shows.
_ROLE_DEFAULTS = {"max_num_batched_tokens": f"{SchedulerConfig.max_num_batched_tokens}; "
                                            f"{PREFILL_CPU_MAX_NUM_BATCHED_TOKENS} for a prefill worker on the CPU"}


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
    tokenizer: str | None = ModelConfig.tokenizer
    quantization: str | None = ModelConfig.quantization
    block_size: int = CacheConfig.block_size
    kv_cache_memory: float | None = CacheConfig.kv_cache_memory
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    kv_cache_dtype: str = CacheConfig.kv_cache_dtype
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    num_gpu_blocks_override: int | None = CacheConfig.num_gpu_blocks_override
    swap_space: float = CacheConfig.swap_space
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int | None = None  # (not given: _ROLE_DEFAULTS)
    async_scheduling: bool | None = SchedulerConfig.async_scheduling
    new_token_ratio: float = SchedulerConfig.new_token_ratio
    preemption_mode: str = SchedulerConfig.preemption_mode
    device: str = DeviceConfig.device
    cpu_threads: int | None = DeviceConfig.cpu_threads
    cpu_cores: str | None = DeviceConfig.cpu_cores
    tensor_parallel_size: int = ParallelConfig.tensor_parallel_size
    nnodes: int = ParallelConfig.nnodes
    node_rank: int = ParallelConfig.node_rank
    master_addr: str = ParallelConfig.master_addr
    master_port: int = ParallelConfig.master_port

    def create_engine_config(self) -> EngineConfig:
        def value(f):
            given = getattr(self, f.name)
            return f.default if given is None and f.name in _ROLE_DEFAULTS else given

        def build(cls):
            return cls(**{f.name: value(f) for f in fields(cls)})

        config = EngineConfig(model=build(ModelConfig), cache=build(CacheConfig), scheduler=build(SchedulerConfig),
                              device=build(DeviceConfig), parallel=build(ParallelConfig))
        config.parallel.check()
        _check_device(config.device.torch_device)
        return config

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


def _check_device(device: torch.device) -> None:
    """A CUDA device that this host does not have is a ValueError naming --device (torch would assert)."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}: this host has no CUDA device (torch.cuda.is_available() is "
                         "False); use --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device={str(device)!r}: this host has {torch.cuda.device_count()} CUDA device(s)")


def _checked(cls, name: str, kind):
    """argparse's type= for field `name` of component `cls`: the value converted by `kind`, then checked by `cls`'s
    own validation (its ValueError becomes the flag's usage error)."""
    required = {f.name: "" for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}

    def parse(raw: str):
        value = kind(raw)  # (a ValueError here: argparse's "invalid int value: 'x'")
        try:
            cls(**{**required, name: value})
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    parse.__name__ = kind.__name__
    return parse


class _AlwaysOn(argparse.BooleanOptionalAction):
    """A vLLM switch for what Tandem always does: the flag is accepted, its --no- form refused naming it."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string is not None and option_string.startswith("--no-"):
            raise argparse.ArgumentError(self, f"{self.help.split(';')[0]}: it cannot be turned off")
        super().__call__(parser, namespace, values, option_string)


def _one_stage(raw: str) -> int:
    value = int(raw)
    if value != 1:
        raise argparse.ArgumentTypeError(f"pipeline_parallel_size={value}: Tandem has no pipeline parallelism yet; "
                                         "only 1 (use --tensor-parallel-size to split a model over GPUs)")
    return value


def add_vllm_compat_args(group) -> None:
    """vLLM's flags for what needs no setting here (engine/args.py docstring)."""
    group.add_argument("--enable-chunked-prefill", action=_AlwaysOn, default=True,
                       help="chunked prefill is always on; --max-num-batched-tokens is the chunk budget (accepted for "
                            "vLLM command lines; --no-enable-chunked-prefill is refused)")
    group.add_argument("--pipeline-parallel-size", "-pp", type=_one_stage, default=1,
                       help="pipeline stages: only 1, no pipeline parallelism yet (accepted for vLLM command lines)")


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
            group.add_argument(flag, type=_checked(cls, f.name, kind), default=default, choices=_CHOICES.get(f.name),
                               help=f"{help_text} (default: {_ROLE_DEFAULTS.get(f.name, default)})")
    add_vllm_compat_args(group)
    return parser
