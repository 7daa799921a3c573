"""engine/loader.py build_model: the model ModelRunner used to build (float32 construction, .to(dtype), load, fuse,
quantize), bit for bit, without ever allocating a float32 parameter of a 16-bit model or a 16-bit copy of an fp8
checkpoint's linears; and the peak resident memory of building a mid-size model, before and after.

Run as a script to measure peak RSS (each build in its own process: VmHWM, the peak RSS, grown by the build):
    .venv/bin/python tests/engine/test_build_model.py [--layers 24] [--hidden 1536] ...
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from engine.loader import ResolvedModel, build_model, load_weights, resolve_model  # noqa: E402
from engine.model import LlamaForCausalLM  # noqa: E402
from engine.quant import Fp8Linear, quantize_model  # noqa: E402
from kernels._checks import FP8_DTYPE  # noqa: E402
from tests.engine.test_tp import prefill_decode_logits  # noqa: E402


def build_as_before(resolved: ResolvedModel, dtype: torch.dtype, device: str, quantization: str | None,
                    seed: int) -> nn.Module:
    """ModelRunner.__init__'s construction lines before build_model (commit ee70760), as the reference."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(resolved.config)
    model.to(dtype)
    model.cos_sin_cache = model.cos_sin_cache.float()
    model.tie_weights()
    load_weights(model, resolved)
    model.fuse_projections()
    quantize_model(model, quantization)
    return model


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t  # torch.equal has no float8 kernel on the CPU


def assert_same_model(got: nn.Module, want: nn.Module) -> None:
    assert [(n, type(m)) for n, m in got.named_modules()] == [(n, type(m)) for n, m in want.named_modules()]
    g = dict(got.named_parameters(remove_duplicate=False))
    w = dict(want.named_parameters(remove_duplicate=False))
    assert list(g) == list(w)
    for name in w:
        assert g[name].dtype == w[name].dtype and g[name].shape == w[name].shape, name
        assert torch.equal(_bits(g[name]), _bits(w[name])), name
        assert g[name].requires_grad == w[name].requires_grad, name
    tied = lambda m: {n for n, p in m.named_parameters(remove_duplicate=False) if p is m.model.embed_tokens.weight}
    assert tied(got) == tied(want)
    assert got.cos_sin_cache.dtype == want.cos_sin_cache.dtype == torch.float32
    assert torch.equal(got.cos_sin_cache, want.cos_sin_cache)


def logits(model: nn.Module, tokens: list[int]) -> torch.Tensor:
    return prefill_decode_logits(model, tokens)


PROBE = [(i * 29) % 500 + 3 for i in range(40)]


def check_equal_to_before(resolved_fn, dtype, quantization, seed=0) -> nn.Module:
    got = build_model(resolved_fn(), dtype, "cpu", quantization, seed).eval()
    want = build_as_before(resolved_fn(), dtype, "cpu", quantization, seed).eval()
    assert_same_model(got, want)
    assert torch.equal(logits(got, PROBE), logits(want, PROBE))
    return got


def random_resolved(preset: str, seed: int = 0, **edits):
    def make() -> ResolvedModel:
        r = resolve_model(f"random:{preset}")
        r.random_seed = seed
        for k, v in edits.items():
            setattr(r.config, k, v)
        return r
    return make


# --- the same model as before ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_random_model_equals_before(dtype, quantization):
    got = check_equal_to_before(random_resolved("tiny-qwen2", seed=3), dtype, quantization, seed=3)
    if quantization:
        assert not any(isinstance(m, nn.Linear) for m in got.model.layers.modules())


def test_random_tied_model_equals_before():
    got = check_equal_to_before(random_resolved("tiny", tie_word_embeddings=True), torch.bfloat16, "fp8")
    assert got.lm_head is None


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama3_dir"])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_checkpoint_equals_before(request, fixture, quantization):
    d = request.getfixturevalue(fixture)
    check_equal_to_before(lambda: resolve_model(str(d)), torch.bfloat16, quantization)


