"""4-bit weights (kernels/w4a16.py, engine/quant_w4.py's W4Linear) against bf16 at Qwen2.5-7B's linear shapes.

  python3 bench/w4a16_gemm.py [--decode-m 1 2 4 8 16] [--prefill-m 16 64 256 1024 2048 4096] [--group-size 128]
                              [--symmetric] [--act-order] [--sweep] [--json out.json]

Shapes (N x K, the fused projections the engine runs): qkv 4608 x 3584 (with Qwen2's bias), o 3584 x 3584,
gate_up 37888 x 3584, down 3584 x 18944. The 4-bit weights are random (AWQ-like by default: zero points, groups of
128 inputs, fp16 scales; --symmetric drops the zero points as GPTQ sym does, --act-order adds an input permutation).

1. Check first: at each shape the GEMV (M = 1, 16) and the GEMM (M = 16, 300), with the configs about to be timed,
   against w4a16_ref (float32); any error above bf16's tolerance stops the run (exit status 1) before any timing.
2. Decode, M = --decode-m (<= 16): microseconds per launch inside one CUDA graph of back-to-back launches, each on
   the next of enough weight copies that none is found in the 50 MB L2 (bench/gemv.py's time_rotation, as the decode
   graph runs them): bf16 F.linear (cuBLAS), bf16 kernels.gemv.linear (the engine's bf16 path), the W4 GEMV and the
   W4 GEMM at default configs. TB/s counts the bytes the W4 GEMV must move (packed weight, scales, zero points, x, y).
3. One decode token's linears at M = 1 as one graph: 28 layers of the four linears on distinct weights, bf16
   linear() against W4 (what W4Linear runs), in ms.
4. Prefill, M = --prefill-m: triton.testing.do_bench medians (L2 cleared before each run) of bf16 F.linear, the W4
   GEMM, and dequantizing to bf16 in torch then F.linear (vLLM's AWQ path from 256 tokens on; the dequantization
   alone too): where dequant + cuBLAS beats the GEMM, the GEMM's configs (or a dequant kernel) have work to do.
   The closing table sums the four linears per M: bf16 against W4, decode and prefill.
--sweep: for each shape, each decode M and each prefill M, a short list of candidate configs, each checked against
the reference and then timed; prints the best per (shape, M) next to the default's time (each GEMV candidate
compiles once per power of two of M, each GEMM candidate once: several minutes; pass fewer M to shorten it).
Needs a CUDA device. Results: bench/RESULTS.md (the JSON with --json).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import format_table, write_json  # noqa: E402
from bench.gemv import graph_ms, time_rotation  # noqa: E402
import kernels.gemv as gemv  # noqa: E402
from kernels._checks import sm_count  # noqa: E402
import kernels.w4a16 as w4mod  # noqa: E402
from kernels.w4a16 import (GEMV_MAX_M, PACK, W4GemmConfig, W4GemvConfig, default_gemm_config,  # noqa: E402
                           default_gemv_config, w4a16_gemm_triton, w4a16_gemv_triton, w4a16_ref, w4a16_triton)

STREAM_MAX_M = getattr(w4mod, "STREAM_MAX_M", 0)  # 0: a kernels/w4a16.py from before the stream kernel
SHAPES = {"qkv": (4608, 3584, True), "o": (3584, 3584, False), "gate_up": (37888, 3584, False),
          "down": (3584, 18944, False)}  # name: (N, K, bias)
NUM_LAYERS = 28
ROTATION_BYTES = 256e6  # bytes of other weight copies read between two uses of one copy (>> the 50 MB L2)
TOL = 1.6e-2  # bf16 output, relative to the output's largest value


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


def check(name: str, w: W4, label: str, fn, m: int) -> float:
    x = torch.randn(m, w.k, device=w.qweight.device, dtype=torch.bfloat16)
    ref = w4a16_ref(x, *w.args()).float()
    err = ((fn(x).float() - ref).abs().max() / ref.abs().max()).item()
    status = "ok" if err <= TOL else "FAILED"
    print(f"check {name:8s} {label:5s} M={m:4d}: max error {err:.2e} of the output's scale ({status})", flush=True)
    return err


def _splits(tiles: int, k: int, bk: int) -> list[int]:
    """Split counts that put about 1 to 12 programs per SM (132) with at least one step each."""
    return [sp for sp in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if 100 <= tiles * sp <= 1600 and k // (sp * bk) >= 1]


def gemv_candidates(m: int, n: int, group: int, k: int = 0) -> list[W4GemvConfig]:
    if m <= STREAM_MAX_M:  # the stream kernel; at 2+ rows also the tensor-core path below
        out = []
        tiles = [(64, 128, 2, 1), (64, 128, 4, 1), (64, 64, 2, 1), (128, 128, 2, 1), (128, 128, 4, 1),
                 (128, 64, 4, 1), (128, 128, 8, 1), (256, 128, 4, 1), (256, 128, 8, 1), (256, 64, 4, 1),
                 (256, 128, 4, 2)]
        if m > 1:
            tiles = [(128, 128, 4, 1), (64, 128, 4, 1), (256, 128, 4, 1)]
        for bn, bk, w, st in tiles:
            if group % bk or (bn == 64 and w == 8):
                continue
            out += [W4GemvConfig(bn, bk, sp, w, st, mode="stream") for sp in _splits(-(-n // bn), k, bk)]
        if m == 1:
            return out
    else:
        out = []
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


def sweep(name: str, w: W4, copies: list[W4], ms: list[int], prefill: bool) -> list[dict]:
    rows = []
    for m in ms:
        x = torch.randn(m, w.k, device="cuda", dtype=torch.bfloat16)
        ref = w4a16_ref(x, *w.args()).float()
        if prefill:
            default = default_gemm_config(m, w.n, w.k, w.k // w.scales.shape[0])
            cands = [default] + gemm_candidates(m, w.k // w.scales.shape[0])
            launch = lambda cfg: (lambda: w4a16_gemm_triton(x, *w.args(), config=cfg))  # noqa: E731
        else:
            default = default_gemv_config(m, w.n, w.k, w.k // w.scales.shape[0], sm_count(x.device, 132))
            cands = [default] + gemv_candidates(m, w.n, w.k // w.scales.shape[0], w.k)
        timed = []
        for cfg in cands:
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
                         default_us=default_t, best=best.short(), best_us=best_t, best_cfg=best))
        print(f"sweep {name:8s} M={m:5d}: default {default.short()} {default_t:8.1f} us, best {best.short()} "
              f"{best_t:8.1f} us ({default_t / best_t:.2f}x)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decode-m", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--prefill-m", type=int, nargs="*", default=[16, 64, 256, 1024, 2048, 4096])
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--symmetric", action="store_true", help="no zero points (GPTQ sym, compressed-tensors)")
    p.add_argument("--act-order", action="store_true", help="an input permutation (GPTQ desc_act)")
    p.add_argument("--sweep", action="store_true", help="try candidate configs per shape and M")
    p.add_argument("--sweep-only", action="store_true", help="check, then sweep (no decode, token, prefill)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="sweep these, in order")
    p.add_argument("--table-out", help="sweep: write the fastest one-row config per shape here (JSON)")
    p.add_argument("--table", help="time with the one-row configs of this --table-out file in GEMV_TABLE")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    if any(m > GEMV_MAX_M for m in args.decode_m):
        p.error(f"--decode-m: at most GEMV_MAX_M={GEMV_MAX_M}")
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"{torch.cuda.get_device_name()}: group size {args.group_size}, "
          f"{'symmetric' if args.symmetric else 'zero points'}{', act order' if args.act_order else ''}")
    if args.table:
        import json
        for name, (bn, bk, sp, w, st) in json.loads(Path(args.table).read_text()).items():
            n, k, _ = SHAPES[name]
            w4mod.GEMV_TABLE[(n, k)] = ((bn, bk, sp, w, st), w4mod.GEMV_TABLE[(n, k)][1])
        print("GEMV_TABLE one-row entries from", args.table, {k: v[0] for k, v in w4mod.GEMV_TABLE.items()})
    weights = {name: W4(n, k, b, args.group_size, not args.symmetric, args.act_order, seed=i)
               for i, (name, (n, k, b)) in enumerate(SHAPES.items())}

    # 1. check
    worst = 0.0
    with torch.inference_mode():
        for name, w in weights.items():
            for m in (1, GEMV_MAX_M):
                worst = max(worst, check(name, w, "gemv", lambda x: w4a16_gemv_triton(x, *w.args()), m))
            for m in (GEMV_MAX_M, 300):
                worst = max(worst, check(name, w, "gemm", lambda x: w4a16_gemm_triton(x, *w.args()), m))
    if worst > TOL:
        print("the kernels disagree with the reference: no timing", file=sys.stderr)
        return 1

    results: dict = {"args": vars(args), "decode": [], "prefill": [], "token_ms": {}, "sweep": []}
    if args.sweep_only:
        with torch.inference_mode():
            for name in args.shapes:
                w = weights[name]
                copies = [w] + [w.copy() for _ in range(max(1, math.ceil(ROTATION_BYTES / w.bytes(0)) - 1))]
                results["sweep"] += sweep(name, w, copies, args.decode_m, prefill=False)
                results["sweep"] += sweep(name, w, copies, args.prefill_m, prefill=True)
                del copies
                torch.cuda.empty_cache()
        if args.json:
            write_json(args.json, results)
        if args.table_out:
            import json
            best = {}
            for r in results["sweep"]:
                if r["m"] == 1 and r["kernel"] == "gemv":
                    c = r["best_cfg"]
                    best[r["shape"]] = [c.block_n, c.block_k, c.split_k, c.num_warps, c.num_stages]
            Path(args.table_out).write_text(json.dumps(best))
            print("one-row table:", best)
        return 0
    with torch.inference_mode():
        # 2. decode
        print("\ndecode (us per launch, CUDA graph, weights rotated past the L2)")
        for name, w in weights.items():
            copies = [w] + [w.copy() for _ in range(max(1, math.ceil(ROTATION_BYTES / w.bytes(0)) - 1))]
            g = torch.Generator(device="cuda").manual_seed(7)
            bf16 = [torch.randn(w.n, w.k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
                    for _ in range(max(2, math.ceil(ROTATION_BYTES / (2 * w.n * w.k)) + 1))]
            for m in args.decode_m:
                x = torch.randn(m, w.k, device="cuda", dtype=torch.bfloat16)
                row = dict(shape=name, m=m)
                row["bf16_us"] = time_rotation(lambda i: F.linear(x, bf16[i], w.bias), len(bf16), 10.0)
                row["bf16_linear_us"] = time_rotation(lambda i: gemv.linear(x, bf16[i], w.bias), len(bf16), 10.0)
                row["w4_gemv_us"] = time_rotation(lambda i: w4a16_gemv_triton(x, *copies[i].args()), len(copies),
                                                  5.0)
                row["w4_gemm_us"] = time_rotation(lambda i: w4a16_gemm_triton(x, *copies[i].args()), len(copies),
                                                  5.0)
                row["w4_gemv_tbs"] = w.bytes(m) / row["w4_gemv_us"] / 1e6
                row["speedup"] = row["bf16_linear_us"] / min(row["w4_gemv_us"], row["w4_gemm_us"])
                results["decode"].append(row)
                print(f"{name:8s} M={m:3d}  bf16 {row['bf16_us']:7.1f}  bf16 linear() {row['bf16_linear_us']:7.1f}  "
                      f"W4 gemv {row['w4_gemv_us']:7.1f} ({row['w4_gemv_tbs']:.2f} TB/s)  W4 gemm "
                      f"{row['w4_gemm_us']:7.1f}  {row['speedup']:.2f}x", flush=True)
            del bf16, copies
            torch.cuda.empty_cache()

        # 3. one decode token's linears at M = 1
        layers = [{name: (W4(n, k, b, args.group_size, not args.symmetric, args.act_order, seed=100 + 4 * i + j),
                          torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
                   for j, (name, (n, k, b)) in enumerate(SHAPES.items())} for i in range(NUM_LAYERS)]
        xs = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _, k, _ in SHAPES.values()}

        def token(kind: str):
            def go():
                for lw in layers:
                    for name, (w, wb) in lw.items():
                        x = xs[w.k]
                        if kind == "bf16":
                            gemv.linear(x, wb, w.bias)
                        else:
                            w4a16_triton(x, *w.args())
            return go

        for kind in ("bf16", "w4"):
            results["token_ms"][kind] = graph_ms(token(kind))
        print(f"\none token's linears at M=1 ({NUM_LAYERS} layers, one graph): bf16 linear() "
              f"{results['token_ms']['bf16']:.3f} ms, W4 {results['token_ms']['w4']:.3f} ms", flush=True)
        del layers, xs
        torch.cuda.empty_cache()

        # 4. prefill
        print("\nprefill (us, do_bench)")
        for name, w in weights.items():
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
            print("\nsweep")
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
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
