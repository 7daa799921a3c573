"""4-bit weight checkpoints (W4A16) loaded as they are: AutoAWQ's GEMM format (`awq`), GPTQ (`gptq`) and
compressed-tensors' `pack-quantized` (llm-compressor's W4A16), applied from outside the plain model as fp8 is.

The life of a 4-bit linear:
1. `w4_checkpoint(config)` reads config.json's quantization_config when resolve_model reads the config, before any
   weight: the format, its group size, zero points or not, which linears it quantizes. What Tandem does not run
   raises ValueError naming the field (bits=8, zero_point=false, version='gemv', dynamic overrides, ...).
2. `prepare_w4_checkpoint(model, checkpoint, stored)` (engine/loader.py load_weights; on the meta device under
   build_model) replaces each layer linear the checkpoint stores in 4 bits by a W4CheckpointLinear: empty tensors
   named, shaped and typed as that format stores them (AWQ's qweight int32 [K, N/8], ...), so the checkpoint's
   tensors load by name like any other. `stored` (the checkpoint's tensor names) says whether a g_idx is there.
3. Once its decoder layer is filled, `finalize_w4_linears(layer)` repacks each into a W4Linear in the one layout
   kernels/w4a16.py runs (qweight int32 [K/8, N] packed along K; scales [K/G, N] in the narrowest float dtype that
   holds them exactly; uint8 zero points unless every one is 8; for act order a permutation of the inputs that makes
   each group contiguous) and drops the checkpoint's form: one layer holds both forms for a moment, never more.
4. fuse_projections concatenates q/k/v and gate/up along N (W4Linear.concat). The shards share K, the group size and
   the input permutation: GPTQ orders a layer's inputs by its Hessian, which q/k/v (and gate/up) share because they
   read the same input; shards with different g_idx are refused at load.
5. Forward: on CUDA the fused-dequantization GEMV (up to 16 rows: decode) or GEMM (kernels/w4a16.py); on the CPU the
   reference, W dequantized to float32 and one matmul. No host syncs: CUDA graphs capture it.

The formats' tensors, for a linear of K inputs, N outputs and groups of G inputs (docs/quantization.md has more):
  awq                 qweight int32 [K, N/8] (8 outputs per word in the order AWQ_ORDER), qzeros int32 [K/G, N/8]
                      (same order), scales fp16 [K/G, N]:  W[k, n] = (q - z) * s
  gptq                qweight int32 [K/8, N] (8 inputs per word, in order), qzeros int32 [K/G, N/8] (in order, stored
                      as zero - 1 in the v1 format), scales fp16 [K/G, N], g_idx int32 [K] (group of each input)
  compressed-tensors  weight_packed int32 [N, K/8] (q + 8 for the signed range, 8 inputs per word, in order),
                      weight_scale [N, K/G], weight_zero_point int32 [N/8, K/G] (asymmetric only: packed along N,
                      + 8), weight_g_idx int32 [K] (actorder 'group'), weight_shape [2] = (N, K)
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from engine.config import FUSED_LINEARS
from engine.quant import _matches, quantization_config_dict
from kernels.w4a16 import PACK, pack_w4, unpack_w4, w4a16_ref
from kernels.w4a16_tc import w4a16_triton

W4_METHODS = ("awq", "gptq", "compressed-tensors")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble i of word c holds output 8c + AWQ_ORDER[i]
_IN_ORDER = tuple(range(PACK))
MIN_GROUP = 16  # the GEMM's K step is at least one tensor-core tile (16) and stays inside one group
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what was subtracted from each stored zero point
_CT_ACTORDERS = (None, "group", "weight", "dynamic", "static")  # 'dynamic' = 'group', 'static' = 'weight' (aliases)


@dataclass(frozen=True)
class W4Scheme:
    """How a checkpoint stores one 4-bit linear."""
    fmt: str
    """'awq', 'gptq' or 'compressed-tensors': the tensors' names and layouts."""
    group_size: int
    """Inputs per scale (and zero point); -1: one group for the whole row."""
    zero_points: bool
    """Zero points are stored (asymmetric); else every zero point is 8 (q - 8 in the signed range)."""
    zero_offset: int = 0
    """Added to each stored zero point: 1 for GPTQ's v1 format, which stores zero - 1."""

    def groups(self, k: int) -> int:
        return 1 if self.group_size == -1 else k // self.group_size


