"""fp8 linears, applied from outside the plain model: online quantization (`--quantization fp8`) after loading, and
checkpoints stored in fp8 (below).

What online fp8 does, once at load (engine/loader.py build_model quantizes each decoder layer as soon as it is
loaded, before fusing; `quantize_model(model, "fp8")` does the same to a whole loaded model, fused or not):
1. every nn.Linear of the decoder layers (q/k/v or qkv_proj, o_proj, gate/up or gate_up_proj, down_proj) becomes an
   Fp8Linear: its weight W [N, K] is stored as float8_e4m3fn with one float32 scale per output channel
   (W[n] ~ W_q[n] * s_w[n], s_w[n] = amax|W[n]| / 448), and the 16-bit weight is freed (Qwen2.5-7B's 13.1 GB of
   bf16 layer weights become 6.5 GB; the load never holds more than one layer of them); embeddings, lm_head and
   norms keep the model dtype. Rows are quantized independently, so quantizing q, k and v and then fusing them gives
   the fused linear's quantization bit for bit;
2. each forward quantizes its input per token (x[m] ~ x_q[m] * s_x[m], s_x[m] = amax|x[m]| / 448, computed on the
   fly: kernels/quant_fp8.py) and runs one fp8 GEMM, torch._scaled_mm(x_q, W_q^T, s_x [M, 1], s_w [1, N]) with the
   bias and the model dtype's output fused in: Hopper's fp8 tensor cores run at twice the bf16 rate, and a decode
   step reads half the weight bytes.

At batch 1..16 (x with at most as many rows as kernels/gemv.py's CONFIGS_FP8 holds for this weight's (N, K), on
CUDA), step 2 is the fp8-weight GEMV instead: x stays 16-bit, each fp8 weight is converted exactly and multiplied in
float32, y = (x @ W_q^T) * s_w + b. There the step reads the weights (half of bf16's bytes) and little else;
_scaled_mm is poor at M=1, and the activation quantizer costs a launch per linear.

Where the kernel that produces a linear's input can quantize it per token itself (the RMSNorm before qkv_proj and
gate_up_proj, SiLU-and-mul before down_proj), engine/fp8_fusion.py has it hand the linear a QuantizedActivation
(x_q, scale) in place of x: step 2's quantizer and the 16-bit round trip through memory are skipped.

On the CPU (tests) the same quantized operands are multiplied in float32: (x_q @ W_q^T) * s_x * s_w + b, the math
of the GPU's GEMM but for its accumulation order. The forward has no host syncs, so CUDA graphs capture it.
Accuracy: docs/quantization.md.

Checkpoints that are already fp8 (config.json's quantization_config: vLLM's `fp8`, or `compressed-tensors` with an
fp8 scheme) need no flag: `fp8_checkpoint(config)` reads the format, and `prepare_fp8_checkpoint(model, ...)`
(build_model, on the meta device, or load_weights) turns each linear the checkpoint stores in fp8 into an empty
Fp8Linear of its shape before any tensor is copied, so the checkpoint's weight, weight_scale (and input_scale) load
by name (gpt-fast's quantize.py pattern). A per-tensor weight_scale is broadcast to every output channel, so fusing
q/k/v or gate/up keeps each shard's own scale exactly; a static input_scale (one per tensor) replaces the per-token
scales, the largest of a fused group's shards serving the group, as vLLM does. 4-bit checkpoints (awq, gptq,
compressed-tensors pack-quantized) are engine/quant_w4.py's.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from engine.config import FUSED_LINEARS, QUANTIZATION_METHODS
from kernels._checks import FP8_DTYPE, FP8_MAX
from kernels.gemv import MAX_M, gemv_triton, table_config
from kernels.quant_fp8 import per_token_quant_fp8_ref, per_token_quant_fp8_triton

FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with fp8 tensor cores
# Hopper's fp8 MMA accumulates in fewer than 32 bits unless the kernel promotes partial sums itself; fast accumulation
# skips that promotion (vLLM's CUTLASS fp8 kernels do the same). bench/fp8_gemm.py times both.
FP8_FAST_ACCUM = True


def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (w_q [N, K] float8_e4m3fn, scale [N, 1] float32) with w ~ w_q * scale, one scale per row: the
    activations' per-token rule, applied to the weight's output channels."""
    return per_token_quant_fp8_ref(w)


