"""Paged attention's launch configurations at one model's shapes: decodes and prefills, fp8 and bf16 caches (issue 19).

  python3 bench/attn_sweep.py [--num-heads 32 --num-kv-heads 8 --head-dim 128 --block-size 16] [--kv fp8 bf16]
                              [--decode 980x174 800x1100 512x1500 256x640] [--prefill 4x2048 64x128]
                              [--max-model-len 2048] [--max-configs 40] [--budget 200] [--workers 16]
                              [--json out.json]
  TRITON_INTERPRET=1 python3 bench/attn_sweep.py --smoke  # on the CPU: tiny shapes, a handful of configs

The defaults are Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128, block 16, bf16 queries) on
TensorRT-LLM's workloads. Caches in the engine's layout ([blocks, --num-layers, 2, block_size, kv_heads, head_dim],
layer 1 read, block tables permuted), filled by the engine's write path (write_kv_triton: fp8 stores x / scale).
A decode case BxC: B sequences, one query each, contexts uniform in C +-20%, the launch sized for --max-model-len
keys as the decode CUDA graphs are. A prefill case NxL: N prompts of L tokens, the whole prompt this step, causal,
its keys written to the cache first and also passed as k/v (as the model does; new_kv picks the source, bf16 only).

0. Every distinct kernel is compiled first, in --workers processes (bench/common.compile_in_processes).
1. Per case and cache: the default config, then the grid (sorted nearest the default first, at most --max-configs),
   each checked once against paged_attention_ref (float32; relative error above TOL: WRONG, not timed, exit 1).
2. Timed: triton.testing.do_bench median, L2 cleared (bench/int8_attn_sweep.time_us), of one launch (one layer);
   --budget seconds of timing shared out over the (case, cache) groups; rows past a group's share are checked only.
Decode rows give the KV bytes of the sequences' keys and values over the time (TB/s); prefill rows causal FLOPs
(4 * heads * head_dim * L (L + 1) / 2 per prompt) over the time (TFLOP/s). Ends with the winners as Python.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import compile_in_processes, format_table, write_json  # noqa: E402
from bench.int8_attn_sweep import DTYPES, compiled, label, launch_checked, path, time_us  # noqa: E402
from kernels._checks import interpreting, sm_count  # noqa: E402
from kernels.kv_write import write_kv_triton  # noqa: E402
from kernels.paged_attention import (PREFILL_CANDIDATES, default_config, paged_attention_ref,  # noqa: E402
                                     paged_attention_triton)

KV_SCALE = 1 / 64  # the fp8 cache's k_scale / v_scale: stored x / scale, |x| up to ~6 stays below 448
REF_ELEMENTS = 1 << 28  # float32 elements the reference may hold per chunk of sequences


def parse_case(text: str) -> tuple[int, int]:
    try:
        n, length = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NxLEN, e.g. 980x174") from None
    if n < 1 or length < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: both numbers must be >= 1")
    return n, length


def seq_lens_for(kind: str, n: int, length: int, seed: int = 0) -> list[int]:
    """Decode: contexts uniform in length +-20% (n = 1: exactly length); prefill: every prompt length tokens."""
    if kind == "prefill" or n == 1:
        return [length] * n
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(int(0.8 * length), int(1.2 * length) + 1, (n,), generator=gen).tolist()


def build(shape: dict, kind: str, kv: str, seq_lens: list[int], max_seq_len: int, device: str,
          seed: int = 0) -> dict:
    """paged_attention's arguments over one layer of an engine-layout cache of kv (bf16 / fp8), every sequence's
    keys written by write_kv_triton; prefill: each sequence's queries are its whole prompt, and k/v are given."""
    h, hkv, d, bs, layers = shape["h"], shape["hkv"], shape["d"], shape["bs"], shape["layers"]
    gen = torch.Generator(device=device).manual_seed(seed)
    nblk = [math.ceil(sl / bs) for sl in seq_lens]
    num_blocks = sum(nblk) + 1
    cache = torch.zeros(num_blocks, layers, 2, bs, hkv, d, dtype=DTYPES[kv], device=device)
    layer = min(1, layers - 1)
    kc, vc = cache[:, layer, 0], cache[:, layer, 1]
    perm = torch.randperm(num_blocks, device=device, generator=gen)
    width = max(max(nblk), math.ceil(max_seq_len / bs))
    bt = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=device)
    slots, used = [], 0
    for i, (sl, n) in enumerate(zip(seq_lens, nblk)):
        bt[i, :n] = perm[used:used + n]
        used += n
        pos = torch.arange(sl, device=device)
        slots.append(bt[i, pos // bs].long() * bs + pos % bs)
    slot_mapping = torch.cat(slots)  # [sum(seq_lens)]
    t_all = slot_mapping.shape[0]
    k, v = (torch.randn(t_all, hkv, d, device=device, generator=gen, dtype=torch.bfloat16)
            * torch.rand(t_all, hkv, 1, device=device, generator=gen, dtype=torch.bfloat16)  # rows of different ranges
            for _ in range(2))
    scale = KV_SCALE if kv == "fp8" else 1.0
    write_kv_triton(k, v, kc, vc, slot_mapping, scale, scale)
    b = len(seq_lens)
    q_lens = seq_lens if kind == "prefill" else [1] * b
    qsl = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device=device)
    q = torch.randn(int(qsl[-1]), h, d, device=device, generator=gen).to(torch.bfloat16)
    args = dict(q=q, k_cache=kc, v_cache=vc, block_tables=bt,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), query_start_loc=qsl,
                max_query_len=max(q_lens), max_seq_len=max_seq_len, scale=d ** -0.5, k_scale=scale, v_scale=scale)
    if kind == "prefill":  # the step's keys are the whole prompts: all the written rows, in token order
        args.update(k=k, v=v)
    else:
        del k, v
    return args