@dataclass(frozen=True)
class W4Checkpoint:
    """config.json's quantization_config of a 4-bit checkpoint: which of the layers' linears are 4-bit, and how."""
    quant_method: str
    """'awq', 'gptq' or 'compressed-tensors'."""
    groups: tuple[tuple[tuple[str, ...], W4Scheme], ...]
    """(targets, scheme) pairs: a linear takes the scheme of the first group with a target that matches it."""
    ignore: tuple[str, ...]
    """Modules the checkpoint keeps in 16 bits (patterns as engine/quant.py's _matches reads them)."""

    def scheme(self, name: str) -> W4Scheme | None:
        """The scheme of the linear with this full name (model.layers.0.self_attn.q_proj); None if it is 16-bit."""
        if _matches(name, self.ignore):
            return None
        return next((scheme for targets, scheme in self.groups if _matches(name, targets)), None)


# ---------------------------------------------------------------------------------------------------------------
# quantization_config


def w4_checkpoint(config) -> W4Checkpoint | None:
    """The 4-bit format of a checkpoint, read from its config's quantization_config; None when it has none or it is
    not a 4-bit one (engine/quant.py fp8_checkpoint reads fp8 ones and refuses the rest). A 4-bit variant Tandem does
    not run raises ValueError naming the config field."""
    qc = quantization_config_dict(config)
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "compressed-tensors" and is_pack_quantized(qc):
        return _compressed_tensors_w4(qc)
    return None


def is_pack_quantized(qc: dict) -> bool:
    """A compressed-tensors config whose every scheme stores packed integers (`pack-quantized`)."""
    groups = qc.get("config_groups") or {}
    return bool(groups) and all((g.get("format") or qc.get("format")) == "pack-quantized" for g in groups.values())


def _first(qc: dict, *keys: str):
    """(key, value) of the first of `keys` the config has; (keys[0], None) when it has none."""
    return next(((k, qc[k]) for k in keys if k in qc), (keys[0], None))


def _bits(where: str, key: str, bits) -> None:
    if bits != 4:
        raise ValueError(f"{where}.{key}={bits!r}: Tandem loads 4-bit weights only (bits 4); serve the 16-bit "
                         "checkpoint instead (with --quantization fp8 for 8-bit weights)")


def _group_size(where: str, key: str, value) -> int:
    if value == -1 or (isinstance(value, int) and not isinstance(value, bool) and value > 0
                       and value % MIN_GROUP == 0):
        return value
    raise ValueError(f"{where}.{key}={value!r}: must be -1 (one group per row) or a positive multiple of "
                     f"{MIN_GROUP} (AWQ and GPTQ use 32, 64, 128)")


def _awq(qc: dict) -> W4Checkpoint:
    """AutoAWQ's GEMM checkpoints (transformers' AwqConfig, or AutoAWQ's own w_bit / q_group_size names)."""
    where = "quantization_config"
    _bits(where, *_first(qc, "bits", "w_bit"))
    group = _group_size(where, *_first(qc, "group_size", "q_group_size"))
    zero_point = qc.get("zero_point", True)
    if zero_point is not True:
        raise ValueError(f"{where}.zero_point={zero_point!r}: AWQ without zero points is not supported; AutoAWQ's "
                         "GEMM checkpoints (zero_point true) are")
    version = qc.get("version", "gemm")
    if str(version).lower() != "gemm":
        raise ValueError(f"{where}.version={version!r}: only AutoAWQ's GEMM layout (version 'gemm') is supported; "
                         "GEMV and Marlin layouts pack the weights differently")
    backend = qc.get("backend")
    if backend not in (None, "autoawq"):
        raise ValueError(f"{where}.backend={backend!r}: only AutoAWQ checkpoints (backend 'autoawq') are supported")
    # AutoAWQ (and vLLM) skip every module whose name contains one of these
    ignore = tuple(f"re:.*{re.escape(m)}" for m in qc.get("modules_to_not_convert") or ())
    return W4Checkpoint("awq", ((("Linear",), W4Scheme("awq", group, zero_points=True)),), ignore)


