"""Compiles the paged-attention launch configurations for sm_90 (H100/H200) on a machine without a GPU and prints
what each costs: registers, spilled bytes, shared memory, and whether the PTX holds wgmma, cp.async and TMA copies.

  python bench/kernel_resources.py     # every prefill candidate (bf16 and fp8 cache), the decode defaults, int8 decodes
  python bench/kernel_resources.py --int8   # the int8 decodes only, in both cache layouts (row, block)

Triton compiles ahead of time for a named target (ptxas ships with it); cuobjdump reads the registers and spills,
and the SASS (instructions, and how many global loads are 16 bytes wide).
The register count decides how many programs share an SM (65536 registers: 8 warps at <= 128 each run two per SM),
which the H200 sweep found to matter most for prefill (docs/kernels.md). No device time needed.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.backends.nvidia as nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.paged_attention import PREFILL_CANDIDATES, _paged_attention_kernel, default_config  # noqa: E402
from kernels.quant_int8 import INT8_LAYOUT  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
QPK, HEAD_DIM, BLOCK_SIZE = 7, 128, 16  # Qwen2.5-7B: 28 query heads over 4 KV heads, head_dim 128


def compile_sm90(cfg: dict, kv: str = "bf16", q: str = "bf16", int8_layout: str = INT8_LAYOUT):
    """The kernel as paged_attention_triton would launch it with cfg (16-byte aligned pointers and strides; kv
    "int8", int8_layout the engine's by default: "row", rows of head_dim + 4 bytes, so the slot and head strides
    are not multiples of 16; "block", 16-byte aligned rows, the scales' slot stride 1,
    kernels/quant_int8.int8_cache_views)."""
    new_kv = cfg.get("new_kv", 0) if kv == q else 0
    words = cfg.get("fp8x4", 0) if kv in ("fp8e4nv", "int8") else 0  # 8-bit caches read as int32 words (PTX: 2)
    const = dict(QUERIES_PER_KV=QPK, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE,
                 BLOCK_M=cfg["block_m"], BLOCK_Q=cfg["block_m"] // QPK, TILE_N=cfg["tile_n"],
                 NUM_SEGMENTS=cfg.get("num_segments", 1), DOT_FP32=q == "fp32",
                 FP8_VIA_FP16=kv in ("fp8e4nv", "int8") and q == "bf16", PRECISION="ieee" if q == "fp32" else "tf32",
                 NEW_KV=new_kv, OPAQUE_ZERO=True, FP8X4=words, INT8=kv == "int8",
                 ALIGN16=(2 if int8_layout == "block" else 1) if kv == "int8" and words > 0
                 and cfg.get("int8_align", 0) else 0)
    cache = "i32" if words else {"int8": "i8"}.get(kv, kv)
    ptr = dict(out_ptr=q, seg_out_ptr="fp32", seg_max_ptr="fp32", seg_sum_ptr="fp32", q_ptr=q, k_new_ptr=q,
               v_new_ptr=q, k_cache_ptr=cache, v_cache_ptr=cache, k_scale_cache_ptr="fp32",
               v_scale_cache_ptr="fp32", block_tables_ptr="i32", seq_lens_ptr="i32", qsl_ptr="i32")
    # int8 rows: 132 bytes at head_dim 128, 4 KV heads: slot stride 528 bytes (132 words), head stride 132 (33)
    unaligned = {f"stride_{t}_{d}" for t in ("kc", "vc", "ks", "vs") for d in ("s", "h")} if kv == "int8" else set()
    if kv == "int8" and int8_layout == "block":  # values [block, slot, head, head_dim], scales [block, head, slot]
        unaligned = set()
        const.update(stride_ks_s=1, stride_vs_s=1)  # Triton specializes a stride of 1
    sig, attrs = {}, {}
    for i, name in enumerate(_paged_attention_kernel.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in ptr:
            sig[name] = "*" + ptr[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("k_desc", "v_desc"):
            if new_kv == 2:
                sig[name] = f"tensordesc<{q}[{cfg['tile_n']}, {HEAD_DIM}]>"
            else:
                sig[name], const[name] = "constexpr", None
        elif name in ("qk_scale", "v_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride") and name != "stride_bt" and name not in unaligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if cfg.get("maxnreg"):
        opts["maxnreg"] = cfg["maxnreg"]
    return triton.compile(ASTSource(fn=_paged_attention_kernel, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)


def report(label: str, cfg: dict, kv: str = "bf16", int8_layout: str = INT8_LAYOUT) -> None:
    c = compile_sm90(cfg, kv, int8_layout=int8_layout)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
    fields = dict(x.split(":", 1) for x in usage.split() if x.startswith(("REG:", "STACK:")))
    ptx = c.asm["ptx"]
    feats = [n for n, k in (("wgmma", "wgmma"), ("cp.async", "cp.async.cg"), ("tma", "cp.async.bulk.tensor"))
             if k in ptx]
    # SASS: instructions in all, and the global loads by width (LDG, or LDGSTS = cp.async; .128 = 16 bytes)
    ins = [ln.split("*/", 1)[1].split(";")[0].split() for ln in sass.splitlines() if ln.lstrip().startswith("/*")
           and "*/" in ln and ln.split("*/", 1)[1].strip()]
    ops = [w[1] if w[0].startswith("@") and len(w) > 1 else w[0] for w in ins if w]
    loads = [o for o in ops if o.startswith(("LDG.", "LDGSTS."))]
    wide = sum(o.endswith(".128") for o in loads)
    kv = kv + ("/" + int8_layout if kv == "int8" else "")
    print(f"{label:10s} kv={kv:10s} {str(cfg):100s} regs {fields.get('REG', '?'):>3s}  spilled "
          f"{fields.get('STACK', '?'):>4s} B  smem {c.metadata.shared:6d} B  sass {len(ops):5d} (global loads "
          f"{wide} x 16 B, {len(loads) - wide} narrower)  {','.join(feats)}", flush=True)


def main(argv: list[str] | None = None) -> None:
    if (argv if argv is not None else sys.argv[1:]) == ["--int8"]:  # the int8 decodes only
        return int8_decodes()
    for cfg in PREFILL_CANDIDATES:
        for kv in ("bf16", "fp8e4nv"):
            report("prefill", cfg, kv)
    report("decode", default_config(64, 64, 4, QPK, HEAD_DIM, 1, 4096, 132))
    report("decode", default_config(64, 64, 4, QPK, HEAD_DIM, 1, 4096, 132, kv_fp8=True), "fp8e4nv")
    big = default_config(256, 256, 4, QPK, HEAD_DIM, 1, 784, 132, kv_fp8=True)  # batch 256: the word walk
    report("decode", big, "fp8e4nv")
    int8_decodes()


def int8_decodes() -> None:
    for layout in ("row", "block"):
        for cfg in (dict(), dict(num_warps=8), dict(int8_align=0), dict(int8_align=1), dict(tile_n=64, int8_align=1),
                    dict(tile_n=64, num_stages=3, int8_align=1), dict(num_warps=8, int8_align=1)):
            report("decode", {**default_config(256, 256, 4, QPK, HEAD_DIM, 1, 784, 132, kv_int8=True), **cfg},
                   "int8", layout)


if __name__ == "__main__":
    main()
