"""`tandem plan`: KV-cache sizing from a model's config alone (never its weights).

    usable      = memory * gpu_memory_utilization
    weights     = parameters counted from the config * bytes of --dtype
                  (--quantization fp8, or a checkpoint stored in fp8: the layers' linear weights at 1 byte, plus a
                  float32 scale per output channel and, for static activation scales, one per fused linear; linears
                  the checkpoint's quantization_config ignores stay in --dtype; a 4-bit checkpoint's linears at half
                  a byte, plus a 16-bit scale and, where stored, a 1-byte zero point per group and output)
    KV / token  = 2 (K and V) * layers * kv_heads * head_dim * bytes of --kv-cache-dtype
    blocks      = (usable - weights) // (block_size * KV / token)
    tokens      = blocks * block_size
    sequences   = blocks // ceil(max_model_len / block_size)      (how many max_model_len requests fit at once)

Like vLLM's rule of thumb, it leaves no room for activations, CUDA graphs or the allocator's slack: the engine's
profiled numbers will be somewhat lower. An int8 KV cache stores a float32 scale per (token, KV head) beside its
head_dim values (each block region holds its values, then its scales): head_dim + 4 bytes a row.

`tandem plan --from-bench results.json [--target-rps R] [--headroom 0.3]` answers from a measured benchmark
instead: peak concurrency per instance and instance counts for a request rate (engine/capacity.py).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from engine.config import DTYPE_ALIASES, FUSED_LINEARS, CacheConfig, ModelConfig, resolve_dtype
from engine.utils import cdiv

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_KV_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "int8": 1}
_INT8_ROW_PAD = 4  # an int8 row's float32 scale, stored in its block (kernels/quant_int8.INT8_ROW_PAD)
_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


@dataclass(frozen=True)
class Plan:
    model: str
    """The model spec planned for."""
    architecture: str
    """config.architectures[0]."""
    dtype: str
    """Weight dtype (resolved; never 'auto'): with quantization, the dtype of what is not quantized."""
    kv_cache_dtype: str
    """KV cache dtype (resolved; never 'auto')."""
    num_params: int
    """Parameters counted from the config (tied embeddings counted once)."""
    weight_bytes: int
    """num_params * bytes of dtype (quantization='fp8': the layers' linears at 1 byte + their scales)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_bytes_per_token: int
    """2 * num_layers * num_kv_heads * head_dim * bytes of kv_cache_dtype."""
    memory_bytes: int
    """Device memory given."""
    gpu_memory_utilization: float
    """Fraction of memory_bytes the engine may use."""
    kv_memory_bytes: int
    """int(memory_bytes * gpu_memory_utilization) - weight_bytes; negative when the weights do not fit."""
    block_size: int
    """Tokens per KV block."""
    num_blocks: int
    """KV blocks that fit in kv_memory_bytes (0 when it is negative)."""
    max_kv_tokens: int
    """num_blocks * block_size."""
    max_model_len: int
    """Context length of one sequence."""
    max_num_seqs_at_max_len: int
    """Sequences of max_model_len tokens whose KV fits at once."""
    quantization: str | None = None
    """The weights' quantization (None; 'fp8': --quantization fp8, or a checkpoint stored in fp8; a 4-bit
    checkpoint's quant_method: 'awq', 'gptq', 'compressed-tensors')."""

    @property
    def fits(self) -> bool:
        return self.max_num_seqs_at_max_len >= 1


def parse_size(text: str, flag: str = "--memory") -> int:
    """'80GiB' -> 85899345920; units B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024)."""
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"{flag}={text!r}: not a size; write a number with an optional unit, e.g. 80GiB, 80GB, 512MiB, 1024 "
            f"(units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"{flag}={text!r}: must be > 0 bytes")
    return value


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def count_params(config: PretrainedConfig) -> int:
    """Parameters of a Llama/Mistral/Qwen2 decoder with this config, exactly as transformers builds it."""
    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    hd, nh = _head_dim(config), config.num_attention_heads
    nkv = getattr(config, "num_key_value_heads", None) or nh
    arch = config.architectures[0]
    qkv_bias = arch == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False))
    o_bias = arch != "Qwen2ForCausalLM" and bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    attn = h * nh * hd + 2 * h * nkv * hd + nh * hd * h
    attn += (nh * hd + 2 * nkv * hd if qkv_bias else 0) + (h if o_bias else 0)
    mlp = 3 * h * inter + ((2 * inter + h) if mlp_bias else 0)
    per_layer = attn + mlp + 2 * h  # + input and post-attention norms
    embed = vocab * h
    head = 0 if config.tie_word_embeddings else vocab * h
    return embed + config.num_hidden_layers * per_layer + h + head