def fp8_linear_ref(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(x_q @ w_q^T) * x_scale * w_scale (+ bias) in float32, rounded to out_dtype once.
    x_q [M, K], x_scale [M, 1], w_q [N, K], w_scale [1, N] -> [M, N]."""
    y = torch.mm(x_q.float(), w_q.float().t()) * x_scale * w_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def scaled_mm_fp8(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype, use_fast_accum: bool = FP8_FAST_ACCUM
                  ) -> torch.Tensor:
    """The same product through torch._scaled_mm (row-wise scaling): mat1 row-major [M, K], mat2 column-major [K, N]
    (w_q [N, K] contiguous, transposed as a view), scale_a [M, 1] and scale_b [1, N] contiguous float32, K and N
    multiples of 16; the bias has out_dtype."""
    return torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)


def static_quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> x_q [M, K] float8_e4m3fn with x ~ x_q * scale, one float32 scale [1] for the whole tensor (a
    checkpoint's static input_scale): clamp(x / scale, -448, 448) rounded to nearest even."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


@dataclass(frozen=True)
class QuantizedActivation:
    """A linear's input, quantized per token by the kernel that produced it (engine/fp8_fusion.py): what
    Fp8Linear.forward would have made of the 16-bit activation it stands for, bit for bit."""
    x_q: torch.Tensor
    """[..., K] float8_e4m3fn, contiguous."""
    scale: torch.Tensor
    """[..., 1] float32, contiguous: x[m] ~ x_q[m] * scale[m]."""
    dtype: torch.dtype
    """The 16-bit activation's dtype: the GEMM writes its output in it."""

    @property
    def shape(self) -> torch.Size:
        """The activation's shape (the model reads its row count)."""
        return self.x_q.shape


class Fp8Linear(nn.Module):
    """y = x W^T + b with W in float8_e4m3fn (a float32 scale per output channel), x quantized per token, or with the
    checkpoint's static input_scale where it has one (or, at the row counts CONFIGS_FP8 holds, x unquantized through
    the fp8-weight GEMV)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 input_scale: torch.Tensor | None = None):
        super().__init__()
        assert weight.dtype == FP8_DTYPE and weight.dim() == 2, (weight.dtype, weight.shape)
        self.out_features, self.in_features = weight.shape
        # [N, K] contiguous: weight.t() is the column-major [K, N] operand torch._scaled_mm wants, with no copy.
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale.float().reshape(1, self.out_features).contiguous(),
                                         requires_grad=False)  # [1, N]
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)  # [N], model dtype
        self.input_scale = (None if input_scale is None else  # [1] float32: static activation scale
                            nn.Parameter(input_scale.float().reshape(1).contiguous(), requires_grad=False))

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        w_q, scale = quantize_weight_fp8(linear.weight)
        return cls(w_q, scale, linear.bias)

    @classmethod
    def empty(cls, linear: nn.Linear, static_input: bool) -> "Fp8Linear":
        """An Fp8Linear of `linear`'s shape, device and bias dtype, its tensors uninitialized: for load_weights. On
        the meta device (build_model) it allocates nothing: the shells become fp8 tensors when their layer loads."""
        n, k = linear.weight.shape
        device = linear.weight.device
        bias = None if linear.bias is None else torch.empty_like(linear.bias)
        scale = torch.empty(n, device=device, dtype=torch.float32)
        return cls(torch.empty(n, k, dtype=FP8_DTYPE, device=device), scale, bias,
                   torch.empty(1, device=device, dtype=torch.float32) if static_input else None)

    @classmethod
    @torch.no_grad()
    def concat(cls, linears: list["Fp8Linear"]) -> "Fp8Linear":
        """One Fp8Linear whose output is the linears' outputs side by side (fused q/k/v, gate/up): the fp8 rows and
        their scales are concatenated, so each keeps its own scale; a static input scale is the largest of theirs."""
        assert all(isinstance(m, Fp8Linear) for m in linears), [type(m).__name__ for m in linears]
        has_bias, static = linears[0].bias is not None, linears[0].input_scale is not None
        assert all((m.bias is not None) == has_bias and (m.input_scale is not None) == static for m in linears)
        return cls(torch.cat([m.weight for m in linears]), torch.cat([m.weight_scale for m in linears], dim=1),
                   torch.cat([m.bias for m in linears]) if has_bias else None,
                   torch.stack([m.input_scale for m in linears]).amax().reshape(1) if static else None)

    def _gemv_config(self, rows: int, x: torch.Tensor):
        """kernels/gemv.py's config for `rows` rows of x's dtype and device, or None (the fp8 GEMM then)."""
        if x.is_cuda and 0 < rows <= MAX_M and x.dtype != torch.float32:
            return table_config(rows, self.out_features, self.in_features, fp8=True)
        return None

    def quantizes_input(self, x: torch.Tensor) -> bool:
        """Whether forward quantizes an input with x's rows (leading dims), dtype and device per token on the fly
        (no static input scale, more rows than the fp8 GEMV serves): then a QuantizedActivation may stand for it."""
        return self.input_scale is None and self._gemv_config(math.prod(x.shape[:-1]), x) is None

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        if isinstance(x, QuantizedActivation):  # quantized by its producer: the GEMM alone
            assert self.input_scale is None and x.x_q.shape[-1] == self.in_features, (x.x_q.shape, self)
            x_q, x_scale = x.x_q.reshape(-1, self.in_features), x.scale.reshape(-1, 1)
            if x_q.is_cuda:
                y = scaled_mm_fp8(x_q, x_scale, self.weight, self.weight_scale, self.bias, x.dtype)
            else:
                y = fp8_linear_ref(x_q, x_scale, self.weight, self.weight_scale, self.bias, x.dtype)
            return y.reshape(*x.shape[:-1], self.out_features)  # [..., N]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        M = x2.shape[0]
        cfg = self._gemv_config(M, x)
        if cfg is not None:  # small M: read the fp8 weights once, x unquantized (no quantizer launch)
            y = gemv_triton(x2, self.weight, self.bias, weight_scale=self.weight_scale, config=cfg)
            return y.reshape(*x.shape[:-1], self.out_features)
        if self.input_scale is not None:  # the checkpoint's static scale: [1] -> [M, 1], row-wise as below
            x_q, x_scale = static_quant_fp8(x2, self.input_scale), self.input_scale.expand(M, 1).contiguous()
        elif x.is_cuda:
            x_q, x_scale = per_token_quant_fp8_triton(x2)
        else:
            x_q, x_scale = per_token_quant_fp8_ref(x2)
        if x.is_cuda:
            y = scaled_mm_fp8(x_q, x_scale, self.weight, self.weight_scale, self.bias, x.dtype)
        else:
            y = fp8_linear_ref(x_q, x_scale, self.weight, self.weight_scale, self.bias, x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)  # [..., N]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_scale={'static' if self.input_scale is not None else 'per token'}")


def check_fp8_support(device: torch.device, dtype: torch.dtype) -> None:
    """Raises ValueError naming what is missing when this device and model dtype cannot run the fp8 GEMM."""
    if device.type != "cuda":
        return
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"quantization='fp8' with dtype={str(dtype).removeprefix('torch.')}: on CUDA the fp8 GEMM "
                         "(torch._scaled_mm) writes bfloat16 or float16 (with their bias); use --dtype bfloat16")
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < FP8_MIN_CAPABILITY:
        raise ValueError(f"quantization='fp8': {torch.cuda.get_device_name(device)} ({device}) is sm_{cap[0]}{cap[1]}; "
                         f"fp8 GEMMs need compute capability >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} "
                         "(Ada, Hopper or newer); drop --quantization, or serve a 16-bit checkpoint for an fp8 one")
    if not hasattr(torch, "_scaled_mm"):
        raise ValueError(f"quantization='fp8': torch {torch.__version__} has no torch._scaled_mm")


def check_fp8_shape(name: str, n: int, k: int) -> None:
    """Raises ValueError unless an fp8 weight [n, k] suits the GEMM on CUDA (engine/tp.py checks its shards too)."""
    if n % 16 or k % 16:
        raise ValueError(f"quantization='fp8': {name} has weight [{n}, {k}]; the fp8 GEMM on CUDA needs both "
                         "dimensions to be multiples of 16")


def check_quantization(method: str | None) -> None:
    """Raises ValueError naming `quantization` unless it is None or one of QUANTIZATION_METHODS."""
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={method!r}: must be one of None, {', '.join(QUANTIZATION_METHODS)}")


def layer_linear_names(model: nn.Module) -> list[str]:
    """Names (under model.model.layers) of the layers' 16-bit linears, the ones online fp8 quantizes."""
    return [name for name, module in model.model.layers.named_modules() if isinstance(module, nn.Linear)]


def check_online_fp8(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Everything quantize_model checks before replacing a linear, for a model that will live on `device` in `dtype`
    (it may still be on the meta device: only shapes are read). Shapes are checked as they run, fused: an unfused
    model's q/k/v (gate/up) count as one qkv_proj (gate_up_proj) of their rows together."""
    names = layer_linear_names(model)
    if not names:
        return
    check_fp8_support(device, dtype)
    if device.type != "cuda":
        return
    shapes: dict[str, tuple[int, int]] = {}
    for name in names:
        n, k = model.model.layers.get_submodule(name).weight.shape
        layer, _, linear = name.partition(".")  # "3", "self_attn.q_proj"
        key = f"{layer}.{_FUSED_INTO.get(linear, linear)}"
        shapes[key] = (shapes.get(key, (0, k))[0] + n, k)
    for key, (n, k) in shapes.items():
        check_fp8_shape(f"model.layers.{key}", n, k)


@torch.no_grad()
def quantize_linears(module: nn.Module) -> None:
    """Replaces every nn.Linear inside `module` (one decoder layer, or all of them) by Fp8Linear.from_linear, one at a
    time: each 16-bit weight goes back to the allocator once replaced (when nothing else holds it)."""
    names = [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        setattr(parent, attr, Fp8Linear.from_linear(getattr(parent, attr)))


@torch.no_grad()
def quantize_model(model: nn.Module, method: str | None) -> nn.Module:
    """Replaces every nn.Linear of model.model.layers by its quantized form, in place (method 'fp8'); None and the
    4-bit methods (checkpoints loaded as they are) leave the model as is, and so does a model loaded from an fp8
    checkpoint or already quantized as it loaded (engine/loader.py build_model: its quantization_config chose which
    linears are fp8: those it left in 16 bits stay so). Before or after fuse_projections() alike: each output channel
    has its own scale, so quantizing the shards one by one and concatenating them gives the fused linear's
    quantization exactly."""
    check_quantization(method)
    if method != "fp8":  # awq, gptq, compressed-tensors: checkpoints loaded as they are (engine/quant_w4.py)
        return model
    layers = model.model.layers
    if any(isinstance(module, Fp8Linear) for module in layers.modules()):
        return model
    names = layer_linear_names(model)
    if not names:
        return model
    first = layers.get_submodule(names[0]).weight
    device, dtype = first.device, first.dtype
    del first
    check_online_fp8(model, device, dtype)  # all checked before any is replaced: an error leaves the model whole
    quantize_linears(layers)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints stored in fp8

FP8_CHECKPOINT_METHODS = ("fp8", "compressed-tensors")
W4_CHECKPOINT_METHODS = ("awq", "gptq")  # 4-bit, as compressed-tensors' pack-quantized is: engine/quant_w4.py
_CT_PACKED = "pack-quantized"
_CT_FORMATS = ("float-quantized", "naive-quantized")  # compressed-tensors formats that store fp8 values as they are
_FUSED_INTO = {shard: fused for fused, shards in FUSED_LINEARS.items() for shard in shards}


@dataclass(frozen=True)
class Fp8Scheme:
    """How an fp8 checkpoint stores one linear."""
    per_channel: bool
    """weight_scale holds one scale per output channel ([N, 1] or [N]); else one for the tensor ([] or [1])."""
    static_input: bool
    """input_scale holds one activation scale for the tensor ([] or [1]); else activations are scaled per token."""


@dataclass(frozen=True)
class Fp8Checkpoint:
    """config.json's quantization_config of an fp8 checkpoint: which of the layers' linears are fp8, and how."""
    quant_method: str
    """'fp8' (vLLM's Fp8Config) or 'compressed-tensors' (llm-compressor)."""
    groups: tuple[tuple[tuple[str, ...], Fp8Scheme], ...]
    """(targets, scheme) pairs: a linear takes the scheme of the first group with a target that matches it."""
    ignore: tuple[str, ...]
    """Modules the checkpoint keeps in 16 bits."""

    def scheme(self, name: str) -> Fp8Scheme | None:
        """The scheme of the linear with this full name (model.layers.0.self_attn.q_proj); None if it is 16-bit."""
        if _matches(name, self.ignore):
            return None
        return next((scheme for targets, scheme in self.groups if _matches(name, targets)), None)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    """compressed-tensors' rule (also used for vLLM's ignored_layers): a pattern is a module's full name, 're:' and a
    regex matched from the name's start, or a class name; every linear that can be fp8 here is a 'Linear'."""
    return any(p == name or p == "Linear" or (p.startswith("re:") and re.match(p[3:], name)) for p in patterns)


def quantization_config_dict(config) -> dict | None:
    """config.json's quantization_config as a dict (transformers may have parsed it into its own config class)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None or isinstance(qc, dict):
        return qc
    return qc.to_dict()


def fp8_checkpoint(config) -> Fp8Checkpoint | None:
    """The fp8 format of a checkpoint, read from its config's quantization_config; None when it has none, or when it
    is a 4-bit one (engine/quant_w4.py reads those). Anything else (another quant_method, block-wise scales, fp8
    weights with 16-bit activations, ...) raises ValueError naming the config field."""
    qc = quantization_config_dict(config)
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return _vllm_fp8(qc)
    if method in W4_CHECKPOINT_METHODS:
        return None
    if method == "compressed-tensors":
        formats = {g.get("format") or qc.get("format") for g in (qc.get("config_groups") or {}).values()}
        if formats == {_CT_PACKED}:
            return None  # 4-bit weights (W4A16)
        if _CT_PACKED in formats:
            raise ValueError(f"quantization_config.config_groups: formats {sorted(map(str, formats))} mix packed "
                             "4-bit weights with others; Tandem loads one weight format per checkpoint")
        return _compressed_tensors(qc)
    raise ValueError(f"quantization_config.quant_method={method!r}: Tandem loads fp8 checkpoints (quant_method "
                     f"{' or '.join(map(repr, FP8_CHECKPOINT_METHODS))} with an fp8 scheme) and 4-bit ones (awq, "
                     "gptq, compressed-tensors pack-quantized); serve the 16-bit checkpoint instead, with "
                     "--quantization fp8 for fp8 weights")


def _vllm_fp8(qc: dict) -> Fp8Checkpoint:
    """vLLM's Fp8Config: every linear's weight in float8_e4m3fn with one weight_scale per tensor; input_scale per
    tensor when activation_scheme is 'static'."""
    block = qc.get("weight_block_size")
    if block is not None:
        raise ValueError(f"quantization_config.weight_block_size={block!r}: block-wise fp8 scales (weight_scale_inv, "
                         "one per block) are not supported; Tandem loads fp8 weights with a scale per tensor or per "
                         "output channel")
    activations = qc.get("activation_scheme")
    if activations not in ("dynamic", "static"):
        raise ValueError(f"quantization_config.activation_scheme={activations!r}: must be 'dynamic' or 'static'")
    ignore = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ()
    scheme = Fp8Scheme(per_channel=False, static_input=activations == "static")
    return Fp8Checkpoint("fp8", ((("Linear",), scheme),), tuple(ignore))


def _fp8_args(where: str, args) -> dict:
    """compressed-tensors QuantizationArgs that describe e4m3, symmetric: float, 8 bits."""
    if not isinstance(args, dict):
        raise ValueError(f"{where}={args!r}: must be fp8 quantization args (num_bits 8, type 'float')")
    for key, want in (("num_bits", 8), ("type", "float"), ("symmetric", True)):
        if args.get(key, want) != want:
            raise ValueError(f"{where}.{key}={args.get(key)!r}: must be {want!r} (fp8 e4m3, symmetric)")
    return args


def _compressed_tensors(qc: dict) -> Fp8Checkpoint:
    """llm-compressor's format: config_groups of weights (fp8, per channel or per tensor, static) and input
    activations (fp8, dynamic per token, or static per tensor), the fp8 values stored as they are."""
    groups = qc.get("config_groups")
    if not groups:
        raise ValueError(f"quantization_config.config_groups={groups!r}: no quantization scheme")
    kv = qc.get("kv_cache_scheme")
    if kv is not None:
        raise ValueError(f"quantization_config.kv_cache_scheme={kv!r}: KV-cache scales from a checkpoint are not "
                         "loaded; remove the entry (and its k_scale/v_scale tensors) and pass --kv-cache-dtype fp8, "
                         "which calibrates its own")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise ValueError(f"quantization_config.sparsity_config.format={sparsity.get('format')!r}: sparse checkpoints "
                         "are not supported")
    parsed = []
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        fmt = group.get("format") or qc.get("format")
        if fmt not in _CT_FORMATS:
            raise ValueError(f"{where}.format={fmt!r}: must be one of {', '.join(_CT_FORMATS)} (fp8 weights stored "
                             "as float8_e4m3fn)")
        weights = _fp8_args(f"{where}.weights", group.get("weights"))
        if weights.get("strategy") not in ("channel", "tensor"):
            raise ValueError(f"{where}.weights.strategy={weights.get('strategy')!r}: must be 'channel' or 'tensor' "
                             "(block and group scales are not supported)")
        if weights.get("dynamic", False):
            raise ValueError(f"{where}.weights.dynamic={weights.get('dynamic')!r}: must be false (scales stored)")
        if group.get("input_activations") is None:
            raise ValueError(f"{where}.input_activations=None: fp8 weights with 16-bit activations (W8A16) are not "
                             "supported; Tandem's fp8 linears quantize their inputs too")
        acts = _fp8_args(f"{where}.input_activations", group["input_activations"])
        dynamic, strategy = acts.get("dynamic"), acts.get("strategy")
        if not (dynamic is True or (dynamic is False and strategy == "tensor")):
            raise ValueError(f"{where}.input_activations: dynamic={dynamic!r} with strategy={strategy!r} is not "
                             "supported: activations must be dynamic (scaled per token) or static per tensor")
        if group.get("output_activations") is not None:
            raise ValueError(f"{where}.output_activations={group['output_activations']!r}: must be null")
        targets = group.get("targets")
        if not targets:
            raise ValueError(f"{where}.targets={targets!r}: must name the modules the scheme applies to")
        parsed.append((tuple(targets), Fp8Scheme(per_channel=weights["strategy"] == "channel",
                                                 static_input=dynamic is False)))
    return Fp8Checkpoint("compressed-tensors", tuple(parsed), tuple(qc.get("ignore") or ()))


@torch.no_grad()
def prepare_fp8_checkpoint(model: nn.Module, checkpoint: Fp8Checkpoint,
                           device: torch.device | None = None) -> dict[str, Fp8Scheme]:
    """Before load_weights copies an fp8 checkpoint into the unfused `model`: each layer linear the checkpoint stores
    in fp8 becomes an empty Fp8Linear of its shape (weight float8_e4m3fn [N, K], weight_scale [1, N], input_scale [1]
    if static, bias in the model dtype). Returns {full name: scheme} of those linears. All checked before any is
    replaced. `device` is where the model will run (default: where its embeddings are); a model built on the meta
    device (engine/loader.py build_model) passes its target, and its shells stay on the meta device until loaded.
    Calling it again is harmless: linears that are Fp8Linear shells already are kept (and their names returned)."""
    layers = model.model.layers
    embed = model.model.embed_tokens.weight  # always in the model dtype
    device = embed.device if device is None else torch.device(device)
    names = [name for name, module in layers.named_modules() if isinstance(module, (nn.Linear, Fp8Linear))]
    schemes = {name: checkpoint.scheme(f"model.layers.{name}") for name in names}
    for name in names:
        module = layers.get_submodule(name)
        if isinstance(module, Fp8Linear):  # prepared before: the same checkpoint must have made it
            scheme = schemes[name]
            assert scheme is not None and scheme.static_input == (module.input_scale is not None), (name, scheme)
    for i in range(len(layers)):  # a fused group runs as one GEMM: one format for all its shards
        for shards in FUSED_LINEARS.values():
            got = {f"model.layers.{i}.{s}": schemes.get(f"{i}.{s}") for s in shards}
            if len({None if g is None else g.static_input for g in got.values()}) > 1:
                raise ValueError(f"quantization_config: {', '.join(f'{n} is {_describe(g)}' for n, g in got.items())}"
                                 "; they run fused as one GEMM, so they need one format (check its ignore list)")
    names = [name for name in names if schemes[name] is not None]
    if not names:
        return {}
    check_fp8_support(device, embed.dtype)
    for name in names:
        if device.type == "cuda":
            module = layers.get_submodule(name)
            check_fp8_shape(f"model.layers.{name}", *module.weight.shape)
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = layers.get_submodule(parent_name)
        linear = getattr(parent, attr)
        if isinstance(linear, nn.Linear):
            setattr(parent, attr, Fp8Linear.empty(linear, schemes[name].static_input))
    return {f"model.layers.{name}": schemes[name] for name in names}


def _describe(scheme: Fp8Scheme | None) -> str:
    return "16-bit" if scheme is None else f"fp8 ({'static' if scheme.static_input else 'dynamic'} activations)"


def checkpoint_scale(value: torch.Tensor, param: torch.Tensor, per_channel: bool) -> torch.Tensor | None:
    """A checkpoint's scale in the shape of the Fp8Linear parameter it fills; None when its shape is not the scheme's.
    weight_scale [1, N]: per channel from [N, 1] or [N], per tensor from [] or [1] (the one scale for every channel);
    input_scale [1]: from [] or [1]."""
    if value.numel() == 1 and value.dim() <= 1 and (param.numel() == 1 or not per_channel):
        return value.reshape(1, 1).expand(param.shape) if param.dim() == 2 else value.reshape(1)
    n = param.shape[-1]
    if per_channel and param.dim() == 2 and tuple(value.shape) in ((n, 1), (n,)):
        return value.reshape(1, n)
    return None