def _gptq(qc: dict) -> W4Checkpoint:
    """GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum): symmetric or not, with or without desc_act (act order)."""
    where = "quantization_config"
    _bits(where, "bits", qc.get("bits"))
    group = _group_size(where, "group_size", qc.get("group_size"))
    key, fmt = _first(qc, "checkpoint_format", "format")
    fmt = fmt or "gptq"
    if fmt not in _GPTQ_FORMATS:
        raise ValueError(f"{where}.{key}={fmt!r}: must be 'gptq' (v1: zero points stored minus 1) or 'gptq_v2'; "
                         "Marlin and BitBLAS repacked checkpoints are not supported")
    if qc.get("is_marlin_format"):
        raise ValueError(f"{where}.is_marlin_format=True: Marlin-repacked GPTQ checkpoints are not supported")
    pack_dtype = qc.get("pack_dtype", "int32")
    if pack_dtype not in ("int32", "torch.int32"):
        raise ValueError(f"{where}.pack_dtype={pack_dtype!r}: must be 'int32' (8 values per word)")
    if qc.get("lm_head"):
        raise ValueError(f"{where}.lm_head={qc['lm_head']!r}: a 4-bit lm_head is not supported")
    if qc.get("dynamic"):
        raise ValueError(f"{where}.dynamic={qc['dynamic']!r}: per-module overrides (GPTQModel's dynamic) are not "
                         "supported; Tandem needs one bit width and group size for every linear")
    sym = qc.get("sym", True)
    if not isinstance(sym, bool):
        raise ValueError(f"{where}.sym={sym!r}: must be true or false")
    if not isinstance(qc.get("desc_act", False), bool):
        raise ValueError(f"{where}.desc_act={qc['desc_act']!r}: must be true or false")
    # The zero points are stored either way (8 for symmetric); desc_act shows in g_idx, read at load.
    scheme = W4Scheme("gptq", group, zero_points=True, zero_offset=_GPTQ_FORMATS[fmt])
    targets: tuple[str, ...] = ("Linear",)
    modules = qc.get("modules_in_block_to_quantize")
    if modules:  # a list of lists (the order GPTQ quantized them in) or a flat list of in-layer names
        flat = [m for item in modules for m in (item if isinstance(item, (list, tuple)) else [item])]
        targets = tuple(f"re:.*\\.{re.escape(m)}$" for m in flat)
    return W4Checkpoint("gptq", ((targets, scheme),), ())