_LAYER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")  # linear_shapes' order


def linear_shapes(config: PretrainedConfig) -> list[tuple[int, int]]:
    """(out_features, in_features) of one decoder layer's linears as the engine runs them (q/k/v and gate/up fused):
    what `--quantization fp8` stores in fp8."""
    h, inter = config.hidden_size, config.intermediate_size
    hd, nh = _head_dim(config), config.num_attention_heads
    nkv = getattr(config, "num_key_value_heads", None) or nh
    return [(nh * hd + 2 * nkv * hd, h), (h, nh * hd), (2 * inter, h), (h, inter)]


def weight_bytes_of(config: PretrainedConfig, dtype: str, quantization: str | None = None) -> int:
    """Bytes of the weights in `dtype`; with quantization='fp8' the layers' linear weights take 1 byte each plus a
    float32 scale per output channel (engine/quant.py), everything else stays in `dtype`. A checkpoint stored in fp8
    (config.quantization_config) is sized as the engine loads it, with or without quantization='fp8': its fp8
    linears as above plus a float32 input scale per fused linear where its scales are static, the linears it
    ignores in `dtype`."""
    from engine.quant import Fp8Scheme, fp8_checkpoint
    from engine.quant_w4 import w4_checkpoint

    total = count_params(config) * _DTYPE_BYTES[dtype]
    w4 = w4_checkpoint(config)
    if w4 is not None:
        if quantization not in (None, w4.quant_method):
            raise ValueError(f"quantization={quantization!r}: the checkpoint stores 4-bit weights: must be None or "
                             f"{w4.quant_method!r}")
        for i in range(config.num_hidden_layers):
            for (n, k), name in zip(linear_shapes(config), _LAYER_LINEARS):
                scheme = w4.scheme(f"model.layers.{i}.{FUSED_LINEARS.get(name, (name,))[0]}")
                if scheme is not None:  # engine/quant_w4.py's W4Linear: packed q, 16-bit scales, uint8 zeros
                    groups = scheme.groups(k) * n
                    total += n * k // 2 - n * k * _DTYPE_BYTES[dtype] + 2 * groups + (groups if scheme.zero_points
                                                                                        else 0)
        return total
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization={quantization!r}: must be one of None, fp8")
    checkpoint = fp8_checkpoint(config)
    if quantization is None and checkpoint is None:
        return total
    online = Fp8Scheme(per_channel=True, static_input=False)
    for i in range(config.num_hidden_layers):
        for (n, k), name in zip(linear_shapes(config), _LAYER_LINEARS):
            shard = FUSED_LINEARS.get(name, (name,))[0]  # a fused linear has its shards' scheme (one for all)
            scheme = online if checkpoint is None else checkpoint.scheme(f"model.layers.{i}.{shard}")
            if scheme is not None:
                total += n * k * (1 - _DTYPE_BYTES[dtype]) + 4 * n + (4 if scheme.static_input else 0)
    return total


def _resolve_kv_dtype(kv_cache_dtype: str, dtype: str) -> str:
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype == "int8":
        return "int8"
    if kv_cache_dtype in _KV_DTYPE_BYTES:
        return "fp8_e4m3"
    name = DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if name not in _DTYPE_BYTES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r}: must be one of auto, fp8, fp8_e4m3, int8, {', '.join(_DTYPE_BYTES)}"
        )
    return name


