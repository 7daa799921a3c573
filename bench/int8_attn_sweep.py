"""Decode attention over an int8 KV cache: its launch configurations against the fp8 and bf16 caches' (issue 17).

  python3 bench/int8_attn_sweep.py [--batch 256 32 1] [--context 640] [--max-model-len 784] [--budget 200]
                                   [--workers 8] [--int8-layout row block] [--json out.json]
  TRITON_INTERPRET=1 python3 bench/int8_attn_sweep.py --smoke [--int8-layout block]  # on the CPU: tiny shapes

Caches in the engine's layout (engine/model_runner.py: [blocks, 28 layers, 2, block_size, kv_heads, row], layer 3
read, so the strides are the engine's), filled as write_kv
fills them, block tables permuted; Qwen2.5-7B's attention: 28 query heads, 4 KV heads, head_dim 128, block 16, bf16
queries. Batch b decodes one token per sequence over contexts uniform in --context +-20% (b = 1: exactly
--context); every launch is sized for --max-model-len keys, as the decode CUDA graphs are. --int8-layout (one or
more; default the engine's, kernels/quant_int8.INT8_LAYOUT): how each block's int8 region holds values and scales
(int8_cache_views): "row", each row head_dim values then its float32 scale (rows 4-byte aligned); "block", the
block's values [block_size, kv_heads, head_dim] then its scales [kv_heads, block_size] (rows 16-byte aligned).
Every int8 config runs in each layout given; the "path" column says which 8-bit walk the launch took (words:
fp8x4 1 or 2, else bytes; align 1: from the 16-byte boundary below each row, align 2: 16-byte aligned rows).

0. Every distinct kernel is compiled first, in --workers processes (each launches it once on a small batch of the
   same layout, filling Triton's on-disk cache).
1. Check: every (cache, config) once against paged_attention_ref (float32); a relative error above TOL marks the
   row WRONG and the run exits 1 at the end.
2. Time: triton.testing.do_bench median (the L2 cleared before each run) of one launch, i.e. one layer, in
   microseconds; "vs fp8" divides by the fp8 cache's default at the same batch. Rows past --budget seconds are
   checked but not timed.
The int8 configs (default_config's entries, overridden): the word walk (fp8x4 2: four values per 32-bit load,
converted by PTX) and int8_align 1 (16-byte loads: in the row layout from the 16-byte boundary below each row, in
the block layout the aligned rows as they are: kernels/paged_attention.py's _attend_tiles_words), over key tiles,
warps, stages and a register cap; unsplit also the capped configs with int8_align 0, at split batches also the
byte walk (fp8x4 0). Prints one table; results go to bench/RESULTS.md ("INT8 KV cache").
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import compile_in_processes, format_table, write_json  # noqa: E402
from kernels._checks import interpreting, sm_count  # noqa: E402
from kernels.paged_attention import (LAST_LAUNCH, default_config, paged_attention_ref,  # noqa: E402
                                     paged_attention_triton)
from kernels.quant_int8 import (INT8_LAYOUT, INT8_LAYOUTS, INT8_ROW_PAD, int8_cache_views,  # noqa: E402
                                quantize_int8_rows_ref)

H, HKV, D, BS, LAYERS, LAYER = 28, 4, 128, 16, 28, 3  # Qwen2.5-7B attention; the layer read
TOL = 2e-2  # relative (Frobenius) error of the bf16 output against the float32 reference
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}


def build(kv: str, seq_lens: list[int], max_seq_len: int, device: str, num_layers: int = LAYERS,
          seed: int = 0, int8_layout: str = INT8_LAYOUT) -> dict:
    """paged_attention's decode arguments over layer LAYER of an engine-layout cache of kv (bf16 / fp8 / int8;
    int8_layout: int8_cache_views' layout)."""
    if kv.startswith("int8-"):  # a cache name of main()'s: int8-<layout>
        kv, int8_layout = "int8", kv[5:]
    gen = torch.Generator(device=device).manual_seed(seed)
    nblk = [math.ceil(sl / BS) for sl in seq_lens]
    num_blocks = sum(nblk) + 1
    row = D + INT8_ROW_PAD if kv == "int8" else D
    cache = torch.empty(num_blocks, num_layers, 2, BS, HKV, row, dtype=DTYPES[kv], device=device)
    layer = min(LAYER, num_layers - 1)
    x = torch.randn(num_blocks, 2, BS, HKV, D, device=device, generator=gen)
    x *= torch.rand(num_blocks, 2, BS, HKV, 1, device=device, generator=gen)  # rows of different ranges
    extra: dict = {}
    if kv == "int8":
        (kc, ks), (vc, vs) = (int8_cache_views(cache[:, layer, 0], int8_layout),
                                int8_cache_views(cache[:, layer, 1], int8_layout))
        x_q, sc = quantize_int8_rows_ref(x)
        kc.copy_(x_q[:, 0]), vc.copy_(x_q[:, 1]), ks.copy_(sc[:, 0]), vs.copy_(sc[:, 1])
        extra = dict(k_scale_cache=ks, v_scale_cache=vs)
    else:
        kc, vc = cache[:, layer, 0], cache[:, layer, 1]
        if kv == "fp8":
            x *= 64
            extra = dict(k_scale=1 / 64, v_scale=1 / 64)
        kc.copy_(x[:, 0]), vc.copy_(x[:, 1])
    del x
    perm = torch.randperm(num_blocks, device=device, generator=gen)
    bt = torch.zeros(len(seq_lens), max(max(nblk), math.ceil(max_seq_len / BS)), dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(nblk):
        bt[i, :n] = perm[used:used + n]
        used += n
    b = len(seq_lens)
    q = torch.randn(b, H, D, device=device, generator=gen).to(torch.bfloat16)
    return dict(q=q, k_cache=kc, v_cache=vc, block_tables=bt,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=device), max_query_len=1,
                max_seq_len=max_seq_len, scale=D ** -0.5, **extra)


