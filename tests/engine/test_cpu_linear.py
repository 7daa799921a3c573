"""engine/cpu_linear.py: packed linears give F.linear's products (to float32 rounding) at every row count, and
pack_linears packs the decoder's linears and the tied lm_head of a loaded model."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cpu_linear import PACK_MAX_ROWS, PackedLinear, pack_linears, packing_ok
from engine.loader import build_model, resolve_model

pytestmark = pytest.mark.skipif(not packing_ok(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch")


@pytest.mark.parametrize("rows", [1, 16, PACK_MAX_ROWS, PACK_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(96, 40, generator=g), torch.randn(rows, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    torch.testing.assert_close(PackedLinear(w, b)(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(PackedLinear(w, b, keep_weight=False)(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_pack_linears(tied):
    resolved = resolve_model("random:tiny")
    resolved.config.tie_word_embeddings = tied
    model = build_model(resolved, torch.float32, "cpu", None, seed=0)
    hidden = torch.randn(3, model.config.hidden_size)
    before = model.compute_logits(hidden)
    assert pack_linears(model) == 4 * len(model.model.layers) + 1  # qkv, o, gate_up, down; the lm_head
    assert all(isinstance(layer.mlp.down_proj, PackedLinear) for layer in model.model.layers)
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.weight is None
    torch.testing.assert_close(model.compute_logits(hidden), before, atol=1e-4, rtol=1e-5)