def test_checkpoint_without_lm_head_ties_as_before(tiny_llama_dir, tmp_path):
    """An untied config whose checkpoint has no lm_head.weight: load_weights ties them (on the meta device now)."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "no-head"
    d.mkdir()
    for f in tiny_llama_dir.iterdir():
        if f.name != "model.safetensors":
            (d / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    got = check_equal_to_before(lambda: resolve_model(str(d)), torch.bfloat16, None)
    assert got.lm_head.weight is got.model.embed_tokens.weight


@pytest.mark.parametrize("fmt, static", [("ct-channel", False), ("fp8-dynamic", False), ("fp8-static", True)])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_fp8_checkpoint_equals_before(tiny_qwen2_dir, tmp_path, fmt, static, quantization):
    from tests.engine.test_quant import write_fp8_checkpoint

    method, per_channel = ("compressed-tensors", True) if fmt.startswith("ct") else ("fp8", False)
    d = write_fp8_checkpoint(tiny_qwen2_dir, tmp_path / fmt, method, per_channel=per_channel, static=static)
    got = check_equal_to_before(lambda: resolve_model(str(d)), torch.bfloat16, quantization)
    assert isinstance(got.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert (got.model.layers[0].mlp.down_proj.input_scale is not None) == static


def test_fp8_checkpoint_ignoring_every_linear_quantizes_online_as_before(tiny_llama_dir, tmp_path):
    """quantize_model's rule kept: a checkpoint that leaves all linears in 16 bits is quantized by --quantization."""
    from tests.engine.test_quant import LAYER_LINEARS, write_fp8_checkpoint

    ignore = tuple(f"model.layers.{i}.{n}" for i in range(3) for n in LAYER_LINEARS)
    d = write_fp8_checkpoint(tiny_llama_dir, tmp_path / "all-ignored", "compressed-tensors", ignore=ignore)
    got = check_equal_to_before(lambda: resolve_model(str(d)), torch.bfloat16, "fp8")
    assert isinstance(got.model.layers[0].self_attn.qkv_proj, Fp8Linear)


def test_errors_come_before_any_weight_is_read(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"quantization='int4': must be one of None, fp8"):
        build_model(resolve_model(str(tiny_llama_dir)), torch.bfloat16, "cpu", "int4", 0)


# --- what is allocated while building ------------------------------------------------------------------------------


class Allocations(TorchDispatchMode):
    """Records (dtype, shape) of every tensor an aten op returns off the meta device."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[torch.dtype, tuple[int, ...], str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.seen.append((t.dtype, tuple(t.shape), str(func)))
        return out


def parameter_shapes(config) -> set[tuple[int, ...]]:
    """The shapes of the model's parameters, unfused and fused (built on the meta device: nothing allocated)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        shapes = {tuple(p.shape) for p in model.parameters()}
        model.fuse_projections()
    return shapes | {tuple(p.shape) for p in model.parameters()}


def float32_weights(allocations: Allocations, config) -> list:
    """The float32 tensors allocated in the shape of a parameter (unfused or fused)."""
    shapes = parameter_shapes(config)
    assert (config.max_position_embeddings,) not in shapes  # the rotary table's float32 positions are not weights
    return [a for a in allocations.seen if a[0] == torch.float32 and a[1] in shapes]


def bf16_checkpoint(src: Path, out: Path) -> Path:
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("source", ["random", "checkpoint"])
def test_bf16_build_allocates_no_float32_weight(tiny_qwen2_dir, tmp_path, source):
    make = (random_resolved("tiny-qwen2") if source == "random"
            else lambda d=bf16_checkpoint(tiny_qwen2_dir, tmp_path / "bf16"): resolve_model(str(d)))
    with Allocations() as new:
        model = build_model(make(), torch.bfloat16, "cpu", None, 0)
    assert float32_weights(new, model.config) == []
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with Allocations() as old:  # the detector catches the old construction: this test can fail
        build_as_before(make(), torch.bfloat16, "cpu", None, 0)
    assert len(float32_weights(old, model.config)) >= 7 * model.config.num_hidden_layers


