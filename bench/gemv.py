"""Batch-1..8 decode GEMVs at Qwen2.5-7B shapes: cuBLAS against kernels/gemv.py's configs, one run, on CUDA.

  python3 bench/gemv.py [--m 1,2,4,8] [--quick] [--budget 200] [--workers 16] [--json out.json]

Shapes (N, K): qkv 4608x3584 (+bias), o_proj 3584x3584, gate_up 37888x3584, down 3584x18944, lm_head 152064x3584,
bf16. Every time is a CUDA graph of back-to-back launches (no launch overhead between them, as in the decode
graph), each launch on the next of several copies of the weight, so that no launch finds its weight in the 50 MB L2
(the copies between two uses of one copy total > 250 MB, as a real model's 28 layers do); the median of 5 replays,
divided by the launches. TB/s counts the bytes a launch must move (weight, x, y, bias).

Baselines: F.linear (what the engine calls), x @ W.t(), torch.mv (M=1) and x @ Wt with W pre-transposed to [K, N].
The sweep runs every candidate config (mode, BLOCK_N, BLOCK_K, warps, stages, SPLIT_K) on each shape and M, checks
its output against the float32 reference, and keeps the fastest. qkv is swept without its bias (the bias only adds
N values in the epilogue) and its best config timed again with it. Then the "whole layer" graphs: 28 layers of
qkv, o_proj, gate_up, down on distinct weights (13 GB) plus lm_head, as one decode token's GEMVs, with cuBLAS, with
the best configs, and through kernels.gemv.linear with the table this run found (the kernel where it won, cuBLAS
elsewhere). The last lines are that table, ready to paste into kernels/gemv.py's CONFIGS.

Compiling ~150 kernel variants is most of the run: a pool of processes compiles them into Triton's cache first.
--budget (seconds) trims each shape's candidate list if the sweep runs late. Needs a CUDA device.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels.gemv as gemv  # noqa: E402
from kernels.gemv import GemvConfig, gemv_ref, gemv_triton  # noqa: E402

SHAPES = [("qkv", 4608, 3584, True), ("o_proj", 3584, 3584, False), ("gate_up", 37888, 3584, False),
          ("down", 3584, 18944, False), ("lm_head", 152064, 3584, False)]
NUM_LAYERS = 28
ROTATION_BYTES = 256e6  # bytes of other weight copies read between two uses of one copy (>> 50 MB of L2)
GRAPH_US = 1000.0  # aim for graphs of about this long (many launches for the small shapes)
DTYPE = torch.bfloat16
DEVICE = "cuda"


# ----------------------------------------------------------------------------------------------- candidates
def candidates(M: int, N: int, quick: bool) -> list[GemvConfig]:
    """Configs to try for M rows: register-bounded tiles of each mode, split-K only where N is small."""
    splits = (1, 2, 4) if N <= 8192 else (1,)
    out = []
    # fma: [BLOCK_N, BLOCK_K] of W per step, <= 64 elements per thread (prefetch doubles it)
    fma_tiles = [(8, 256, 4), (16, 256, 4), (8, 512, 4), (16, 512, 4), (32, 256, 8), (4, 512, 4), (16, 512, 8),
                 (32, 512, 8), (4, 256, 1), (8, 256, 2), (8, 512, 2)]  # 1-2 warps: no cross-warp barrier per step
    for bn, bk, w in fma_tiles[:3] if quick else fma_tiles:
        for st in (2, 1):
            out += [GemvConfig(bn, bk, s, w, st, "fma") for s in splits]
    # fma_late: M <= 4, an fp32 accumulator per row of x: M * BLOCK_N * BLOCK_K / threads <= 64
    if M <= 4:
        late_tiles = [(16, 256, 4), (8, 512, 4), (32, 256, 8), (8, 256, 4), (4, 512, 4), (4, 256, 4)]
        late_tiles = [t for t in late_tiles if M * t[0] * t[1] / (32 * t[2]) <= 64][:3]
        for bn, bk, w in late_tiles[:2] if quick else late_tiles:
            for st in (2, 1):
                out += [GemvConfig(bn, bk, s, w, st, "fma_late") for s in splits]
    # dot: W streamed through shared memory (cp.async, num_stages deep) into the tensor cores; x padded to 16
    dot_tiles = [(64, 128, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3), (128, 128, 8, 4),
                 (128, 256, 8, 3), (32, 256, 4, 4), (16, 512, 4, 3), (64, 128, 4, 6), (128, 128, 8, 5)]
    for bn, bk, w, st in dot_tiles[:3] if quick else dot_tiles:
        out += [GemvConfig(bn, bk, s, w, st, "dot") for s in splits + ((8,) if N <= 8192 and bn >= 64 else ())]
    return out


def compile_key(cfg: GemvConfig, M: int, K: int, bias: bool) -> tuple:
    """What decides a distinct Triton compile (the split count itself is a runtime argument)."""
    k_per_split = math.ceil(math.ceil(K / cfg.split_k) / cfg.block_k) * cfg.block_k
    split = math.ceil(K / k_per_split) > 1
    block_m = max(16 if cfg.mode == "dot" else 1, 1 << (M - 1).bit_length())
    return (cfg.mode, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, block_m, M == 1, split, bias,
            K % cfg.block_k == 0)


def _compile_worker(jobs: list[tuple[dict, int, int, bool]], fp8: bool = False) -> tuple[int, list[str]]:
    """In a child process: launch each (config, M, K, bias) once on small tensors of the same alignment as the
    real ones (N = 256, real K; an fp8 weight with unit scales when `fp8`), which compiles it into Triton's on-disk
    cache."""
    torch.cuda.init()
    errors = []
    for cfg_d, M, K, bias in jobs:
        cfg = GemvConfig(**cfg_d)
        try:
            x = torch.randn(M, K, dtype=DTYPE, device=DEVICE)
            w = torch.randn(256, K, device=DEVICE).to(torch.float8_e4m3fn if fp8 else DTYPE)
            b = torch.randn(256, dtype=DTYPE, device=DEVICE) if bias else None
            gemv_triton(x, w, b, weight_scale=torch.ones(256, device=DEVICE) if fp8 else None, config=cfg)
        except Exception as e:  # reported by the parent; the sweep skips what fails to compile
            errors.append(f"{cfg.short()} M={M}: {type(e).__name__}: {str(e)[:200]}")
    torch.cuda.synchronize()
    return len(jobs), errors


def precompile(jobs: list[tuple[GemvConfig, int, int, bool]], workers: int, fp8: bool = False) -> None:
    """Compiles each distinct kernel variant of `jobs` once, in `workers` processes (fp8: with fp8 weights)."""
    unique = {}
    for cfg, M, K, bias in jobs:
        unique.setdefault(compile_key(cfg, M, K, bias), (asdict(cfg), M, K, bias))
    items = list(unique.values())
    t0 = time.time()
    if workers <= 1:
        _compile_worker(items, fp8)
    else:
        chunks = [items[i::workers] for i in range(workers)]
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            for n, errors in ex.map(partial(_compile_worker, fp8=fp8), [c for c in chunks if c]):
                for e in errors[:5]:
                    print("  compile error:", e, flush=True)
    print(f"compiled {len(items)} {'fp8 ' if fp8 else ''}kernel variants in {time.time() - t0:.1f} s with {workers} "
          "processes", flush=True)


# ----------------------------------------------------------------------------------------------- timing
def graph_ms(run, reps: int = 5) -> float:
    """Milliseconds per replay of one CUDA graph of run() (run once before, outside the capture: compile/load,
    workspaces, cuBLAS handles); the median of `reps` replays."""
    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del g
    return statistics.median(times)


def time_rotation(launch, copies: int, est_us: float, reps: int = 5) -> float:
    """Microseconds per launch: launch(i) for i over the weight copies, captured back to back in one graph."""
    n = max(copies, min(400, round(GRAPH_US / max(est_us, 1.0))))

    def run() -> None:
        for i in range(n):
            launch(i % copies)

    return graph_ms(run, reps) * 1e3 / n


def close(y: torch.Tensor, ref: torch.Tensor) -> bool:
    scale = ref.float().abs().max().item() + 1e-6
    return (y.float() - ref.float()).abs().max().item() <= 1.6e-2 * scale


class Shape:
    """Weight copies (and pre-transposed copies for the x @ Wt baseline) of one projection."""

    def __init__(self, name: str, N: int, K: int, bias: bool, transposed: bool = True):
        self.name, self.N, self.K, self.has_bias = name, N, K, bias
        self.w_bytes = N * K * 2
        self.copies = max(2, math.ceil(ROTATION_BYTES / self.w_bytes) + 1)
        gen = torch.Generator(device=DEVICE).manual_seed(N + K)
        w0 = torch.randn(N, K, dtype=DTYPE, device=DEVICE, generator=gen) / K**0.5
        self.w = [w0] + [w0.clone() for _ in range(self.copies - 1)]
        self.wt = [w.t().contiguous() for w in self.w] if transposed else None
        self.b = torch.randn(N, dtype=DTYPE, device=DEVICE, generator=gen) if bias else None

    def bytes(self, M: int, bias: bool) -> int:
        return self.w_bytes + 2 * M * (self.K + self.N) + (2 * self.N if bias else 0)

    def est_us(self, M: int) -> float:
        return self.bytes(M, False) / 4e12 * 1e6

    def free_transposed(self) -> None:
        self.wt = None


def baselines(sh: Shape, M: int, x: torch.Tensor) -> dict[str, float]:
    est, C, b = sh.est_us(M), sh.copies, sh.b
    out = {"F.linear": time_rotation(lambda i: F.linear(x, sh.w[i], b), C, est)}
    out["x@W.t()"] = time_rotation(lambda i: x @ sh.w[i].t() if b is None else torch.addmm(b, x, sh.w[i].t()), C, est)
    if M == 1:
        out["torch.mv"] = time_rotation(lambda i: torch.mv(sh.w[i], x[0]) if b is None else
                                        torch.addmv(b, sh.w[i], x[0]), C, est)
    if sh.wt is not None:
        out["x@Wt"] = time_rotation(lambda i: x @ sh.wt[i] if b is None else torch.addmm(b, x, sh.wt[i]), C, est)
    return out


def sweep(sh: Shape, M: int, x: torch.Tensor, cands: list[GemvConfig], deadline: float
          ) -> tuple[list[tuple[float, GemvConfig]], int, list[str]]:
    """(us, config) for every candidate that ran and matched the reference, fastest first."""
    ref = gemv_ref(x, sh.w[0])
    y = torch.empty(M, sh.N, dtype=DTYPE, device=DEVICE)
    results, bad = [], []
    for n_run, cfg in enumerate(cands):
        if time.time() > deadline:
            return sorted(results, key=lambda r: r[0]), n_run, bad
        try:
            y.fill_(float("nan"))
            gemv_triton(x, sh.w[0], out=y, config=cfg)
            if not close(y, ref):
                bad.append(f"{cfg.short()}: wrong result")
                continue
            us = time_rotation(lambda i: gemv_triton(x, sh.w[i], out=y, config=cfg), sh.copies, sh.est_us(M))
            results.append((us, cfg))
        except Exception as e:
            bad.append(f"{cfg.short()}: {type(e).__name__}: {str(e)[:120]}")
    return sorted(results, key=lambda r: r[0]), len(cands), bad


# ----------------------------------------------------------------------------------------------- whole layer
def layer_graphs(M: int, best: dict[str, GemvConfig], shapes: dict[str, Shape]) -> dict[str, float]:
    """One token's GEMVs: 28 layers x (qkv, o_proj, gate_up, down) on distinct weights, then lm_head; ms per
    replay of one graph for cuBLAS, the best configs, and kernels.gemv.linear with this run's table."""
    gen = torch.Generator(device=DEVICE).manual_seed(M)
    layer_shapes = [s for s in SHAPES if s[0] != "lm_head"]
    weights = []
    for _ in range(NUM_LAYERS):
        weights.append({name: (torch.randn(N, K, dtype=DTYPE, device=DEVICE, generator=gen) / K**0.5,
                               torch.randn(N, dtype=DTYPE, device=DEVICE, generator=gen) if bias else None)
                        for name, N, K, bias in layer_shapes})
    head = shapes["lm_head"].w[0]
    xs = {K: torch.randn(M, K, dtype=DTYPE, device=DEVICE, generator=gen) for K in {s[2] for s in SHAPES}}
    ys = {name: torch.empty(M, N, dtype=DTYPE, device=DEVICE) for name, N, _, _ in SHAPES}

    def run(kind: str) -> None:
        for lw in weights:
            for name, N, K, _ in layer_shapes:
                w, b = lw[name]
                if kind == "cublas":
                    F.linear(xs[K], w, b)
                elif kind == "mine":
                    gemv_triton(xs[K], w, b, out=ys[name], config=best[name])
                else:
                    gemv.linear(xs[K], w, b)
        if kind == "cublas":
            F.linear(xs[head.shape[1]], head)
        elif kind == "mine":
            gemv_triton(xs[head.shape[1]], head, out=ys["lm_head"], config=best["lm_head"])
        else:
            gemv.linear(xs[head.shape[1]], head)

    out = {kind: graph_ms(partial(run, kind)) for kind in ("cublas", "mine", "table")}
    del weights
    torch.cuda.empty_cache()
    return out


