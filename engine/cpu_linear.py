"""Linears of a float32 model on the CPU through oneDNN over weights packed once at load, for products of few rows
(decode steps, the logits), as vLLM's CPU build does (`create_onednn_mm` at load, `onednn_mm` per step).

torch's F.linear runs MKL's sgemm on the weight as stored. On one AVX2 core at SmolLM2's shapes (bench/RESULTS.md,
"CPU: Tandem beside vLLM"), oneDNN's packed layout took a decode step at batch 16 from 288 to 258 ms (p50, the two
alternating in one process) and the tied lm_head (49152 x 576) from 36-41 to 20-22 ms of CPU time; a prefill step
of 1,024 tokens was ~15% slower packed. So a PackedLinear keeps both: products of up to PACK_MAX_ROWS rows take the
packed weight, larger ones F.linear. Applied from outside the model, after it is loaded and fused: every
engine.model.Linear of the decoder layers becomes one while their weights total at most PACK_MAX_BYTES (the packed
copy doubles them), and the lm_head always (its products are the sampled rows only: always few). A tied lm_head
gets a packed copy of the embedding, which keeps its own rows for the lookup.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import Linear

PACK_BATCH = 32  # the batch oneDNN chooses the packed layout for (vLLM's CPU build: 32); any batch runs on it
PACK_MAX_ROWS = 64  # products of more rows (prompt chunks) take F.linear
PACK_MAX_BYTES = 2 << 30  # decoder linears are packed (held twice) while their weights total at most this


def packing_ok(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, keep_weight: bool = True):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH))
        # (None for the lm_head: it only ever multiplies the sampled rows)
        self.weight = weight if keep_weight else None
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in_features] -> [rows, out_features]
        if self.weight is None or x.shape[0] <= PACK_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


@torch.no_grad()
def pack_linears(model: nn.Module) -> int:
    """Packs a loaded, fused model's decoder linears (within PACK_MAX_BYTES) and its lm_head (or the tied
    embedding's copy); returns how many linears were packed."""
    layers = [(name, m) for name, m in model.model.layers.named_modules() if type(m) is Linear]
    packed = 0
    if sum(m.weight.nbytes for _, m in layers) <= PACK_MAX_BYTES:
        for name, m in layers:
            parent, _, attr = name.rpartition(".")
            setattr(model.model.layers.get_submodule(parent), attr, PackedLinear(m.weight, m.bias))
        packed = len(layers)
    head = model.lm_head
    if head is None and getattr(model, "tie_word_embeddings", False):
        model.lm_head = PackedLinear(model.model.embed_tokens.weight, None, keep_weight=False)
    elif type(head) is Linear:
        model.lm_head = PackedLinear(head.weight, head.bias, keep_weight=False)
    else:
        return packed
    return packed + 1