def int8_candidates(split: bool, smoke: bool) -> list[dict]:
    """The int8 configs compared ({} is the default); split: a launch that splits the context (small batches)."""
    if smoke:
        return [{}, dict(int8_align=1), dict(int8_align=0), dict(tile_n=32, num_segments=2, int8_align=1),
                dict(fp8x4=0, num_stages=3)]
    if not split:
        words = [dict(tile_n=t, num_warps=w, num_stages=st) for t in (128, 64) for w in (4, 8) for st in (2, 3)]
        capped = [dict(tile_n=t, num_warps=4, num_stages=2, maxnreg=168) for t in (128, 64)]
    else:
        words = [dict(tile_n=t, num_warps=4, num_stages=st) for t in (64, 32) for st in (2, 3)]
        capped = [dict(tile_n=64, num_warps=8, num_stages=2)]
    return ([{}] + words + [dict(c, int8_align=1) for c in words + capped]
            + ([dict(fp8x4=0, num_stages=3)] if split else [dict(c, int8_align=0) for c in capped]))


def resolve(args: dict, override: dict) -> dict:
    """The full launch config paged_attention_triton takes for args with override (default_config's entries)."""
    q, kc = args["q"], args["k_cache"]  # (k_cache: a tensor of the cache's dtype)
    cfg = default_config(q.shape[0], args["block_tables"].shape[0], HKV, H // HKV, D, 1, args["max_seq_len"],
                         sm_count(q.device, 4), q.element_size(), kc.dtype == torch.float8_e4m3fn,
                         kc.dtype == torch.int8)
    return {**cfg, **override}


def label(override: dict, full: dict) -> str:
    if not override:
        return "default"
    return " ".join(f"{k}={v}" for k, v in override.items())


