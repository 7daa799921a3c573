"""4-bit weights (kernels/w4a16.py, engine/quant_w4.py's W4Linear) against bf16 at Qwen2.5-7B's linear shapes.

  python3 bench/w4a16_gemm.py [--decode-m 1 2 4 8 16] [--prefill-m 16 64 256 1024 2048 4096] [--group-size 128]
                              [--symmetric] [--act-order] [--sweep | --sweep-only | --sweep-pair]
                              [--table-out t.json] [--table t.json] [--workers 8] [--json out.json]

Shapes (N x K, the fused projections the engine runs): qkv 4608 x 3584 (with Qwen2's bias), o 3584 x 3584,
gate_up 37888 x 3584, down 3584 x 18944. The 4-bit weights are random (AWQ-like by default: zero points, groups of
128 inputs, fp16 scales; --symmetric drops the zero points as GPTQ sym does, --act-order adds an input permutation).

1. Check first, every variant against w4a16_ref (float32) in the three layouts the kernels tell apart (AWQ: zero
   points; GPTQ sym: none; GPTQ act order: zero points and a permutation): at one row the pair kernel (the default
   for bfloat16) and the stream kernel, the GEMV at 16 rows (tensor-core dot), the GEMM at 16 and 300 rows; the max
   abs error and the max error over the output's scale; one above bf16's tolerance stops the run (exit status 1).
2. Decode, M = --decode-m (<= 16): microseconds per launch inside one CUDA graph of back-to-back launches, each on
   the next of enough weight copies that none is found in the 50 MB L2 (bench/gemv.py's time_rotation, as the decode
   graph runs them): bf16 F.linear (cuBLAS), bf16 kernels.gemv.linear (the engine's bf16 path), and at one row the
   W4 stream kernel (the previous default), the pair kernel and the pair kernel launched without PDL; at more rows
   the W4 GEMV and GEMM. TB/s counts the bytes the W4 kernel must move (packed weight, scales, zero points, x, y).
   In these graphs the kernel before each launch is the same kernel: PDL overlaps one launch's start with the last
   one's end; in the model (bench/latency.py) the kernel before is an RMSNorm, the activation or attention.
3. One decode token's linears at M = 1 as one graph: 28 layers of the four linears on distinct weights, bf16
   linear() against W4 with the stream kernel, and W4 as W4Linear runs it (the default: the pair kernel), in ms.
4. Prefill, M = --prefill-m: triton.testing.do_bench medians (L2 cleared before each run) of bf16 F.linear, the W4
   GEMM, and dequantizing to bf16 in torch then F.linear (vLLM's AWQ path from 256 tokens on; the dequantization
   alone too). The closing table sums the four linears per M: bf16 against W4, decode and prefill.
--sweep: for each shape, each decode M and each prefill M, a short list of candidate configs, each checked against
the reference and then timed; prints the best per (shape, M) next to the default's time. --sweep-pair: the pair
kernel's candidates at one row only (before step 2; the fastest per shape then times steps 2 and 3, and
--table-out writes them). --table: one-row configs of a --table-out file set in GEMV_TABLE before anything runs
(bench/latency.py --w4-table does the same). The distinct kernels are compiled first in --workers processes.
Needs a CUDA device. Results: bench/RESULTS.md (the JSON with --json).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import compile_in_processes, format_table, write_json  # noqa: E402
from bench.gemv import graph_ms, time_rotation  # noqa: E402
import kernels.gemv as gemv  # noqa: E402
from kernels._checks import sm_count  # noqa: E402
from kernels.pdl import PDL_SUPPORTED  # noqa: E402
from kernels.w4a16 import (GEMV_MAX_M, GEMV_TABLE, PACK, STREAM_MAX_M, W4GemmConfig, W4GemvConfig,  # noqa: E402
                           default_gemm_config, default_gemv_config, w4a16_gemm_triton, w4a16_gemv_triton,
                           w4a16_ref)
from kernels.w4a16_tc import w4a16_triton  # noqa: E402

SHAPES = {"qkv": (4608, 3584, True), "o": (3584, 3584, False), "gate_up": (37888, 3584, False),
          "down": (3584, 18944, False)}  # name: (N, K, bias)
NUM_LAYERS = 28
ROTATION_BYTES = 256e6  # bytes of other weight copies read between two uses of one copy (>> the 50 MB L2)
TOL = 1.6e-2  # bf16 output, relative to the output's largest value
LAYOUTS = {"awq": (True, False), "gptq-sym": (False, False), "gptq-act-order": (True, True)}  # (zeros, perm)
NUM_SMS = 132


def bench(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3  # seconds


class W4:
    """One random 4-bit weight in the kernels' layout (and the bf16 weight of its dequantized values)."""

    def __init__(self, n: int, k: int, bias: bool, group: int, zeros: bool, act_order: bool, seed: int,
                 device: str = "cuda"):
        g = torch.Generator(device=device).manual_seed(seed)
        self.n, self.k = n, k
        self.qweight = torch.randint(-2**31, 2**31 - 1, (k // PACK, n), dtype=torch.int32, device=device,
                                     generator=g)
        self.scales = (torch.rand(k // group, n, device=device, generator=g) * 2e-3 + 1e-3).half()
        self.qzeros = (torch.randint(0, 16, (k // group, n), device=device, generator=g).to(torch.uint8)
                       if zeros else None)
        self.perm = torch.randperm(k, device=device, generator=g).to(torch.int32) if act_order else None
        self.bias = torch.randn(n, device=device, generator=g, dtype=torch.bfloat16) * 0.02 if bias else None

    def args(self):
        return self.qweight, self.scales, self.qzeros, self.bias, self.perm

    def copy(self) -> "W4":
        c = object.__new__(W4)
        c.n, c.k = self.n, self.k
        c.qweight, c.scales = self.qweight.clone(), self.scales.clone()
        c.qzeros = None if self.qzeros is None else self.qzeros.clone()
        c.perm, c.bias = self.perm, self.bias
        return c

    def bytes(self, m: int) -> int:
        zeros = 0 if self.qzeros is None else self.qzeros.numel()
        return self.qweight.numel() * 4 + self.scales.numel() * 2 + zeros + 2 * m * (self.k + self.n)


def dequantize_bf16(w: W4) -> torch.Tensor:
    """W [N, K] bf16 for F.linear, in torch ops on the GPU (the dequant + cuBLAS path; perm applies to x)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.qweight.device)
    q = ((w.qweight[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(w.k, w.n)  # [K, N]
    group = w.k // w.scales.shape[0]
    z = 8 if w.qzeros is None else w.qzeros.repeat_interleave(group, dim=0)
    return ((q - z).to(torch.bfloat16) * w.scales.repeat_interleave(group, dim=0).to(torch.bfloat16)).t()


# ---------------------------------------------------------------------------------------------------------------
# Configs


def stream_config(n: int, k: int, group: int) -> W4GemvConfig:
    """The one-row stream kernel at this shape, as it ran before the pair kernel (launched without PDL)."""
    cfg = default_gemv_config(1, n, k, group, NUM_SMS, torch.float16)  # the stream kernel's config
    return replace(cfg, mode="stream", pdl=False)


def apply_table(path: str) -> None:
    """Sets the one-row configs of a --table-out file ({shape: {"bf16": W4GemvConfig fields}}) in GEMV_TABLE."""
    for name, entry in json.loads(Path(path).read_text()).items():
        n, k, _ = SHAPES[name]
        bf16, other, rows = GEMV_TABLE[(n, k)]
        GEMV_TABLE[(n, k)] = (W4GemvConfig(**entry["bf16"]) if "bf16" in entry else bf16, other, rows)
    print("GEMV_TABLE one-row bf16 entries from", path, {k: v[0].short() for k, v in GEMV_TABLE.items()}, flush=True)


def _splits(tiles: int, k: int, bk: int) -> list[int]:
    """Split counts that put about 1 to 12 programs per SM (132) with at least one step each."""
    return [sp for sp in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if 100 <= tiles * sp <= 1600 and k // (sp * bk) >= 1]


def pair_candidates(n: int, k: int, group: int) -> list[W4GemvConfig]:
    """The pair kernel at one row: 8 or 16 columns a thread (block_n = 256 or 512 per warp; 4 at 128 per warp),
    64 words of a step a thread (the register budget of two steps in flight), grids of about 1, 2 and 4 programs
    per SM."""
    out = []
    for bn, bk, w in ((1024, 64, 4), (512, 64, 2), (256, 64, 1), (512, 32, 1), (512, 128, 4), (128, 128, 1)):
        if group % bk or (n % bn and bn >= 512):
            continue
        tiles = -(-n // bn)
        for waves in (1, 2, 4):
            sp = max(1, min(-(-waves * NUM_SMS // tiles), k // bk))
            cfg = W4GemvConfig(bn, bk, sp, w, 1, mode="pair")
            if cfg not in out:
                out.append(cfg)
    return out


def gemv_candidates(m: int, n: int, group: int, k: int = 0) -> list[W4GemvConfig]:
    out = pair_candidates(n, k, group) if m == 1 else []
    if m <= STREAM_MAX_M:  # the stream kernel; at 2+ rows also the tensor-core path below
        tiles = [(64, 128, 2, 1), (64, 128, 4, 1), (128, 128, 4, 1), (128, 128, 8, 1), (256, 128, 4, 1)]
        if m > 1:
            tiles = [(128, 128, 4, 1), (64, 128, 4, 1), (256, 128, 4, 1)]
        for bn, bk, w, st in tiles:
            if group % bk or (bn == 64 and w == 8):
                continue
            out += [W4GemvConfig(bn, bk, sp, w, st, mode="stream") for sp in _splits(-(-n // bn), k, bk)]
        if m == 1:
            return out
    splits = (1, 2, 4) if n > 8192 else (1, 2, 4, 8, 16)
    tiles = [(64, 128, 4), (128, 128, 4), (256, 128, 8), (128, 64, 4), (256, 64, 4)]
    return out + [W4GemvConfig(bn, bk, s, w, 3) for bn, bk, w in tiles for s in splits
                  if group % bk == 0 and (m == 1 or bn <= 128)]


def gemm_candidates(m: int, group: int) -> list[W4GemmConfig]:
    if m <= 64:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        tiles = [(bm, bn, bk, 4, st, s) for bn, bk, st in ((64, 64, 4), (128, 64, 3), (128, 128, 3))
                 for s in (1, 2, 4, 8)]
    else:
        tiles = [(128, 64, 64, 4, 4, 1), (128, 64, 128, 4, 3, 1), (256, 64, 64, 8, 3, 1), (128, 128, 64, 4, 4, 1),
                 (64, 64, 64, 4, 4, 1), (128, 32, 64, 4, 4, 1), (256, 128, 64, 8, 3, 1), (128, 64, 64, 4, 5, 1)]
        if m <= 512:
            tiles += [(64, 128, 64, 4, 4, 2), (128, 128, 64, 8, 3, 2)]
    return [W4GemmConfig(bm, bn, bk, w, st, "reshape", s) for bm, bn, bk, w, st, s in tiles if group % bk == 0]


# ---------------------------------------------------------------------------------------------------------------
# Compiling in parallel


def _compile_worker(jobs: list[tuple]) -> list[str]:
    """In a child process: launch each (shape, M, group, zeros, perm, config) once on random weights of the real
    shape (the same specializations as the timed launches), which compiles it into Triton's on-disk cache."""
    torch.cuda.init()
    errors = []
    for name, m, group, zeros, perm, kind, cfg in jobs:
        n, k, b = SHAPES[name]
        try:
            w = W4(n, k, b, group, zeros, perm, seed=0)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            if kind == "gemm":
                w4a16_gemm_triton(x, *w.args(), config=W4GemmConfig(**cfg))
            else:
                w4a16_gemv_triton(x, *w.args(), config=W4GemvConfig(**cfg))
        except Exception as e:  # noqa: BLE001 (reported; the timed run skips it again)
            errors.append(f"{name} M={m} {cfg}: {type(e).__name__}: {str(e)[:200]}")
    torch.cuda.synchronize()
    return errors


def precompile(jobs: list[tuple], workers: int) -> None:
    """Compiles the distinct kernels of jobs [(shape, M, group, zeros, perm, W4GemvConfig | W4GemmConfig)]."""
    items, seen = [], set()
    for name, m, group, zeros, perm, cfg in jobs:
        n, k, b = SHAPES[name]
        kind = "gemm" if isinstance(cfg, W4GemmConfig) else "gemv"
        k_per_split = -(-(-(-k // cfg.split_k)) // cfg.block_k) * cfg.block_k
        split = -(-k // k_per_split) > 1
        key = (kind, replace(cfg, split_k=1), min(m, 2), n % cfg.block_n == 0, b, zeros, perm, split)
        if key not in seen:
            seen.add(key)
            items.append((name, m, group, zeros, perm, kind, asdict(cfg)))
    compile_in_processes(_compile_worker, items, workers)


# ---------------------------------------------------------------------------------------------------------------
# Steps


def check(name: str, w: W4, label: str, fn, m: int) -> tuple[float, float]:
    """(max abs error, max abs error over the output's largest value) of fn against w4a16_ref."""
    x = torch.randn(m, w.k, device=w.qweight.device, dtype=torch.bfloat16)
    ref = w4a16_ref(x, *w.args()).float()
    y = fn(x).float()
    err = (y - ref).abs().max().item()
    rel = err / ref.abs().max().item()
    status = "ok" if rel <= TOL and not math.isnan(err) else "FAILED"
    print(f"check {name:8s} {label:22s} M={m:4d}: max abs error {err:.3e}, {rel:.2e} of the output's scale "
          f"({status})", flush=True)
    return err, rel


def sweep(name: str, w: W4, copies: list[W4], ms: list[int], prefill: bool, cands=None) -> list[dict]:
    rows = []
    group = w.k // w.scales.shape[0]
    for m in ms:
        x = torch.randn(m, w.k, device="cuda", dtype=torch.bfloat16)
        ref = w4a16_ref(x, *w.args()).float()
        if prefill:
            default = default_gemm_config(m, w.n, w.k, group)
            cands_m = [default] + gemm_candidates(m, group)
            launch = lambda cfg: (lambda: w4a16_gemm_triton(x, *w.args(), config=cfg))  # noqa: E731
        else:
            default = default_gemv_config(m, w.n, w.k, group, sm_count(x.device, NUM_SMS), x.dtype)
            cands_m = [default] + (cands if cands is not None else gemv_candidates(m, w.n, group, w.k))
        timed = []
        for cfg in cands_m:
            try:
                if prefill:
                    y = w4a16_gemm_triton(x, *w.args(), config=cfg)
                else:
                    y = w4a16_gemv_triton(x, *w.args(), config=cfg)
            except Exception as e:  # noqa: BLE001 (a config the compiler refuses: out of resources, ...)
                print(f"  {name} M={m} {cfg.short()}: {type(e).__name__}", flush=True)
                continue
            if ((y.float() - ref).abs().max() / ref.abs().max()).item() > TOL:
                print(f"  {name} M={m} {cfg.short()}: WRONG, skipped", flush=True)
                continue
            if prefill:
                t = bench(launch(cfg)) * 1e6
            else:
                t = time_rotation(lambda i, cfg=cfg: w4a16_gemv_triton(x, *copies[i].args(), config=cfg),
                                  len(copies), 5.0)
            timed.append((t, cfg))
        if not timed:
            continue
        best_t, best = min(timed, key=lambda tc: tc[0])
        top = sorted(timed, key=lambda tc: tc[0])[:4]
        print(f"  {name} M={m} top: " + ", ".join(f"{c.short()} {t:.1f}" for t, c in top), flush=True)
        default_t = next((t for t, c in timed if c == default), float("nan"))
        rows.append(dict(shape=name, m=m, kernel="gemm" if prefill else "gemv", default=default.short(),
                         default_us=default_t, best=best.short(), best_us=best_t, best_cfg=best,
                         all=[(c.short(), t) for t, c in sorted(timed, key=lambda tc: tc[0])]))
        print(f"sweep {name:8s} M={m:5d}: default {default.short()} {default_t:8.1f} us, best {best.short()} "
              f"{best_t:8.1f} us ({default_t / best_t:.2f}x)", flush=True)
    return rows


def one_row_table(rows: list[dict]) -> dict:
    """{shape: {"bf16": W4GemvConfig fields}}: the fastest one-row config of each shape the sweep timed."""
    return {r["shape"]: {"bf16": asdict(r["best_cfg"])} for r in rows
            if r["m"] == 1 and r["kernel"] == "gemv"}


def probe_pdl() -> int:
    """0 if a PDL launch of the pair kernel captured in a CUDA graph between two torch ops replays to the eager
    result (the kernel waits for the op before it; the op after it waits for the kernel), else 1."""
    n, k, b = SHAPES["qkv"]
    w = W4(n, k, b, 128, True, False, seed=3)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    x2, z = torch.empty_like(x), torch.empty(1, n, device="cuda", dtype=torch.bfloat16)

    def run():
        torch.mul(x, 2, out=x2)
        torch.add(w4a16_gemv_triton(x2, *w.args()), 1, out=z)

    try:
        run()
        want = z.clone()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        for _ in range(3):
            z.zero_()
            x.normal_()
            g.replay()
            run_ref = (w4a16_ref(x * 2, *w.args()).float() + 1)
            err = ((z.float() - run_ref).abs().max() / run_ref.abs().max()).item()
            if not err <= TOL:
                print(f"PDL probe: graph replay off by {err:.2e}", flush=True)
                return 1
        del want
    except Exception as e:  # noqa: BLE001 (reported: the caller runs without PDL then)
        print(f"PDL probe failed: {type(e).__name__}: {e}", flush=True)
        return 1
    print(f"PDL probe ok (PDL_SUPPORTED={PDL_SUPPORTED})", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decode-m", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--prefill-m", type=int, nargs="*", default=[16, 64, 256, 1024, 2048, 4096])
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--symmetric", action="store_true", help="no zero points (GPTQ sym, compressed-tensors)")
    p.add_argument("--act-order", action="store_true", help="an input permutation (GPTQ desc_act)")
    p.add_argument("--sweep", action="store_true", help="try candidate configs per shape and M")
    p.add_argument("--sweep-only", action="store_true", help="check, then sweep (no decode, token, prefill)")
    p.add_argument("--sweep-pair", action="store_true", help="sweep the pair kernel at one row before timing")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="sweep these, in order")
    p.add_argument("--table-out", help="sweep: write the fastest one-row config per shape here (JSON)")
    p.add_argument("--table", help="time with the one-row configs of this --table-out file in GEMV_TABLE")
    p.add_argument("--workers", type=int, default=8, help="processes compiling the kernels first")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--probe-pdl", action="store_true", help="only check a PDL launch inside a CUDA graph (exit 1: "
                   "it fails; run with TANDEM_PDL=0)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    if args.probe_pdl:
        return probe_pdl()
    if any(m > GEMV_MAX_M for m in args.decode_m):
        p.error(f"--decode-m: at most GEMV_MAX_M={GEMV_MAX_M}")
    torch.backends.cuda.matmul.allow_tf32 = False
    group = args.group_size
    print(f"{torch.cuda.get_device_name()}: group size {group}, "
          f"{'symmetric' if args.symmetric else 'zero points'}{', act order' if args.act_order else ''}; "
          f"PDL supported: {PDL_SUPPORTED}", flush=True)
    if args.table:
        apply_table(args.table)
    zeros, perm = not args.symmetric, args.act_order

    # 0. compile every kernel the run launches, in parallel
    jobs = []
    for name, (n, k, b) in SHAPES.items():
        for layout, (lz, lp) in LAYOUTS.items():
            jobs += [(name, 1, group, lz, lp, default_gemv_config(1, n, k, group, NUM_SMS)),
                     (name, 1, group, lz, lp, stream_config(n, k, group)),
                     (name, GEMV_MAX_M, group, lz, lp, default_gemv_config(GEMV_MAX_M, n, k, group, NUM_SMS)),
                     (name, GEMV_MAX_M, group, lz, lp, default_gemm_config(GEMV_MAX_M, n, k, group, NUM_SMS)),
                     (name, 300, group, lz, lp, default_gemm_config(300, n, k, group, NUM_SMS))]
        jobs.append((name, 1, group, zeros, perm, replace(default_gemv_config(1, n, k, group, NUM_SMS), pdl=False)))
        if args.sweep_pair:
            jobs += [(name, 1, group, zeros, perm, c) for c in pair_candidates(n, k, group)]
        for m in (args.decode_m if not args.sweep_only else []):
            if m > 1:
                jobs += [(name, m, group, zeros, perm, default_gemv_config(m, n, k, group, NUM_SMS)),
                         (name, m, group, zeros, perm, default_gemm_config(m, n, k, group, NUM_SMS))]
        for m in args.prefill_m:
            jobs.append((name, m, group, zeros, perm, default_gemm_config(m, n, k, group, NUM_SMS)))
    precompile(jobs, args.workers)

    # 1. check, every variant in every layout
    worst = 0.0
    results: dict = {"args": vars(args), "checks": [], "decode": [], "prefill": [], "token_ms": {}, "sweep": []}
    with torch.inference_mode():
        for layout, (lz, lp) in LAYOUTS.items():
            for i, (name, (n, k, b)) in enumerate(SHAPES.items()):
                w = W4(n, k, b, group, lz, lp, seed=i)
                variants = [("gemv/pair (default)", 1, lambda x: w4a16_gemv_triton(x, *w.args())),
                            ("gemv/stream", 1, lambda x: w4a16_gemv_triton(x, *w.args(),
                                                                         config=stream_config(n, k, group))),
                            ("gemv/dot", GEMV_MAX_M, lambda x: w4a16_gemv_triton(x, *w.args())),
                            ("gemm", GEMV_MAX_M, lambda x: w4a16_gemm_triton(x, *w.args())),
                            ("gemm", 300, lambda x: w4a16_gemm_triton(x, *w.args()))]
                for label, m, fn in variants:
                    err, rel = check(name, w, f"{layout} {label}", fn, m)
                    results["checks"].append(dict(layout=layout, shape=name, variant=label, m=m, max_abs=err,
                                                  max_rel=rel))
                    worst = max(worst, rel if not math.isnan(rel) else float("inf"))
                del w
    bad = {c["variant"] for c in results["checks"] if not c["max_rel"] <= TOL}
    if bad == {"gemv/pair (default)"}:  # the rest still times, with the stream kernel as the one-row default
        print("THE PAIR KERNEL DISAGREES WITH THE REFERENCE: timing the stream kernel as the default", flush=True)
        for (n, k), (bf16, other, rows) in list(GEMV_TABLE.items()):
            GEMV_TABLE[(n, k)] = (replace(other, mode="stream"), other, rows)
        args.sweep_pair = False
    elif worst > TOL:
        print("the kernels disagree with the reference: no timing", file=sys.stderr)
        return 1

    weights = {name: W4(n, k, b, group, zeros, perm, seed=i) for i, (name, (n, k, b)) in enumerate(SHAPES.items())}
    if args.sweep_only or args.sweep_pair:
        with torch.inference_mode():
            for name in args.shapes:
                w = weights[name]
                copies = [w] + [w.copy() for _ in range(max(1, math.ceil(ROTATION_BYTES / w.bytes(0)) - 1))]
                if args.sweep_pair:
                    cands = pair_candidates(w.n, w.k, group)
                    results["sweep"] += sweep(name, w, copies, [1], prefill=False, cands=cands)
                else:
                    results["sweep"] += sweep(name, w, copies, args.decode_m, prefill=False)
                    results["sweep"] += sweep(name, w, copies, args.prefill_m, prefill=True)
                del copies
                torch.cuda.empty_cache()
        table = one_row_table(results["sweep"])
        print("one-row table:", json.dumps(table), flush=True)
        if args.table_out:  # and beside it the same without PDL, and the stream kernel as it was (bench/latency.py)
            out = Path(args.table_out)
            out.write_text(json.dumps(table))
            out.with_name(out.stem + "_nopdl.json").write_text(json.dumps(
                {name: {"bf16": dict(e["bf16"], pdl=False)} for name, e in table.items()}))
            out.with_name(out.stem + "_stream.json").write_text(json.dumps(
                {name: {"bf16": asdict(stream_config(n, k, group))} for name, (n, k, _) in SHAPES.items()}))
        if args.sweep_only:
            if args.json:
                write_json(args.json, results)
            return 0
        tmp = Path(args.table_out or "/tmp/w4a16_table.json")
        tmp.write_text(json.dumps(table))
        apply_table(str(tmp))

    with torch.inference_mode():
        # 2. decode
        print("\ndecode (us per launch, CUDA graph, weights rotated past the L2)", flush=True)
        for name, w in weights.items():
            copies = [w] + [w.copy() for _ in range(max(1, math.ceil(ROTATION_BYTES / w.bytes(0)) - 1))]
            g = torch.Generator(device="cuda").manual_seed(7)
            bf16 = [torch.randn(w.n, w.k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
                    for _ in range(max(2, math.ceil(ROTATION_BYTES / (2 * w.n * w.k)) + 1))]
            default1 = default_gemv_config(1, w.n, w.k, group, NUM_SMS)
            for m in args.decode_m:
                x = torch.randn(m, w.k, device="cuda", dtype=torch.bfloat16)
                row = dict(shape=name, m=m)
                row["bf16_us"] = time_rotation(lambda i: F.linear(x, bf16[i], w.bias), len(bf16), 10.0)
                row["bf16_linear_us"] = time_rotation(lambda i: gemv.linear(x, bf16[i], w.bias), len(bf16), 10.0)
                if m == 1:
                    variants = {"w4_stream_us": stream_config(w.n, w.k, group), "w4_pair_us": default1,
                                "w4_pair_nopdl_us": replace(default1, pdl=False)}
                    for key, cfg in variants.items():
                        row[key] = time_rotation(lambda i, cfg=cfg: w4a16_gemv_triton(x, *copies[i].args(),
                                                                                      config=cfg), len(copies), 5.0)
                    row["w4_gemv_us"] = row["w4_pair_us"]
                    row["config"] = default1.short()
                    line = (f"W4 stream {row['w4_stream_us']:7.1f}  pair {row['w4_pair_us']:7.1f} "
                            f"(no PDL {row['w4_pair_nopdl_us']:7.1f}) {default1.short()}")
                else:
                    row["w4_gemv_us"] = time_rotation(lambda i: w4a16_gemv_triton(x, *copies[i].args()),
                                                      len(copies), 5.0)
                    row["w4_gemm_us"] = time_rotation(lambda i: w4a16_gemm_triton(x, *copies[i].args()),
                                                      len(copies), 5.0)
                    line = f"W4 gemv {row['w4_gemv_us']:7.1f}  W4 gemm {row['w4_gemm_us']:7.1f}"
                best = min(row["w4_gemv_us"], row.get("w4_gemm_us", math.inf))
                row["w4_gemv_tbs"] = w.bytes(m) / row["w4_gemv_us"] / 1e6
                row["speedup"] = row["bf16_linear_us"] / best
                results["decode"].append(row)
                print(f"{name:8s} M={m:3d}  bf16 {row['bf16_us']:7.1f}  bf16 linear() {row['bf16_linear_us']:7.1f}  "
                      f"{line}  {row['w4_gemv_tbs']:.2f} TB/s  {row['speedup']:.2f}x", flush=True)
            del bf16, copies
            torch.cuda.empty_cache()

        # 3. one decode token's linears at M = 1
        layers = [{name: (W4(n, k, b, group, zeros, perm, seed=100 + 4 * i + j),
                          torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
                   for j, (name, (n, k, b)) in enumerate(SHAPES.items())} for i in range(NUM_LAYERS)]
        xs = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _, k, _ in SHAPES.values()}
        streams = {name: stream_config(n, k, group) for name, (n, k, _) in SHAPES.items()}

        def token(kind: str):
            def go():
                for lw in layers:
                    for name, (w, wb) in lw.items():
                        x = xs[w.k]
                        if kind == "bf16":
                            gemv.linear(x, wb, w.bias)
                        elif kind == "w4_stream":
                            w4a16_gemv_triton(x, *w.args(), config=streams[name])
                        else:
                            w4a16_triton(x, *w.args())
            return go

        for kind in ("bf16", "w4_stream", "w4"):
            results["token_ms"][kind] = graph_ms(token(kind))
        print(f"\none token's linears at M=1 ({NUM_LAYERS} layers, one graph): bf16 linear() "
              f"{results['token_ms']['bf16']:.3f} ms, W4 stream {results['token_ms']['w4_stream']:.3f} ms, "
              f"W4 default {results['token_ms']['w4']:.3f} ms", flush=True)
        del layers, xs
        torch.cuda.empty_cache()

        # 4. prefill
        if args.prefill_m:
            print("\nprefill (us, do_bench)", flush=True)
        for name, w in weights.items():
            if not args.prefill_m:
                break
            wb = dequantize_bf16(w)
            for m in args.prefill_m:
                x = torch.randn(m, w.k, device="cuda", dtype=torch.bfloat16)
                xp = x if w.perm is None else x[:, w.perm.long()]
                row = dict(shape=name, m=m)
                row["bf16_us"] = bench(lambda: F.linear(xp, wb, w.bias)) * 1e6
                row["w4_gemm_us"] = bench(lambda: w4a16_gemm_triton(x, *w.args())) * 1e6
                row["dequant_us"] = bench(lambda: dequantize_bf16(w)) * 1e6
                row["dequant_cublas_us"] = row["dequant_us"] + row["bf16_us"]
                row["w4_tflops"] = 2 * m * w.n * w.k / row["w4_gemm_us"] / 1e6
                row["speedup"] = row["bf16_us"] / row["w4_gemm_us"]
                results["prefill"].append(row)
                print(f"{name:8s} M={m:5d}  bf16 {row['bf16_us']:8.1f}  W4 gemm {row['w4_gemm_us']:8.1f} "
                      f"({row['w4_tflops']:.0f} TFLOP/s)  dequant {row['dequant_us']:7.1f} + cuBLAS = "
                      f"{row['dequant_cublas_us']:8.1f}  {row['speedup']:.2f}x", flush=True)
            del wb
            torch.cuda.empty_cache()

        if args.sweep:
            print("\nsweep", flush=True)
            for name, w in weights.items():
                copies = [w] + [w.copy() for _ in range(max(1, math.ceil(ROTATION_BYTES / w.bytes(0)) - 1))]
                results["sweep"] += sweep(name, w, copies, args.decode_m, prefill=False)
                results["sweep"] += sweep(name, w, copies, args.prefill_m, prefill=True)
                del copies
                torch.cuda.empty_cache()

    # one layer's four linears
    rows = []
    for phase, key in (("decode", "w4_gemv_us"), ("prefill", "w4_gemm_us")):
        for m in (args.decode_m if phase == "decode" else args.prefill_m):
            sel = [r for r in results[phase] if r["m"] == m]
            base = sum(r["bf16_linear_us" if phase == "decode" else "bf16_us"] for r in sel)
            w4 = sum(min(r[key], r.get("w4_gemm_us", r[key])) for r in sel)
            rows.append([phase, m, base, w4, base / w4])
    print("\none layer's four linears (us)\n" + format_table(["phase", "M", "bf16", "W4", "speedup"], rows))
    t = results["token_ms"]
    print(f"one token's linears (ms): bf16 {t['bf16']:.3f}, W4 stream {t['w4_stream']:.3f} "
          f"({t['bf16'] / t['w4_stream']:.2f}x), W4 default {t['w4']:.3f} ({t['bf16'] / t['w4']:.2f}x)")
    if args.json:
        for r in results["sweep"]:
            r.pop("best_cfg", None)
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