def host_us(fn, n: int = 2000) -> float:
    """Host microseconds per eager call (launch cost only: small kernels, the device keeps up)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


# ----------------------------------------------------------------------------------------------- main
def table_source(table: dict[tuple[int, int], list[tuple[int, GemvConfig | None]]], name: str = "CONFIGS") -> str:
    """The table as kernels/gemv.py's source of `name` (CONFIGS, or CONFIGS_FP8)."""
    lines = [f"{name}: dict[tuple[int, int], tuple[tuple[int, GemvConfig | None], ...]] = {{"]
    for (N, K), entries in table.items():
        items = []
        for max_m, cfg in entries:
            if cfg is None:
                items.append(f"({max_m}, None)")
            else:
                items.append(f"({max_m}, GemvConfig({cfg.block_n}, {cfg.block_k}, {cfg.split_k}, {cfg.num_warps}, "
                             f"{cfg.num_stages}, {cfg.mode!r}))")
        lines.append(f"    ({N}, {K}): ({', '.join(items)},),")
    lines.append("}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,2,4,8", help="rows of x (the decode batch), comma-separated")
    ap.add_argument("--quick", action="store_true", help="fewer candidates")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds for the whole run (the sweep trims to fit)")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="compile processes")
    ap.add_argument("--no-layer", action="store_true", help="skip the whole-layer graphs")
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gemv.py needs a CUDA device")
    t_start = time.time()
    Ms = [int(m) for m in args.m.split(",")]
    props = torch.cuda.get_device_properties(0)
    import triton
    print(f"{props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size / 2**20:.0f} MiB; "
          f"torch {torch.__version__}, triton {triton.__version__}", flush=True)

    # every (config, M, K, bias) the sweep and the final timings launch, compiled in parallel first
    jobs = []
    for name, N, K, bias in SHAPES:
        for M in Ms:
            jobs += [(c, M, K, False) for c in candidates(M, N, args.quick)]
    precompile(jobs, args.workers)

    a = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    b = torch.empty_like(a)
    copy_us = time_rotation(lambda i: b.copy_(a), 1, 500.0)
    del a, b
    print(f"device copy: {2 * (1 << 30) / copy_us / 1e6:.2f} TB/s (read + write)", flush=True)

    shapes = {name: Shape(name, N, K, bias) for name, N, K, bias in SHAPES}
    rows, table, best_per_m, bad_all = [], {}, {M: {} for M in Ms}, []
    reserve = 0.0 if args.no_layer else 12.0 * len(Ms)  # seconds kept for the whole-layer graphs
    items = [(name, M) for name in shapes for M in Ms]
    for idx, (name, M) in enumerate(items):
        sh = shapes[name]
        x = torch.randn(M, sh.K, dtype=DTYPE, device=DEVICE)
        base = baselines(sh, M, x)
        cands = candidates(M, sh.N, args.quick)
        left = t_start + args.budget - reserve - time.time()
        deadline = time.time() + max(3.0, left / (len(items) - idx))
        results, n_run, bad = sweep(sh, M, x, cands, deadline)
        bad_all += [f"{name} M={M} {b}" for b in bad]
        if not results:
            print(f"{name:8s} M={M}: no candidate ran ({len(bad)} failed)", flush=True)
            continue
        us, cfg = results[0]
        us_bias = None
        if sh.has_bias:  # the best config again, with the bias (what the model runs)
            ref = gemv_ref(x, sh.w[0], sh.b)
            y = torch.empty(M, sh.N, dtype=DTYPE, device=DEVICE)
            ok = close(gemv_triton(x, sh.w[0], sh.b, out=y, config=cfg), ref)
            us_bias = time_rotation(lambda i: gemv_triton(x, sh.w[i], sh.b, out=y, config=cfg), sh.copies,
                                    sh.est_us(M))
            if not ok:
                bad_all.append(f"{name} M={M} {cfg.short()} with bias: wrong result")
        mine = us_bias if us_bias is not None else us
        cublas = base["F.linear"]
        best_base = min(base, key=base.get)
        row = dict(shape=name, N=sh.N, K=sh.K, M=M, bias=sh.has_bias, config=asdict(cfg), us=mine,
                   us_no_bias=us, TBps=sh.bytes(M, sh.has_bias) / mine / 1e6, cublas_us=cublas,
                   cublas_TBps=sh.bytes(M, sh.has_bias) / cublas / 1e6, baselines=base,
                   top5=[(u, c.short()) for u, c in results[:5]], ran=n_run, of=len(cands))
        rows.append(row)
        best_per_m[M][name] = cfg
        table.setdefault((sh.N, sh.K), []).append((M, cfg if mine < cublas else None))
        print(f"{name:8s} M={M}: mine {mine:7.2f} us {row['TBps']:5.2f} TB/s  {cfg.short():30s} | F.linear "
              f"{cublas:7.2f} us {row['cublas_TBps']:5.2f} TB/s | best baseline {best_base} {base[best_base]:7.2f} us"
              f" | {cublas / mine:5.2f}x  ({n_run}/{len(cands)} configs, {time.time() - t_start:.0f} s)", flush=True)
        print("          top5: " + ", ".join(f"{c} {u:.2f}" for u, c in row["top5"]), flush=True)
    for sh in shapes.values():
        sh.free_transposed()
    torch.cuda.empty_cache()

    # the table kernels.gemv.linear would use: installed for the 'table' layer graph
    gemv.CONFIGS.clear()
    gemv.CONFIGS.update({k: tuple(v) for k, v in table.items()})
    host = {}
    if "qkv" in best_per_m[Ms[0]]:  # eager paths (prefill of short prompts, --enforce-eager) pay this per call
        sh, M = shapes["qkv"], Ms[0]
        x = torch.randn(M, sh.K, dtype=DTYPE, device=DEVICE)
        cfg = best_per_m[M]["qkv"]
        host = {"F.linear": host_us(lambda: F.linear(x, sh.w[0], sh.b)),
                "gemv_triton": host_us(lambda: gemv_triton(x, sh.w[0], sh.b, config=cfg)),
                "linear": host_us(lambda: gemv.linear(x, sh.w[0], sh.b))}
    layers = {}
    if not args.no_layer:
        for M in Ms:
            if len(best_per_m[M]) == len(SHAPES):
                layers[M] = layer_graphs(M, best_per_m[M], shapes)

    print("\n===== summary (us per launch, TB/s of the bytes each launch must move) =====")
    print(f"{'shape':8s} {'M':>2s} {'F.linear':>9s} {'TB/s':>5s} {'mine':>8s} {'TB/s':>5s} {'speedup':>7s}  "
          f"{'best config':30s} other baselines")
    for r in rows:
        others = " ".join(f"{k} {v:.1f}" for k, v in r["baselines"].items() if k != "F.linear")
        print(f"{r['shape']:8s} {r['M']:2d} {r['cublas_us']:9.2f} {r['cublas_TBps']:5.2f} {r['us']:8.2f} "
              f"{r['TBps']:5.2f} {r['cublas_us'] / r['us']:6.2f}x  {GemvConfig(**r['config']).short():30s} {others}")
    for M, t in layers.items():
        print(f"whole token M={M}: {NUM_LAYERS} layers x (qkv+bias, o_proj, gate_up, down) + lm_head in one graph: "
              f"cuBLAS {t['cublas']:.3f} ms, best configs {t['mine']:.3f} ms, linear() with this table "
              f"{t['table']:.3f} ms  (saves {t['cublas'] - t['table']:.3f} ms per token)")
    if host:
        print(f"host cost per eager call (qkv, M={Ms[0]}): " + ", ".join(f"{k} {v:.1f} us" for k, v in host.items()))
    if bad_all:
        print(f"{len(bad_all)} candidate(s) failed or were wrong; first: " + " | ".join(bad_all[:4]))
    print(f"total {time.time() - t_start:.0f} s")
    print("\n# kernels/gemv.py CONFIGS from this run (None: cuBLAS was faster)")
    source = table_source(table)
    print(source)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=props.name, rows=rows, layers=layers, host_us=host,
                                                   failed=bad_all, table=source), indent=1))


if __name__ == "__main__":
    main()
