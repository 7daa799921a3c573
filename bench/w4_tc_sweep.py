"""The W4A16 batch GEMMs side by side at Qwen2.5-7B's fused shapes: cuBLAS bf16 (the bar), kernels/w4a16.py's GEMM
(scaled partial sums), kernels/w4a16_tc.py's accumulating GEMM over a sweep of tiles, and dequantize + cuBLAS.

    python3 bench/w4_tc_sweep.py [--m 64 128 256 ...] [--table-out tc_table.json] [--json out.json]

Each candidate is checked against w4a16_ref once (bf16 tolerance), then timed with triton.testing.do_bench (L2
cleared between runs, median). --table-out writes, per shape, the fastest kernel for each M timed (what
kernels/w4a16_tc.py's TC_TABLE holds); --smoke runs tiny shapes under TRITON_INTERPRET=1 to check the script.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import compile_in_processes, format_table, write_json  # noqa: E402
from kernels.w4a16 import default_gemm_config, w4a16_gemm_triton, w4a16_ref  # noqa: E402
from kernels.w4a16_tc import (W4TcConfig, batch_path, w4_dequantize_triton, w4a16_batch_triton,  # noqa: E402
                              w4a16_dequant_mm, w4a16_tc_triton)

SHAPES = {"qkv": (4608, 3584, True), "o": (3584, 3584, False), "gate_up": (37888, 3584, False),
          "down": (3584, 18944, False)}  # name: (N, K, bias)
TOL = 1.6e-2
NUM_SMS = 132

# (block_m, block_n, block_k, warps, stages, swap, unpack)
TILES = [
    (64, 128, 64, 4, 4, True, "reshape"), (64, 128, 128, 4, 3, True, "reshape"),
    (128, 128, 64, 8, 3, True, "reshape"), (128, 128, 64, 8, 4, True, "reshape"),
    (128, 128, 128, 8, 3, True, "reshape"), (256, 128, 64, 8, 3, True, "reshape"),
    (128, 64, 64, 4, 4, True, "reshape"), (64, 64, 64, 4, 4, True, "reshape"), (256, 64, 64, 4, 3, True, "reshape"),
    (128, 256, 64, 8, 3, True, "reshape"), (32, 128, 128, 4, 4, True, "reshape"), (32, 64, 128, 4, 4, True, "reshape"),
    (128, 128, 64, 8, 4, True, "gather"), (64, 128, 64, 4, 4, True, "gather"), (256, 128, 64, 8, 3, True, "gather"),
    (128, 128, 64, 8, 3, False, "reshape"), (128, 64, 64, 4, 4, False, "reshape"),
    (128, 256, 64, 8, 3, False, "reshape"), (64, 128, 64, 4, 4, False, "reshape"),
    (128, 128, 64, 8, 4, False, "gather"),
]


# the paired 16-bit dequantization (W4TcConfig.pairs): (block_m, block_n, block_k, warps, stages, swap)
PAIR_TILES = [
    (128, 128, 64, 8, 3, False), (128, 64, 64, 4, 4, False), (64, 128, 64, 4, 4, False), (128, 256, 64, 8, 3, False),
    (128, 128, 128, 8, 3, False), (256, 128, 64, 8, 3, False), (64, 64, 64, 4, 4, False),
    (128, 128, 64, 8, 3, True), (64, 128, 64, 4, 4, True), (256, 128, 64, 8, 3, True), (128, 64, 64, 4, 4, True),
    (32, 128, 128, 4, 4, True),
]


def split_for(m: int, n: int, k: int, bm: int, bn: int, bk: int, num_sms: int) -> int:
    tiles = -(-m // bm) * -(-n // bn)
    if tiles >= num_sms:
        return 1
    return max(1, min(-(-num_sms // tiles), k // (2 * bk)))


def candidates(m: int, n: int, k: int, group: int, num_sms: int, which: str = "all") -> list[W4TcConfig]:
    tiles = [] if which == "pairs" else [t + (False,) for t in TILES]
    tiles += [t + ("reshape", True) for t in PAIR_TILES]
    out = []
    for bm, bn, bk, w, st, swap, unpack, pairs in tiles:
        if group % bk or (bm > 2 * max(m, 16) and bm > 64):
            continue
        out.append(W4TcConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=st, swap=swap,
                              unpack=unpack, split_k=split_for(m, n, k, bm, bn, bk, num_sms), pairs=pairs))
    return out


class W4:
    def __init__(self, n: int, k: int, bias: bool, group: int, device: str):
        g = torch.Generator(device=device).manual_seed(n + k)
        self.n, self.k = n, k
        self.qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=device, generator=g)
        self.scales = (torch.rand(k // group, n, device=device, generator=g) * 2e-3 + 1e-3).half()
        self.qzeros = torch.randint(0, 16, (k // group, n), device=device, generator=g).to(torch.uint8)
        self.bias = torch.randn(n, device=device, generator=g, dtype=torch.bfloat16) * 0.02 if bias else None

    def args(self):
        return self.qweight, self.scales, self.qzeros, self.bias, None


def bench_us(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def _compile_worker(jobs):
    torch.cuda.init()
    errs = []
    for name, m, group, cfg in jobs:
        n, k, b = SHAPES[name]
        try:
            w = W4(n, k, b, group, "cuda")
            w4a16_tc_triton(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), *w.args(),
                            config=W4TcConfig(**cfg))
        except Exception as e:  # noqa: BLE001 (reported; the timed pass skips it)
            errs.append(f"{name} M={m} {cfg}: {type(e).__name__}: {str(e)[:160]}")
    torch.cuda.synchronize()
    return errs


def precompile(jobs, workers: int) -> None:
    seen, items = set(), []
    for name, m, group, cfg in jobs:
        key = (asdict(cfg) | {"split_k": cfg.split_k > 1}, SHAPES[name][2])
        if str(key) not in seen:
            seen.add(str(key))
            items.append((name, m, group, asdict(cfg)))
    compile_in_processes(_compile_worker, items, workers)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024, 2048, 4096, 8192])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))  # (--smoke: "tiny")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--table-out")
    p.add_argument("--json")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    p.add_argument("--tiles", choices=["all", "pairs"], default="all", help="pairs: only the paired-dequant tiles")
    p.add_argument("--no-sweep", action="store_true", help="time bf16, the old GEMM, dequantize + cuBLAS and the "
                   "engine's batch path (w4a16_batch_triton) only")
    args = p.parse_args(argv)
    if args.smoke:
        SHAPES["tiny"] = (48, 128, True)
        args.shapes, args.m, args.group_size = ["tiny"], [16, 40], 64
    device = "cuda" if torch.cuda.is_available() else "cpu"
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4
    if device == "cuda" and not args.smoke and not args.no_sweep:
        precompile([(s, m, args.group_size, c) for s in args.shapes for m in args.m
                    for c in candidates(m, *SHAPES[s][:2], args.group_size, num_sms, args.tiles)], args.workers)
    rows, table = [], {}
    for name in args.shapes:
        n, k, b = SHAPES[name]
        w = W4(n, k, b, args.group_size, device)
        wt = w4_dequantize_triton(w.qweight, w.scales, w.qzeros, torch.bfloat16)  # [N, K]
        scratch = torch.empty(n, k, dtype=torch.bfloat16, device=device)
        for m in args.m:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ref = w4a16_ref(x, *w.args()).float()
            scale = ref.abs().max().item()

            def ok(y, label):
                rel = ((y.float() - ref).abs().max().item()) / scale
                if not rel <= TOL:
                    print(f"  {name} M={m} {label}: WRONG ({rel:.2e} of the output's scale)", flush=True)
                return rel <= TOL

            timed = {}
            if device == "cuda":
                timed["bf16"] = bench_us(lambda: F.linear(x, wt, w.bias))
            old = default_gemm_config(m, n, k, args.group_size, num_sms)
            if ok(w4a16_gemm_triton(x, *w.args(), config=old), "old"):
                timed["old"] = bench_us(lambda: w4a16_gemm_triton(x, *w.args(), config=old)) if device == "cuda" \
                    else 0.0
            if ok(w4a16_dequant_mm(x, *w.args(), scratch=scratch), "dequant"):
                timed["dequant"] = bench_us(lambda: w4a16_dequant_mm(x, *w.args(), scratch=scratch)) \
                    if device == "cuda" else 0.0
            if ok(w4a16_batch_triton(x, *w.args()), "batch"):
                timed["batch"] = bench_us(lambda: w4a16_batch_triton(x, *w.args())) if device == "cuda" else 0.0
            tc = []
            cands = candidates(m, n, k, args.group_size, num_sms, args.tiles) if not args.smoke else \
                [W4TcConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=1, swap=s, unpack=u, pairs=pr)
                 for s in (True, False) for u in ("reshape", "gather")
                 for pr in (False, True)]
            if args.no_sweep:
                cands = []
            for cfg in cands:
                try:
                    y = w4a16_tc_triton(x, *w.args(), config=cfg)
                except Exception as e:  # noqa: BLE001 (out of resources, ...)
                    print(f"  {name} M={m} {cfg.short()}: {type(e).__name__}", flush=True)
                    continue
                if ok(y, cfg.short()):
                    t = bench_us(lambda cfg=cfg: w4a16_tc_triton(x, *w.args(), config=cfg)) if device == "cuda" \
                        else 0.0
                    tc.append((t, cfg))
            tc.sort(key=lambda tc_: tc_[0])
            if tc:
                timed["tc"] = tc[0][0]
            best_kind = min(timed.items(), key=lambda kv: kv[1] if kv[0] not in ("bf16", "batch") else float("inf"))[0] \
                if len(timed) > 1 else "tc"
            bf = timed.get("bf16", float("nan"))
            row = dict(shape=name, m=m, bf16_us=bf, old_us=timed.get("old"), dequant_us=timed.get("dequant"),
                       batch_us=timed.get("batch"), path=batch_path(m, n, k, args.group_size),
                       tc_us=tc[0][0] if tc else None, tc_best=tc[0][1].short() if tc else None,
                       tc_top=[(c.short(), t) for t, c in tc[:4]], best=best_kind)
            rows.append(row)
            print(f"{name:8s} M={m:5d}: bf16 {bf:8.1f} old {timed.get('old', float('nan')):8.1f} dequant "
                  f"{timed.get('dequant', float('nan')):8.1f} batch {timed.get('batch', float('nan')):8.1f} "
                  f"({row['path']}) tc {row['tc_us'] or float('nan'):8.1f} "
                  f"({row['tc_best']}) -> {best_kind}; top: "
                  + ", ".join(f"{c} {t:.1f}" for c, t in row["tc_top"][1:3]), flush=True)
            entry = {"kind": best_kind if best_kind in ("tc", "dequant") else "tc"}
            if tc:
                entry["config"] = asdict(tc[0][1])
            table.setdefault(f"{n}x{k}", []).append([m, entry])
    cols = ["shape", "m", "bf16_us", "old_us", "dequant_us", "batch_us", "path", "tc_us", "tc_best", "best"]
    print(format_table(cols, [[r[c] for c in cols] for r in rows]))
    if args.table_out:
        Path(args.table_out).write_text(json.dumps(table, indent=1))
    if args.json:
        write_json(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