def test_fp8_checkpoint_build_allocates_no_16_bit_linear(tiny_qwen2_dir, tmp_path):
    """The fp8 linears are fp8 from the start: no tensor of a layer linear's weight shape in any other dtype."""
    from tests.engine.test_quant import write_fp8_checkpoint

    d = write_fp8_checkpoint(tiny_qwen2_dir, tmp_path / "ct", "compressed-tensors")
    with torch.device("meta"):
        shapes = {tuple(m.weight.shape) for m in LlamaForCausalLM(resolve_model(str(d)).config).model.layers.modules()
                  if isinstance(m, nn.Linear)}
    assert len(shapes) >= 3
    wide = lambda allocs: [a for a in allocs.seen if a[1] in shapes and a[0] != FP8_DTYPE]
    with Allocations() as new:
        build_model(resolve_model(str(d)), torch.bfloat16, "cpu", None, 0)
    assert wide(new) == []
    with Allocations() as old:
        build_as_before(resolve_model(str(d)), torch.bfloat16, "cpu", None, 0)
    assert wide(old)


def test_online_fp8_quantizes_each_layer_as_it_loads(monkeypatch):
    """When layer i is quantized, layers after it hold no memory yet (still on the meta device) and layers before
    it are fp8 already: at most one layer is ever 16-bit."""
    import engine.loader as loader

    seen = []
    original = loader.load_weights

    def spy(model, resolved, *, device=None, after_layer=None):
        def check(layer):
            i = next(j for j, m in enumerate(model.model.layers) if m is layer)
            kinds = [("meta" if all(p.is_meta for p in m.parameters()) else
                      "fp8" if any(isinstance(x, Fp8Linear) for x in m.modules()) else "16-bit")
                     for m in model.model.layers]
            seen.append((i, kinds))
            after_layer(layer)
        original(model, resolved, device=device, after_layer=check)

    monkeypatch.setattr(loader, "load_weights", spy)
    build_model(random_resolved("tiny-qwen2")(), torch.bfloat16, "cpu", "fp8", 0)
    assert seen == [(0, ["16-bit", "meta"]), (1, ["fp8", "16-bit"])]


# --- peak resident memory, measured in a fresh process ---------------------------------------------------------------


def _config_for(args) -> dict:
    return dict(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                head_dim=args.hidden // args.heads)


def peak_rss_kib() -> int:
    """This process's peak resident set: /proc's VmHWM where there is one (ru_maxrss also counts the peak of the
    process that forked us, before exec), else ru_maxrss (KiB on Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _child(spec: str, mode: str, dtype: str, quantization: str | None, config: dict) -> dict:
    """In a fresh process: resolve, then build the model `mode`'s way; peak RSS grown by the build."""
    import gc

    torch.set_num_threads(2)
    resolved = resolve_model(spec)
    if spec.startswith("random:"):
        for k, v in config.items():
            setattr(resolved.config, k, v)
    build = build_model if mode == "after" else build_as_before
    # A first build of a 1-layer model pays what any build costs once (torch's first ops, allocator and thread-pool
    # set-up: 20-50 MiB depending on the environment), so the measured growth is the model's.
    warm = resolve_model(spec)
    if spec.startswith("random:"):
        for k, v in {**config, "num_hidden_layers": 1, "vocab_size": 256}.items():
            setattr(warm.config, k, v)
    warm_model = build(warm, getattr(torch, dtype), "cpu", quantization, 0)
    del warm_model
    gc.collect()
    before = peak_rss_kib()
    model = build(resolved, getattr(torch, dtype), "cpu", quantization, 0)
    peak = peak_rss_kib()
    nbytes = sum(t.numel() * t.element_size() for t in {id(p): p for p in model.parameters()}.values())
    return dict(peak_growth_mib=(peak - before) / 1024, model_mib=nbytes / 2**20,
                params=sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()))