def _compile_worker(jobs: list[tuple[str, dict]]) -> list[str]:
    """In a child process: launch each (kv, full config) once on a small batch of the same layout (the timed
    launches' specializations), compiling it into Triton's on-disk cache."""
    torch.cuda.init()
    errors, built = [], {}
    for kv, cfg in jobs:
        if kv not in built:
            built[kv] = build(kv, [64, 40], 784, "cuda", seed=1)
        try:
            paged_attention_triton(**built[kv], config=cfg)
        except Exception as e:  # noqa: BLE001 (reported; the timed run meets it again)
            errors.append(f"{kv} {cfg}: {type(e).__name__}: {str(e)[:200]}")
    torch.cuda.synchronize()
    return errors


def precompile(jobs: list[tuple[str, dict]], workers: int) -> None:
    items = list({(kv, tuple(sorted(cfg.items()))): (kv, cfg) for kv, cfg in jobs}.values())
    compile_in_processes(_compile_worker, items, workers)


def time_us(fn, smoke: bool) -> float:
    if smoke:  # the interpreter: one call, only to run the path
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def launch_checked(args: dict, ref: torch.Tensor, config: dict) -> tuple[torch.Tensor, float, bool]:
    """One launch of `config` into a NaN-filled output: (out, its relative error against ref, whether it is finite
    and within TOL). Raises what the launch raised (an out-of-resources config is the caller's data point)."""
    out = torch.full_like(args["q"], float("nan"))
    paged_attention_triton(**args, out=out, config=config)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    return out, err, bool(torch.isfinite(out).all()) and err < TOL


def path() -> str:
    """The 8-bit walk the last launch took: bytes, words (fp8x4 1 or 2), +align1 / +align2 (int8_align's)."""
    p = LAST_LAUNCH.get("path") or {}
    if not p.get("fp8x4"):
        return "bytes"
    return f"words{p['fp8x4']}" + (f"+align{p['align16']}" if p.get("align16") else "")