def _compressed_tensors_w4(qc: dict) -> W4Checkpoint:
    """llm-compressor's W4A16 (`pack-quantized`): int4 weights per group or per channel, symmetric or not, 16-bit
    activations."""
    kv = qc.get("kv_cache_scheme")
    if kv is not None:
        raise ValueError(f"quantization_config.kv_cache_scheme={kv!r}: KV-cache scales from a checkpoint are not "
                         "loaded; remove the entry (and its k_scale/v_scale tensors) and pass --kv-cache-dtype fp8, "
                         "which calibrates its own")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise ValueError(f"quantization_config.sparsity_config.format={sparsity.get('format')!r}: sparse checkpoints "
                         "are not supported")
    if qc.get("transform_config"):
        raise ValueError("quantization_config.transform_config: rotated (transformed) weights are not supported")
    parsed = []
    for name, group in qc["config_groups"].items():
        where = f"quantization_config.config_groups.{name}"
        w = group.get("weights")
        if not isinstance(w, dict):
            raise ValueError(f"{where}.weights={w!r}: must be 4-bit int quantization args")
        _bits(f"{where}.weights", "num_bits", w.get("num_bits"))
        if w.get("type", "int") != "int":
            raise ValueError(f"{where}.weights.type={w.get('type')!r}: must be 'int' (4-bit floats are not supported)")
        strategy = w.get("strategy")
        if strategy == "group":
            group_size = _group_size(f"{where}.weights", "group_size", w.get("group_size"))
        elif strategy == "channel":
            group_size = -1
        else:
            raise ValueError(f"{where}.weights.strategy={strategy!r}: must be 'group' or 'channel' (tensor and "
                             "block scales are not supported)")
        if w.get("dynamic", False):
            raise ValueError(f"{where}.weights.dynamic={w.get('dynamic')!r}: must be false (scales stored)")
        if w.get("actorder") not in _CT_ACTORDERS:
            raise ValueError(f"{where}.weights.actorder={w.get('actorder')!r}: must be one of "
                             f"{', '.join(map(repr, _CT_ACTORDERS))}")
        symmetric = w.get("symmetric", True)
        if not isinstance(symmetric, bool):
            raise ValueError(f"{where}.weights.symmetric={symmetric!r}: must be true or false")
        if group.get("input_activations") is not None:
            raise ValueError(f"{where}.input_activations={group['input_activations']!r}: 4-bit weights with "
                             "quantized activations (W4A8) are not supported; W4A16 (input_activations null) is")
        if group.get("output_activations") is not None:
            raise ValueError(f"{where}.output_activations={group['output_activations']!r}: must be null")
        targets = group.get("targets")
        if not targets:
            raise ValueError(f"{where}.targets={targets!r}: must name the modules the scheme applies to")
        parsed.append((tuple(targets), W4Scheme("compressed-tensors", group_size, zero_points=not symmetric)))
    return W4Checkpoint("compressed-tensors", tuple(parsed), tuple(qc.get("ignore") or ()))


def check_checkpoint_quantization(quantization: str | None, config, spec: str) -> None:
    """--quantization must agree with what the checkpoint stores: awq / gptq / compressed-tensors name its
    quant_method (4-bit weights are never made at load, except for random models: config None); fp8 is online
    quantization of a 16-bit checkpoint (or a
    no-op on an fp8 one) and cannot apply to 4-bit weights."""
    if quantization is None or (config is None and quantization in W4_METHODS):
        return  # random weights: random_w4_linears makes them 4-bit in the format's layout
    qc = quantization_config_dict(config)
    method = qc.get("quant_method") if qc is not None else None
    w4 = w4_checkpoint(config)
    if quantization == "fp8":
        if w4 is not None:
            raise ValueError(f"quantization='fp8': model={spec!r} stores 4-bit weights (quantization_config."
                             f"quant_method={method!r}), which load as they are; drop --quantization, or pass "
                             f"--quantization {method}")
        return
    if method != quantization:
        raise ValueError(f"quantization={quantization!r}: model={spec!r} has quantization_config.quant_method="
                         f"{method!r}; --quantization {quantization} loads a checkpoint stored in that format as it "
                         "is (Tandem does not quantize to 4 bits at load: --quantization fp8 quantizes a 16-bit "
                         "checkpoint)")


# ---------------------------------------------------------------------------------------------------------------
# The linear, in the kernels' layout