def measure(spec: str, mode: str, dtype: str, quantization: str | None, config: dict) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from tests.engine.test_build_model import _child; "
            f"print(json.dumps(_child({spec!r}, {mode!r}, {dtype!r}, {quantization!r}, {config!r})))")
    # A fixed mmap threshold: glibc's adaptive one moves freed tensors onto the heap, where fragmentation kept
    # up to a model's worth of freed 16-bit layers resident in one run of many (flaky peaks); with it, every tensor
    # of 128 KiB or more is its own mapping, returned when freed, so the peak is the live tensors' peak.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


SMALL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=8192, head_dim=64)  # 31M parameters: 62 MiB in bf16


FIXED_MIB = 16  # what a build costs beyond its tensors once a first build has run (_child's warm-up)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_peak_rss_of_a_bf16_build(quantization):
    """Building in bf16 grows the process by about the model (float32 construction: by twice that and more); with
    online fp8, by about the fp8 model plus one layer's 16-bit weights. Measured (31M parameters, 2026-12): bf16
    141 -> 83 MiB for a 62 MiB model; fp8 141 -> 61 MiB for a 39 MiB model."""
    after = measure("random:tiny", "after", "bfloat16", quantization, SMALL)
    before = measure("random:tiny", "before", "bfloat16", quantization, SMALL)
    c = SMALL
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    layer_mib = 2 * c["hidden_size"] * (2 * q + 2 * kv + 3 * c["intermediate_size"]) / 2**20  # bf16
    assert after["peak_growth_mib"] < after["model_mib"] + layer_mib + FIXED_MIB, (after, layer_mib)
    assert after["peak_growth_mib"] < before["peak_growth_mib"] - 0.6 * after["model_mib"], (before, after)


def write_random_fp8_checkpoint(out: Path, config: dict) -> None:
    """random:tiny with `config`'s shapes, in bf16, saved unfused as a 16-bit checkpoint next to `out`, then
    written as an fp8 compressed-tensors checkpoint into `out` (tests/engine/test_quant.py's writer)."""
    from safetensors.torch import save_file

    from tests.engine.test_quant import write_fp8_checkpoint

    resolved = resolve_model("random:tiny")
    for k, v in config.items():
        setattr(resolved.config, k, v)
    with torch.device("meta"):
        model = LlamaForCausalLM(resolved.config)
    model.to(torch.bfloat16)
    load_weights(model, resolved, device="cpu")
    src = out.with_name(out.name + "-bf16")
    src.mkdir(parents=True)
    resolved.config.save_pretrained(src)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(src / "model.safetensors"),
              metadata={"format": "pt"})
    del model
    write_fp8_checkpoint(src, out, "compressed-tensors")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--fp8-checkpoint", type=Path, default=None,
                   help="also measure an fp8 (compressed-tensors) checkpoint of this config in this directory, "
                        "written there first if it does not exist")
    args = p.parse_args()
    config = _config_for(args)
    rows = [("random:tiny", "bfloat16", None), ("random:tiny", "bfloat16", "fp8")]
    if args.fp8_checkpoint:
        if not args.fp8_checkpoint.exists():
            write_random_fp8_checkpoint(args.fp8_checkpoint, config)
        rows.append((str(args.fp8_checkpoint), "bfloat16", None))
    print(f"config {config}")
    print(f"{'model':<24} {'dtype':<9} {'quant':<5} {'params':>8} {'model MiB':>9} {'before MiB':>10} {'after MiB':>9}")
    for spec, dtype, quantization in rows:
        before = measure(spec, "before", dtype, quantization, config)
        after = measure(spec, "after", dtype, quantization, config)
        print(f"{spec[-24:]:<24} {dtype:<9} {str(quantization):<5} {after['params'] / 1e6:>7.0f}M "
              f"{after['model_mib']:>9.0f} {before['peak_growth_mib']:>10.0f} {after['peak_growth_mib']:>9.0f}")


if __name__ == "__main__":
    main()
