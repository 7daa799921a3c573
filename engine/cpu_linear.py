"""Linears of a float32 model on the CPU through oneDNN over weights packed once at load, for products of few rows
(decode steps, the logits), as vLLM's CPU build does (`create_onednn_mm` at load, `onednn_mm` per step).

torch's F.linear runs MKL's sgemm on the weight as stored. On one AVX2 core at SmolLM2's shapes (bench/RESULTS.md,
"CPU: Tandem beside vLLM"), oneDNN's packed layout took a decode step at batch 16 from 288 to 258 ms (p50, the two
alternating in one process) and the tied lm_head (49152 x 576) from 36-41 to 20-22 ms of CPU time; a prefill step
of 1,024 tokens was ~15% slower packed. On an AMD core with AVX-512 (Zen 4) the packed layout is faster at every row
count, prompt chunks of 2,048 tokens included ("CPU beside vLLM on a Zen 4 host"): oneDNN picks its kernels by the
instruction set, MKL's sgemm by the vendor too, and runs AVX2 code on AMD's AVX-512 cores. So each engine.model.Linear
keeps its weight and gets a packed copy beside it (`packed`, a plain attribute: the module tree, its parameters and
buffers stay as loaded), taken for products of up to pack_max_rows() rows. Applied from outside the model, after it is loaded and fused: the decoder's linears while
their weights total at most PACK_MAX_BYTES (the copy doubles them), and the lm_head; a tied model gets an lm_head
Linear whose weight is the embedding's own Parameter.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.model import Linear

PACK_BATCH = 32  # the batch oneDNN chooses the packed layout for (vLLM's CPU build: 32); any batch runs on it
PACK_MAX_ROWS = 64  # products of more rows (prompt chunks) take F.linear, unless pack_max_rows() says otherwise
PACK_MAX_BYTES = 2 << 30  # decoder linears are packed (held twice) while their weights total at most this


def packing_ok(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def pack_max_rows(vendor: str | None = None, capability: str | None = None) -> int:
    """The most rows a product takes through the packed weight: every product on an AMD CPU whose torch build runs
    AVX-512 kernels (MKL gives such a core its AVX2 code, oneDNN its AVX-512 code), else PACK_MAX_ROWS."""
    vendor = _cpu_vendor() if vendor is None else vendor
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    if vendor == "AuthenticAMD" and capability.startswith("AVX512"):
        return 1 << 62
    return PACK_MAX_ROWS


def pack(linear: Linear, max_rows: int | None = None) -> None:
    linear.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_BATCH)
    linear.packed_max_rows = pack_max_rows() if max_rows is None else max_rows


@torch.no_grad()
def pack_linears(model: nn.Module) -> int:
    """Packs a loaded, fused model's decoder linears (within PACK_MAX_BYTES) and its lm_head; returns how many."""
    layers = [m for m in model.model.layers.modules() if type(m) is Linear and m.weight.dtype == torch.float32]
    packed = 0
    if sum(m.weight.nbytes for m in layers) <= PACK_MAX_BYTES:
        for m in layers:
            pack(m)
        packed = len(layers)
    if model.lm_head is None and getattr(model, "tie_word_embeddings", False):
        embed = model.model.embed_tokens.weight
        head = Linear(embed.shape[1], embed.shape[0], bias=False, device="meta")
        head.weight = embed  # the same Parameter: nothing is copied but the packed layout
        model.lm_head = head
    if type(model.lm_head) is Linear and model.lm_head.weight.dtype == torch.float32:
        pack(model.lm_head, max_rows=1 << 62)  # only ever the sampled rows
        packed += 1
    return packed