def plan(
    model_spec: str,
    memory_bytes: int,
    max_model_len: int,
    dtype: str = ModelConfig.dtype,
    kv_cache_dtype: str = CacheConfig.kv_cache_dtype,
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization,
    block_size: int = CacheConfig.block_size,
    quantization: str | None = ModelConfig.quantization,
) -> Plan:
    """Size the KV cache of `model_spec` in `memory_bytes` of device memory. Reads only the config."""
    if not isinstance(memory_bytes, int) or memory_bytes <= 0:
        raise ValueError(f"memory_bytes={memory_bytes!r}: must be an int > 0")
    if not isinstance(max_model_len, int) or max_model_len < 1:
        raise ValueError(f"max_model_len={max_model_len!r}: must be an int >= 1")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization!r}: must be in (0, 1]")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r}: must be an int >= 1")
    from engine.loader import resolve_model

    config = resolve_model(model_spec).config
    if max_model_len > config.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len}: must be <= {config.max_position_embeddings} "
            f"(max_position_embeddings of {model_spec})"
        )
    wdtype = str(resolve_dtype(dtype, config, torch.device("cuda"))).removeprefix("torch.")  # sized for a GPU
    kvdtype = _resolve_kv_dtype(kv_cache_dtype, wdtype)
    if getattr(config, "quantization_config", None) is not None:
        from engine.quant_w4 import w4_checkpoint

        w4 = w4_checkpoint(config)  # resolve_model accepts 4-bit and fp8 checkpoints only
        if w4 is not None:
            quantization = quantization or w4.quant_method  # weight_bytes_of checks a --quantization given
        elif quantization is None:
            quantization = "fp8"
    kv_elem = _KV_DTYPE_BYTES.get(kvdtype) or _DTYPE_BYTES[kvdtype]
    num_params = count_params(config)
    weight_bytes = weight_bytes_of(config, wdtype, quantization)
    nkv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    hd = _head_dim(config)
    row = hd * kv_elem + (_INT8_ROW_PAD if kvdtype == "int8" else 0)
    kv_per_token = 2 * config.num_hidden_layers * nkv * row
    kv_memory = int(memory_bytes * gpu_memory_utilization) - weight_bytes
    num_blocks = max(kv_memory, 0) // (block_size * kv_per_token)
    return Plan(
        model=model_spec, architecture=config.architectures[0], dtype=wdtype, kv_cache_dtype=kvdtype,
        num_params=num_params, weight_bytes=weight_bytes, num_layers=config.num_hidden_layers, num_kv_heads=nkv,
        head_dim=hd, kv_bytes_per_token=kv_per_token, memory_bytes=memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization, kv_memory_bytes=kv_memory, block_size=block_size,
        num_blocks=num_blocks, max_kv_tokens=num_blocks * block_size, max_model_len=max_model_len,
        max_num_seqs_at_max_len=num_blocks // cdiv(max_model_len, block_size), quantization=quantization,
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def _quantized_label(quantization: str | None) -> str:
    if quantization is None:
        return ""
    return ", layer linears fp8" if quantization == "fp8" else f", layer linears 4-bit ({quantization})"


def format_plan(p: Plan) -> str:
    row = p.kv_bytes_per_token // (2 * p.num_layers * p.num_kv_heads)
    row_text = f"({p.head_dim} + {_INT8_ROW_PAD} B scale)" if p.kv_cache_dtype == "int8" else \
        f"{p.head_dim} head_dim x {row // p.head_dim} B"
    rows = [
        ("model", f"{p.model} ({p.architecture})"),
        ("parameters", f"{p.num_params:,}"),
        (f"weights ({p.dtype}{_quantized_label(p.quantization)})",
         f"{p.weight_bytes:,} B = {_gib(p.weight_bytes)}"),
        (f"KV bytes per token ({p.kv_cache_dtype})",
         f"{p.kv_bytes_per_token:,} = 2 x {p.num_layers} layers x {p.num_kv_heads} kv heads x {row_text}"),
        ("usable memory", f"{_gib(p.memory_bytes)} x {p.gpu_memory_utilization:g} = "
                          f"{_gib(int(p.memory_bytes * p.gpu_memory_utilization))}"),
        ("left for KV cache", _gib(p.kv_memory_bytes)),
        (f"KV blocks ({p.block_size} tokens)", f"{p.num_blocks:,}"),
        ("KV tokens", f"{p.max_kv_tokens:,}"),
        (f"sequences of {p.max_model_len:,} tokens", f"{p.max_num_seqs_at_max_len:,}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if p.kv_memory_bytes < 0:
        lines.append("DOES NOT FIT: the weights alone exceed the usable memory")
    elif not p.fits:
        lines.append(f"DOES NOT FIT: not even one sequence of max_model_len={p.max_model_len} tokens")
    lines.append("(no room reserved for activations or CUDA graphs: the engine's profiled numbers will be lower)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem plan", description="KV-cache sizing: bytes per token and how many sequences fit in a memory budget "
        "(--model --memory --max-model-len); or, from a measured benchmark (--from-bench), peak concurrency per "
        "instance and the prefill and decode instances a request rate needs."
    )
    parser.add_argument("--model", help="smollm2, random:<preset>, a HuggingFace dir or a .gguf file")
    parser.add_argument("--memory", help="device memory, e.g. 80GiB, 80GB, 512MiB")
    parser.add_argument("--max-model-len", help="context length of one sequence (tokens)")
    parser.add_argument("--from-bench", metavar="RESULTS_JSON",
                        help="a JSON bench/throughput.py or bench/serve.py wrote: plan capacity from its measurements")
    parser.add_argument("--target-rps", help="with --from-bench: the request rate (req/s) to size instances for")
    parser.add_argument("--headroom", default=None,
                        help="with --from-bench: capacity kept free, in [0, 1) (default 0.3: 30%%)")
    parser.add_argument("--bench-rate", default=None,
                        help="with a bench/serve.py sweep: the run (request rate) to read (default: the run with "
                             "the highest output throughput)")
    parser.add_argument("--dtype", default=ModelConfig.dtype, help="weight dtype: auto, bfloat16, float16, float32")
    parser.add_argument("--kv-cache-dtype", default=CacheConfig.kv_cache_dtype,
                        help="auto (the weight dtype), fp8, or a float dtype")
    # (strings, as typed: main() parses and checks them, naming the flag)
    parser.add_argument("--gpu-memory-utilization", default=str(CacheConfig.gpu_memory_utilization),
                        help="fraction of the memory to use, in (0, 1]")
    parser.add_argument("--block-size", default=str(CacheConfig.block_size), help="tokens per KV block")
    parser.add_argument("--quantization", default=ModelConfig.quantization,
                        help="fp8: the layers' linear weights in fp8 (as the engine's flag; a checkpoint stored in fp8 "
                             "or 4 bits is sized as it loads without it)")
    return parser


def _int_flag(parser: argparse.ArgumentParser, flag: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        parser.error(f"{flag}={text!r}: must be an integer, e.g. {flag} 4096")
    if value < 1:
        parser.error(f"{flag}={text!r}: must be >= 1")
    return value


def main(argv: list[str] | None = None) -> int:
    """Print the plan; exit status 1 when not even one max_model_len sequence fits, 2 on bad arguments."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.from_bench is not None:
        return _main_from_bench(parser, ns)
    for flag in ("model", "memory", "max_model_len"):
        if getattr(ns, flag) is None:
            parser.error(f"--{flag.replace('_', '-')} is required (or --from-bench RESULTS_JSON)")
    try:
        memory = parse_size(ns.memory, "--memory")
    except ValueError as e:
        parser.error(str(e))
    max_model_len = _int_flag(parser, "--max-model-len", ns.max_model_len)
    block_size = _int_flag(parser, "--block-size", ns.block_size)
    try:
        util = float(ns.gpu_memory_utilization)
    except ValueError:
        util = math.nan
    if not 0.0 < util <= 1.0:
        parser.error(f"--gpu-memory-utilization={ns.gpu_memory_utilization!r}: must be a number in (0, 1], e.g. 0.9")
    flags = {"memory_bytes": "--memory", "max_model_len": "--max-model-len", "dtype": "--dtype",
             "kv_cache_dtype": "--kv-cache-dtype", "model": "--model", "quantization": "--quantization"}
    try:
        p = plan(ns.model, memory, max_model_len, dtype=ns.dtype, kv_cache_dtype=ns.kv_cache_dtype,
                 gpu_memory_utilization=util, block_size=block_size, quantization=ns.quantization)
    except ValueError as e:
        msg = str(e)
        for field, flag in flags.items():  # name the flag the user typed, not the Python field
            if msg.startswith(f"{field}="):
                msg = flag + msg[len(field):]
                break
        parser.error(msg)
    print(format_plan(p))
    return 0 if p.fits else 1


def _number_flag(parser: argparse.ArgumentParser, flag: str, text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        parser.error(f"{flag}={text!r}: must be a number")
    return value


def _main_from_bench(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from engine.capacity import DEFAULT_HEADROOM, capacity_plan, format_capacity, read_measurement

    given = [f"--{f.replace('_', '-')}" for f in ("model", "memory", "max_model_len") if getattr(ns, f) is not None]
    if given:
        parser.error(f"{', '.join(given)}: not used with --from-bench (the benchmark measured its own setup)")
    target = _number_flag(parser, "--target-rps", ns.target_rps)
    headroom = _number_flag(parser, "--headroom", ns.headroom)
    headroom = DEFAULT_HEADROOM if headroom is None else headroom
    if target is not None and target <= 0:
        parser.error(f"--target-rps={ns.target_rps!r}: must be > 0")
    if not 0.0 <= headroom < 1.0:
        parser.error(f"--headroom={ns.headroom!r}: must be in [0, 1), e.g. 0.3 for 30%")
    try:
        m = read_measurement(ns.from_bench, _number_flag(parser, "--bench-rate", ns.bench_rate))
    except ValueError as e:
        parser.error(f"--from-bench {e}")
    print(format_capacity(capacity_plan(m, target, headroom)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