def reference(args: dict) -> torch.Tensor:
    """paged_attention_ref over chunks of sequences (the float32 copies of a whole 800 x 2048-key batch would not
    fit): [num_tokens, num_heads, head_dim] in q's dtype."""
    q, qsl = args["q"], args["query_start_loc"].tolist()
    h, d = q.shape[1:]
    num_seqs, mq, ms = len(qsl) - 1, args["max_query_len"], args["max_seq_len"]
    per_seq = h * ms * max(d, mq) * 3
    chunk = max(1, REF_ELEMENTS // per_seq)
    outs = []
    for i in range(0, num_seqs, chunk):
        j = min(num_seqs, i + chunk)
        part = dict(q=q[qsl[i]:qsl[j]], k_cache=args["k_cache"], v_cache=args["v_cache"],
                    block_tables=args["block_tables"][i:j], seq_lens=args["seq_lens"][i:j],
                    query_start_loc=args["query_start_loc"][i:j + 1] - qsl[i], max_query_len=mq, max_seq_len=ms,
                    scale=args["scale"], k_scale=args["k_scale"], v_scale=args["v_scale"])
        outs.append(paged_attention_ref(**part))
    return torch.cat(outs)


def resolve(shape: dict, kind: str, kv: str, n: int, num_tokens: int, max_query_len: int, max_seq_len: int,
            num_sms: int, override: dict) -> dict:
    """The full launch config for the case with override, normalized to what the launch uses (so configs that
    launch the same kernel compare equal): new_kv only for a bf16 prefill, fp8x4 only for an fp8 cache."""
    h, hkv, d = shape["h"], shape["hkv"], shape["d"]
    cfg = {**default_config(num_tokens, n, hkv, h // hkv, d, max_query_len, max_seq_len, num_sms, 2, kv == "fp8"),
           **override}
    if kv != "fp8":
        cfg.update(fp8x4=0, fp8_via_fp16=1)
    if kind == "decode" or kv == "fp8" or cfg["num_segments"] > 1:
        cfg["new_kv"] = 0
    return cfg


def ordered(grid: list[dict], default: dict) -> list[dict]:
    """The grid, nearest the default first (fewest keys changed), ties in the grid's order (preferred values
    first): a local search around the default, so a truncated list keeps the likely winners."""
    return sorted(grid, key=lambda o: sum(default.get(k) != v for k, v in o.items()))


def candidates(kind: str, kv: str, n: int, hkv: int, num_sms: int, default: dict, smoke: bool) -> list[dict]:
    """The overrides tried for one (case, cache), {} (the default) first."""
    if smoke:
        if kind == "decode":
            return [{}, dict(tile_n=16, num_warps=2, num_stages=1), dict(tile_n=32, num_segments=2),
                    dict(fp8x4=0 if default["fp8x4"] else 2)]
        return [{}, dict(block_m=16, tile_n=32, num_warps=4, num_stages=3), dict(new_kv=1),
                dict(block_m=32, tile_n=16, maxnreg=128)]
    if kind == "decode":
        segments = (1, 2, 4) if n * hkv < 4 * num_sms else (1,)  # split only where programs are few per SM
        grid = [dict(tile_n=t, num_warps=w, num_stages=s, num_segments=g, **({"fp8x4": x} if kv == "fp8" else {}))
                for x in (2, 0) for t in (128, 64, 32, 16) for w in (4, 8, 2) for s in (2, 3, 4, 1)
                for g in segments
                if not (t == 16 and w == 8) and not (t == 128 and w == 2)]
        return [{}] + ordered(grid, default)
    grid = [dict(block_m=m, tile_n=t, num_warps=w, num_stages=s, maxnreg=r, new_kv=nk)
            for nk in ((0, 2) if kv == "bf16" else (0,)) for m in (128, 64) for t in (64, 32, 128) for w in (8, 4)
            for s in (2, 3, 4) for r in (0, 128, 168)]
    return [{}] + PREFILL_CANDIDATES + ordered(grid, default)


def plan(a: argparse.Namespace, shape: dict, device: str) -> list[dict]:
    """One entry per (case, cache): its sequence lengths and the (override, full config) list, deduplicated."""
    num_sms = sm_count(torch.device(device), 4)
    groups = []
    cases = [("decode", n, c) for n, c in a.decode] + [("prefill", n, c) for n, c in a.prefill]
    for kind, n, length in cases:
        seq_lens = seq_lens_for(kind, n, length)
        if kind == "decode":
            num_tokens, mq, ms = n, 1, max(a.max_model_len, max(seq_lens))
        else:
            num_tokens, mq, ms = n * length, length, length
        for kv in a.kv:
            default = resolve(shape, kind, kv, n, num_tokens, mq, ms, num_sms, {})
            seen, cands = set(), []
            for o in candidates(kind, kv, n, shape["hkv"], num_sms, default, a.smoke):
                full = resolve(shape, kind, kv, n, num_tokens, mq, ms, num_sms, o)
                key = tuple(sorted(full.items()))
                if key not in seen:
                    seen.add(key)
                    cands.append((o, full))
            groups.append(dict(kind=kind, case=f"{n}x{length}", n=n, kv=kv, seq_lens=seq_lens, max_seq_len=ms,
                               cands=cands[:a.max_configs + 1]))
    return groups


def _compile_worker(jobs: list[tuple]) -> list[str]:
    """In a child process: launch each (shape, kind, kv, n, length, max_seq_len, config) once on a stand-in of the
    same specialization (the case's sequence count and block-table width; decode contexts of one block)."""
    torch.cuda.init()
    errors, built = [], {}
    for shape, kind, kv, n, length, ms, cfg in jobs:
        key = (kind, kv, n, length, ms)
        if key not in built:
            sl = [length] * n if kind == "prefill" else [shape["bs"]] * n
            built[key] = build(shape, kind, kv, sl, ms, "cuda", seed=1)
        try:
            paged_attention_triton(**built[key], config=cfg)
        except Exception as e:  # noqa: BLE001 (reported; the timed run meets it again)
            errors.append(f"{kind} {kv} {cfg}: {type(e).__name__}: {str(e)[:200]}")
    torch.cuda.synchronize()
    return errors


def metric(kind: str, shape: dict, kv: str, seq_lens: list[int], us: float) -> float:
    """Decode: TB/s of the sequences' K and V bytes; prefill: causal TFLOP/s."""
    if kind == "decode":
        return sum(seq_lens) * shape["hkv"] * shape["d"] * 2 * DTYPES[kv].itemsize / (us * 1e-6) / 1e12
    flops = sum(4 * shape["h"] * shape["d"] * sl * (sl + 1) / 2 for sl in seq_lens)
    return flops / (us * 1e-6) / 1e12


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-heads", type=int, default=32, help="query heads")
    p.add_argument("--num-kv-heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128, help="head size")
    p.add_argument("--block-size", type=int, default=16, help="the cache's tokens per block")
    p.add_argument("--num-layers", type=int, default=8,
                   help="layers in the cache tensor (its strides; Llama-3-8B's 32 would take 116 GB at 800x1100 bf16)")
    p.add_argument("--kv", nargs="+", choices=["fp8", "bf16"], default=["fp8", "bf16"], help="cache dtypes")
    p.add_argument("--decode", nargs="*", type=parse_case, default=[(980, 174), (800, 1100), (512, 1500), (256, 640)],
                   help="decode cases BATCHxCONTEXT (contexts uniform +-20%%)")
    p.add_argument("--prefill", nargs="*", type=parse_case, default=[(4, 2048), (64, 128)],
                   help="prefill cases NxLEN (N whole prompts of LEN tokens in one launch)")
    p.add_argument("--max-model-len", type=int, default=2048, help="decode launches are sized for this many keys")
    p.add_argument("--max-configs", type=int, default=40, help="grid configs per (case, cache) after the default")
    p.add_argument("--budget", type=float, default=200.0, help="seconds of timing (after compiling), then check only")
    p.add_argument("--workers", type=int, default=16, help="processes compiling the kernels first")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--json", help="write the rows and the run's metadata here")
    a = p.parse_args(argv)
    if a.smoke:
        if not interpreting():
            p.error("--smoke runs under TRITON_INTERPRET=1 (on the CPU)")
        device = "cpu"
        a.num_heads, a.num_kv_heads, a.head_dim, a.block_size, a.num_layers = 4, 2, 64, 16, 2
        a.decode, a.prefill, a.max_model_len = [(2, 24)], [(2, 16)], 40
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA device (or --smoke under TRITON_INTERPRET=1)", file=sys.stderr)
            return 2
        device = "cuda"
    shape = dict(h=a.num_heads, hkv=a.num_kv_heads, d=a.head_dim, bs=a.block_size, layers=a.num_layers)
    t_start = time.time()
    groups = plan(a, shape, device)
    print(f"{sum(len(g['cands']) for g in groups)} rows in {len(groups)} (case, cache) groups", flush=True)
    if not a.smoke:
        jobs = {}
        for g in groups:  # one compile per specialization: decodes share kernels across contexts
            length = int(g["case"].split("x")[1]) if g["kind"] == "prefill" else 0
            for _, full in g["cands"]:
                key = (g["kind"], g["kv"], g["n"] % 16 == 0, g["n"] == 1, length, tuple(sorted(full.items())))
                jobs.setdefault(key, (shape, g["kind"], g["kv"], g["n"], length, g["max_seq_len"], full))
        compile_in_processes(_compile_worker, list(jobs.values()), a.workers)

    rows, wrong, t_timing = [], 0, time.time()
    unit = {"decode": "TB/s", "prefill": "TFLOP/s"}
    print(f"{'case':16s} {'cache':5s} {'config':64s} {'path':8s} {'us':>8s} {'rate':>8s} {'rel err':>8s}", flush=True)
    for gi, g in enumerate(groups):
        share = (a.budget - (time.time() - t_timing)) / (len(groups) - gi)
        t_group = time.time()
        name = f"{g['kind']} {g['case']}"
        args = build(shape, g["kind"], g["kv"], g["seq_lens"], g["max_seq_len"], device)
        ref = reference(args).float()
        for override, full in g["cands"]:
            lab = label(override, full)
            try:
                out, err, ok = launch_checked(args, ref, full)
            except Exception as e:  # noqa: BLE001 (an out-of-resources config is a data point)
                print(f"{name:16s} {g['kv']:5s} {lab:64s} {type(e).__name__}: {str(e)[:80]}", flush=True)
                continue
            walk = path()
            wrong += not ok
            us = float("nan")
            if ok and (not override or time.time() - t_group < share):
                us = time_us(lambda: paged_attention_triton(**args, out=out, config=full), a.smoke)
            rate = metric(g["kind"], shape, g["kv"], g["seq_lens"], us)
            rows.append(dict(kind=g["kind"], case=g["case"], cache=g["kv"], config=lab, override=override,
                             full_config=full, path=walk, us=us, rate=rate, unit=unit[g["kind"]], rel_err=err, ok=ok,
                             regs_spills=compiled()))
            print(f"{name:16s} {g['kv']:5s} {lab:64s} {walk:8s} {us:8.1f} {rate:8.2f} {err:8.1e}"
                  f"{'' if ok else '  WRONG'}", flush=True)
        del args, ref
        if device == "cuda":
            torch.cuda.empty_cache()

    print()
    table, winners = [], []
    for g in groups:
        mine = [r for r in rows if (r["kind"], r["case"], r["cache"]) == (g["kind"], g["case"], g["kv"])
                and r["ok"] and r["us"] == r["us"]]
        if not mine:
            continue
        best = min(mine, key=lambda r: r["us"])
        dflt = next((r for r in mine if r["config"] == "default"), None)
        d_us = dflt["us"] if dflt else float("nan")
        table.append([g["kind"], g["case"], g["kv"], round(d_us, 1), round(best["us"], 1), f"{d_us / best['us']:.3f}x",
                      f"{best['rate']:.2f} {best['unit']}", best["config"], best["regs_spills"]])
        winners.append((g, best))
    print(format_table(["kind", "case", "cache", "default us", "best us", "speedup", "best rate", "best config",
                        "regs/spills"], table))
    print("\nsummary: winning configs per case (full configs for paged_attention_triton's config=)")
    print("WINNERS = {")
    for g, best in winners:
        print(f"    ({g['kind']!r}, {g['case']!r}, {g['kv']!r}): {best['full_config']!r},  # {best['us']:.1f} us")
    print("}")
    print(f"done in {time.time() - t_start:.0f} s{'' if not wrong else f'; {wrong} rows WRONG'}", flush=True)
    if a.json:
        write_json(a.json, {"args": vars(a), "shape": shape, "rows": rows})
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