def compiled() -> str:
    k = LAST_LAUNCH.get("kernel")
    regs, spills = getattr(k, "n_regs", None), getattr(k, "n_spills", None)
    return f"{regs}/{spills}" if regs is not None else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[256, 32, 1], help="decode batch sizes, in order")
    p.add_argument("--context", type=int, default=640, help="mean keys per sequence (+-20%%; batch 1: exactly)")
    p.add_argument("--max-model-len", type=int, default=784, help="the launches are sized for this many keys")
    p.add_argument("--budget", type=float, default=200.0, help="seconds of checking and timing, then check only")
    p.add_argument("--workers", type=int, default=8, help="processes compiling the kernels first")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--int8-layout", nargs="+", choices=INT8_LAYOUTS, default=[INT8_LAYOUT],
                   help=f"the int8 cache's layouts, each timed (default the engine's, {INT8_LAYOUT})")
    p.add_argument("--json", help="write the rows and the run's metadata here")
    a = p.parse_args(argv)
    caches = ["bf16", "fp8"] + [f"int8-{lay}" for lay in dict.fromkeys(a.int8_layout)]
    if a.smoke:
        if not interpreting():
            p.error("--smoke runs under TRITON_INTERPRET=1 (on the CPU)")
        device, batches, context, max_len, num_layers = "cpu", [2], 24, 40, 2
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA device (or --smoke under TRITON_INTERPRET=1)", file=sys.stderr)
            return 2
        device, batches, context, max_len, num_layers = "cuda", a.batch, a.context, a.max_model_len, LAYERS
    t_start = time.time()
    gen = torch.Generator().manual_seed(0)
    shapes = []
    for b in batches:
        lo, hi = (context, context) if b == 1 else (int(0.8 * context), int(1.2 * context))
        seq_lens = torch.randint(lo, hi + 1, (b,), generator=gen).tolist()
        shapes.append((b, seq_lens, max(max_len, max(seq_lens))))
    # The configs per (batch, cache), resolved on a stand-in batch of the same shape (default_config reads shapes
    # only), so the compile step gets every launch's full config.
    plans = []
    for b, seq_lens, max_seq_len in shapes:
        for kv in caches:
            int8 = kv.startswith("int8")
            stub = dict(q=torch.empty(b, H, D, dtype=torch.bfloat16, device=device),
                        k_cache=torch.empty(0, dtype=DTYPES["int8" if int8 else kv]), block_tables=torch.empty(b, 0),
                        max_seq_len=max_seq_len)
            split = resolve(stub, {})["num_segments"] > 1
            overrides = int8_candidates(split, a.smoke) if int8 else [{}]
            seen, cands = set(), []
            for o in overrides:
                full = resolve(stub, o)
                key = tuple(sorted(full.items()))
                if key not in seen:  # e.g. an override that restates the default
                    seen.add(key)
                    cands.append((o, full))
            plans.append((b, seq_lens, max_seq_len, kv, cands))
    if not a.smoke:
        precompile([(kv, full) for *_, kv, cands in plans for _, full in cands], a.workers)

    rows, wrong, fp8_us = [], 0, {}
    print(f"{'batch':>5s} {'cache':10s} {'config':58s} {'path':14s} {'us':>8s} {'rel err':>8s}", flush=True)
    for b, seq_lens, max_seq_len, kv, cands in plans:
        args = build(kv, seq_lens, max_seq_len, device, num_layers)
        ref = paged_attention_ref(**args).float()
        for override, full in cands:
            try:
                out, err, ok = launch_checked(args, ref, full)
            except Exception as e:  # noqa: BLE001 (an out-of-resources config is a data point)
                print(f"{b:5d} {kv:10s} {label(override, full):58s} {type(e).__name__}: {str(e)[:80]}", flush=True)
                continue
            walk = path()
            wrong += not ok
            us = float("nan")
            if time.time() - t_start < a.budget:
                us = time_us(lambda: paged_attention_triton(**args, out=out, config=full), a.smoke)
            if kv == "fp8" and not override:
                fp8_us[b] = us
            rows.append(dict(batch=b, mean_context=sum(seq_lens) / b, cache=kv, config=label(override, full),
                             full_config=full, path=walk, us=us, rel_err=err, ok=ok, regs_spills=compiled()))
            print(f"{b:5d} {kv:10s} {label(override, full):58s} {walk:14s} {us:8.1f} {err:8.1e}"
                  f"{'' if ok else '  WRONG'}", flush=True)
        del args, ref

    table = []
    for r in rows:
        vs = r["us"] / fp8_us.get(r["batch"], float("nan"))
        r["vs_fp8"] = vs
        table.append([r["batch"], r["cache"], r["config"], r["path"], round(r["us"], 1), f"{vs:.3f}x",
                      f"{r['rel_err']:.1e}", r["regs_spills"], "ok" if r["ok"] else "WRONG"])
    print()
    print(format_table(["batch", "cache", "config", "path", "us per layer", "vs fp8", "rel err", "regs/spills",
                        "check"], table))
    for b, *_ in shapes:
        for kv in caches[2:]:
            int8 = [r for r in rows if r["batch"] == b and r["cache"] == kv and r["ok"] and r["us"] == r["us"]]
            if int8 and not a.smoke:
                best = min(int8, key=lambda r: r["us"])
                dflt = next((r for r in int8 if r["config"] == "default"), best)
                print(f"batch {b}: fastest {kv} {best['config']} ({best['path']}) {best['us']:.1f} us "
                      f"({best['vs_fp8']:.3f}x fp8, {best['us'] / dflt['us']:.3f}x its default); "
                      f"full config {best['full_config']}")
    print(f"done in {time.time() - t_start:.0f} s{'' if not wrong else f'; {wrong} rows WRONG'}")
    if a.json:
        write_json(a.json, {"args": vars(a), "rows": rows})
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