class W4Linear(nn.Module):
    """y = x W + b with W [K, N] in 4 bits (kernels/w4a16.py's layout: W[r, n] = (q - z[g]) * s[g], g = r // G, row r
    multiplying input perm[r] where there is a perm), x and y in the model dtype."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                 perm: torch.Tensor | None, bias: torch.Tensor | None):
        super().__init__()
        assert qweight.dtype == torch.int32 and qweight.dim() == 2, (qweight.dtype, qweight.shape)
        self.in_features, self.out_features = qweight.shape[0] * PACK, qweight.shape[1]
        assert scales.shape[1] == self.out_features and self.in_features % scales.shape[0] == 0, scales.shape
        self.group_size = self.in_features // scales.shape[0]
        param = lambda t: None if t is None else nn.Parameter(t.contiguous(), requires_grad=False)  # noqa: E731
        self.qweight = param(qweight)  # [K/8, N] int32
        self.scales = param(scales)  # [K/G, N] float16 / bfloat16 / float32
        self.register_parameter("qzeros", param(qzeros))  # [K/G, N] uint8, or None: every zero point is 8
        self.register_parameter("perm", param(perm))  # [K] int32, or None
        self.register_parameter("bias", param(bias))  # [N], model dtype

    @classmethod
    @torch.no_grad()
    def concat(cls, linears: list["W4Linear"]) -> "W4Linear":
        """One W4Linear whose output is the linears' outputs side by side (fused q/k/v, gate/up): concatenated along
        N, each output keeping its own scales and zero points. The shards must share K, G and the permutation."""
        first = linears[0]
        assert all(isinstance(m, W4Linear) for m in linears), [type(m).__name__ for m in linears]
        assert all(m.in_features == first.in_features and m.group_size == first.group_size for m in linears)
        assert all((m.perm is None) == (first.perm is None) and (m.perm is None or torch.equal(m.perm, first.perm))
                   for m in linears), "shards with different act-order permutations cannot run as one GEMM"
        has_bias = first.bias is not None
        assert all((m.bias is not None) == has_bias for m in linears)
        dtypes = {m.scales.dtype for m in linears}
        scale_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        zeros = None
        if any(m.qzeros is not None for m in linears):
            zeros = torch.cat([m.qzeros if m.qzeros is not None else torch.full_like(m.scales, 8, dtype=torch.uint8)
                               for m in linears], dim=1)
        return cls(torch.cat([m.qweight for m in linears], dim=1),
                   torch.cat([m.scales.to(scale_dtype) for m in linears], dim=1), zeros, first.perm,
                   torch.cat([m.bias for m in linears]) if has_bias else None)

    @torch.no_grad()
    def rows(self, start: int, end: int) -> "W4Linear":
        """Outputs [start, end) (a column-parallel shard: engine/tp.py)."""
        cut = lambda t: None if t is None else t[..., start:end].clone()  # noqa: E731
        return W4Linear(cut(self.qweight), cut(self.scales), cut(self.qzeros),
                        None if self.perm is None else self.perm.clone(), cut(self.bias))

    @torch.no_grad()
    def columns(self, start: int, end: int) -> "W4Linear":
        """Inputs [start, end) (a row-parallel shard: engine/tp.py), whole groups of them; every output kept."""
        if self.perm is not None:
            raise ValueError(f"tensor_parallel_size > 1: a row-parallel shard of a 4-bit linear with act order "
                             f"(desc_act / g_idx, {self.in_features} inputs) would need its own input order; serve "
                             "an act-order checkpoint with tensor_parallel_size=1")
        g = self.group_size
        if self.scales.shape[0] == 1:  # one group per row (per channel): every shard keeps its scales whole
            if (end - start) % MIN_GROUP or start % PACK:
                raise ValueError(f"tensor_parallel_size > 1: a row-parallel shard of inputs [{start}, {end}) of a "
                                 f"4-bit linear must start at a multiple of {PACK} and hold a multiple of {MIN_GROUP}")
            groups = lambda t: None if t is None else t.clone()  # noqa: E731
        elif start % g or end % g:
            raise ValueError(f"tensor_parallel_size > 1: a row-parallel shard of inputs [{start}, {end}) of a 4-bit "
                             f"linear splits its groups of {g} inputs; the shards must hold whole groups")
        else:
            groups = lambda t: None if t is None else t[start // g:end // g].clone()  # noqa: E731
        return W4Linear(self.qweight[start // PACK:end // PACK].clone(), groups(self.scales), groups(self.qzeros),
                        None, None if self.bias is None else self.bias.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        fn = w4a16_triton if x.is_cuda else w4a16_ref
        y = fn(x2, self.qweight, self.scales, self.qzeros, self.bias, self.perm)
        return y.reshape(*x.shape[:-1], self.out_features)  # [..., N]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group_size={self.group_size}, zero_points={self.qzeros is not None}, "
                f"act_order={self.perm is not None}, scales={str(self.scales.dtype).removeprefix('torch.')}")


# ---------------------------------------------------------------------------------------------------------------
# Random 4-bit models (random:<preset> --quantization awq / gptq / compressed-tensors)

RANDOM_W4_GROUP = 128  # the group size of a random 4-bit model (AWQ's and GPTQ's usual one)


@torch.no_grad()
def quantize_w4_rtn(linear: nn.Linear, group_size: int = RANDOM_W4_GROUP, zero_points: bool = True) -> W4Linear:
    """The linear's weight rounded to 4 bits per group of group_size inputs (round to nearest: min..max over 0..15
    with zero points, +-max over -8..7 without), for random models only: random:<preset> with a 4-bit
    --quantization runs the kernels of that format's checkpoints (the same W4Linear layout) on weights close to the
    random 16-bit ones. Real checkpoints load as they are stored; Tandem does not quantize them to 4 bits."""
    w = linear.weight.detach().float().t()  # [K, N]
    k, n = w.shape
    g = group_size if k % group_size == 0 else k
    grouped = w.reshape(k // g, g, n)
    if zero_points:
        lo, hi = grouped.amin(dim=1), grouped.amax(dim=1)  # [K/G, N]
        scales = ((hi - lo) / 15).clamp_min(1e-8).half()
        zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    else:
        scales = (grouped.abs().amax(dim=1) / 7).clamp_min(1e-8).half()
        zeros = torch.full_like(scales, 8, dtype=torch.float32)
    q = torch.round(grouped / scales.float()[:, None] + zeros[:, None]).clamp(0, 15).reshape(k, n)
    del w, grouped
    bias = None if linear.bias is None else linear.bias.detach()
    return W4Linear(pack_w4(q.to(torch.uint8)), scales, zeros.to(torch.uint8) if zero_points else None, None, bias)


@torch.no_grad()
def random_w4_linears(layer: nn.Module, method: str) -> None:
    """Replaces every nn.Linear of one random decoder layer by quantize_w4_rtn of it: zero points for awq (AutoAWQ
    stores them), symmetric for gptq and compressed-tensors (their usual sym=true / symmetric schemes)."""
    assert method in W4_METHODS, method
    for name in [name for name, m in layer.named_modules() if isinstance(m, nn.Linear)]:
        parent_name, _, attr = name.rpartition(".")
        parent = layer.get_submodule(parent_name)
        setattr(parent, attr, quantize_w4_rtn(getattr(parent, attr), zero_points=method == "awq"))


# ---------------------------------------------------------------------------------------------------------------
# The linear as its checkpoint stores it


def _stored_tensors(scheme: W4Scheme, n: int, k: int, g_idx: bool) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of each tensor the format stores for a linear of n outputs and k inputs. Scales are read
    into float32 (exact for float16 and bfloat16 alike) and narrowed again by to_w4."""
    ng = scheme.groups(k)
    if scheme.fmt == "awq":
        return [("qweight", (k, n // PACK), torch.int32), ("qzeros", (ng, n // PACK), torch.int32),
                ("scales", (ng, n), torch.float32)]
    if scheme.fmt == "gptq":
        return ([("qweight", (k // PACK, n), torch.int32), ("qzeros", (ng, n // PACK), torch.int32),
                 ("scales", (ng, n), torch.float32)] + ([("g_idx", (k,), torch.int32)] if g_idx else []))
    tensors = [("weight_packed", (n, k // PACK), torch.int32), ("weight_scale", (n, ng), torch.float32),
               ("weight_shape", (2,), torch.int64)]
    if scheme.zero_points:
        tensors.append(("weight_zero_point", (-(-n // PACK), ng), torch.int32))
    return tensors + ([("weight_g_idx", (k,), torch.int32)] if g_idx else [])


def _g_idx_name(scheme: W4Scheme) -> str | None:
    return {"gptq": "g_idx", "compressed-tensors": "weight_g_idx"}.get(scheme.fmt)


def check_w4_shape(name: str, scheme: W4Scheme, n: int, k: int) -> None:
    """ValueError naming the linear when its shape does not fit the format (packing and groups)."""
    g = k if scheme.group_size == -1 else scheme.group_size
    if k % g or g % MIN_GROUP:
        raise ValueError(f"{name}: {k} inputs do not split into groups of {g} (a multiple of {MIN_GROUP}) "
                         f"(quantization_config group_size={scheme.group_size})")
    if n % PACK and (scheme.fmt != "compressed-tensors" or scheme.zero_points):
        raise ValueError(f"{name}: {n} outputs are not a multiple of {PACK}, which {scheme.fmt}'s packing of "
                         f"{'weights' if scheme.fmt == 'awq' else 'zero points'} along the outputs needs")


def _unpack_along_last(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 [R, C/8] -> uint8 [R, C]: nibble i of word c holds column 8c + order[i]."""
    out = torch.empty(*packed.shape, PACK, dtype=torch.uint8, device=packed.device)  # [R, C/8, 8]
    for i in range(PACK):
        out[..., order[i]] = ((packed >> (4 * i)) & 0xF).to(torch.uint8)
    return out.reshape(packed.shape[0], -1)


def _narrow_scales(s: torch.Tensor) -> torch.Tensor:
    """s in float16 or bfloat16 when that holds every value exactly (a checkpoint's own 16-bit scales), else
    float32: what the kernels read is the checkpoint's scale, bit for bit, in the fewest bytes."""
    for dtype in (torch.float16, torch.bfloat16):
        if torch.equal(s.to(dtype).to(s.dtype), s):
            return s.to(dtype)
    return s.float()


def _act_order_perm(name: str, g_idx: torch.Tensor, k: int, group_size: int) -> torch.Tensor | None:
    """The permutation that sorts the inputs by group (act order), or None when they are in order already. Every
    group must hold group_size inputs (as GPTQ's and llm-compressor's act order give them)."""
    g = g_idx.long()
    want = torch.arange(k, device=g.device) // group_size
    if torch.equal(g, want):
        return None
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], want):
        raise ValueError(f"{name}: g_idx does not give each of its {k // group_size} groups {group_size} inputs "
                         "(act order permutes whole groups); the checkpoint is not one Tandem can run")
    return perm.to(torch.int32)


class W4CheckpointLinear(nn.Module):
    """A 4-bit linear as its checkpoint stores it, each tensor uninitialized until load_weights fills it by name;
    to_w4() repacks it into a W4Linear (finalize_w4_linears, once its layer is loaded)."""

    def __init__(self, scheme: W4Scheme, name: str, linear: nn.Linear, g_idx: bool):
        super().__init__()
        self.scheme, self.name = scheme, name
        self.out_features, self.in_features = linear.weight.shape
        device = linear.weight.device
        for attr, shape, dtype in _stored_tensors(scheme, self.out_features, self.in_features, g_idx):
            self.register_parameter(attr, nn.Parameter(torch.empty(shape, dtype=dtype, device=device),
                                                       requires_grad=False))
        bias = None if linear.bias is None else nn.Parameter(torch.empty_like(linear.bias), requires_grad=False)
        self.register_parameter("bias", bias)

    @torch.no_grad()
    def to_w4(self) -> W4Linear:
        s, n, k = self.scheme, self.out_features, self.in_features
        g_idx = getattr(self, _g_idx_name(s), None) if _g_idx_name(s) else None
        if s.fmt == "awq":
            q = _unpack_along_last(self.qweight, AWQ_ORDER)  # [K, N]
            z = _unpack_along_last(self.qzeros, AWQ_ORDER)  # [K/G, N]
            scales = self.scales
        elif s.fmt == "gptq":
            q = unpack_w4(self.qweight)  # [K, N]: GPTQ packs along K, as the kernels do
            z = _unpack_along_last(self.qzeros, _IN_ORDER)
            scales = self.scales
        else:
            shape = self.weight_shape.tolist()
            if shape != [n, k]:
                raise ValueError(f"{self.name}.weight_shape={shape}: the model's linear is [{n}, {k}]")
            q = _unpack_along_last(self.weight_packed, _IN_ORDER).t()  # [N, K] -> [K, N]; the signed q + 8
            scales = self.weight_scale.t()  # [N, K/G] -> [K/G, N]
            z = unpack_w4(self.weight_zero_point)[:n].t() if s.zero_points else None  # packed along N, + 8
        if z is not None and s.zero_offset:
            z = z + s.zero_offset  # GPTQ v1: up to 16 (uint8 holds it)
        perm = None
        if g_idx is not None:
            perm = _act_order_perm(f"{self.name}.{_g_idx_name(s)}", g_idx, k, k // scales.shape[0])
        if perm is not None:
            q = q[perm.long()]  # row r of W is input perm[r]: each group's rows contiguous
        if z is not None and bool((z == 8).all()):
            z = None  # symmetric after all (GPTQ sym=true stores its 8s): the kernels' constant
        return W4Linear(pack_w4(q), _narrow_scales(scales), z, perm, self.bias)

    def extra_repr(self) -> str:
        return f"{self.name}: {self.scheme}"


@torch.no_grad()
def prepare_w4_checkpoint(model: nn.Module, checkpoint: W4Checkpoint, stored: set[str]) -> dict[str, W4Scheme]:
    """Before load_weights copies a 4-bit checkpoint into the unfused `model`: each layer linear the checkpoint stores
    in 4 bits becomes an empty W4CheckpointLinear of its format (on the linear's device: meta under build_model).
    `stored` holds the checkpoint's tensor names (a g_idx is optional). Returns {full name: scheme}; everything is
    checked before any linear is replaced. Calling it again keeps the shells it made."""
    layers = model.model.layers
    names = [name for name, m in layers.named_modules() if isinstance(m, (nn.Linear, W4CheckpointLinear))]
    schemes = {name: checkpoint.scheme(f"model.layers.{name}") for name in names}
    for i in range(len(layers)):  # a fused group runs as one GEMM: one scheme for all its shards
        for shards in FUSED_LINEARS.values():
            got = {f"model.layers.{i}.{s}": schemes.get(f"{i}.{s}") for s in shards}
            if len({None if g is None else (g.fmt, g.group_size) for g in got.values()}) > 1:
                described = ", ".join(f"{n} is {'16-bit' if g is None else f'4-bit (group_size {g.group_size})'}"
                                      for n, g in got.items())
                raise ValueError(f"quantization_config: {described}; they run fused as one GEMM, so they need one "
                                 "format (check its ignore list)")
    names = [name for name in names if schemes[name] is not None]
    for name in names:
        module = layers.get_submodule(name)
        if isinstance(module, nn.Linear):
            check_w4_shape(f"model.layers.{name}", schemes[name], *module.weight.shape)
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = layers.get_submodule(parent_name)
        linear = getattr(parent, attr)
        if isinstance(linear, nn.Linear):
            full = f"model.layers.{name}"
            g_idx = _g_idx_name(schemes[name])
            setattr(parent, attr, W4CheckpointLinear(schemes[name], full, linear,
                                                     g_idx is not None and f"{full}.{g_idx}" in stored))
    return {f"model.layers.{name}": schemes[name] for name in names}


@torch.no_grad()
def finalize_w4_linears(layer: nn.Module) -> None:
    """Repacks every W4CheckpointLinear of one loaded decoder layer into a W4Linear, and checks that the shards of each
    fused group share their act order (one input permutation for the one GEMM)."""
    made: dict[str, W4Linear] = {}  # in-layer name -> its repacked linear
    full: dict[str, str] = {}  # in-layer name -> full name
    for name, shell in [(n, m) for n, m in layer.named_modules() if isinstance(m, W4CheckpointLinear)]:
        parent_name, _, attr = name.rpartition(".")
        made[name], full[name] = shell.to_w4(), shell.name
        setattr(layer.get_submodule(parent_name), attr, made[name])
    for shards in FUSED_LINEARS.values():
        if not all(s in made for s in shards):
            continue
        perms = [made[s].perm for s in shards]
        if not all((p is None) == (perms[0] is None) and (p is None or torch.equal(p, perms[0])) for p in perms):
            raise ValueError(f"quantization_config desc_act / actorder: {', '.join(full[s] for s in shards)} have "
                             "different g_idx (act orders); Tandem runs them fused as one GEMM over one input order, "
                             "so their inputs must be ordered alike (GPTQ and llm-compressor order them by the "
                             "layer input, which they share)")
