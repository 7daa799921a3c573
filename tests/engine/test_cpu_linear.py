"""engine/cpu_linear.py: packed linears give F.linear's products (to float32 rounding) at every row count, and
pack_linears packs the decoder's linears and the tied lm_head of a loaded model."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cpu_linear import PACK_MAX_ROWS, pack, pack_linears, pack_max_rows, packing_ok
from engine.loader import build_model, resolve_model
from engine.model import Linear

pytestmark = pytest.mark.skipif(not packing_ok(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch")


@pytest.mark.parametrize("rows", [1, 16, PACK_MAX_ROWS, PACK_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(96, 40, generator=g), torch.randn(rows, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    lin = Linear(40, 96, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias:
            lin.bias.copy_(b)
    pack(lin)
    torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_pack_max_rows_by_vendor_and_instruction_set():
    assert pack_max_rows("AuthenticAMD", "AVX512") > 1 << 40  # every product: oneDNN's AVX-512 beats MKL's AVX2 there
    assert pack_max_rows("AuthenticAMD", "AVX2") == PACK_MAX_ROWS
    assert pack_max_rows("GenuineIntel", "AVX512") == PACK_MAX_ROWS  # MKL runs AVX-512 on Intel: not measured faster
    assert pack_max_rows("", "DEFAULT") == PACK_MAX_ROWS
    lin = Linear(8, 8)
    pack(lin, max_rows=5)
    assert lin.packed_max_rows == 5


@pytest.mark.parametrize("tied", [False, True])
def test_pack_linears(tied):
    resolved = resolve_model("random:tiny")
    resolved.config.tie_word_embeddings = tied
    model = build_model(resolved, torch.float32, "cpu", None, seed=0)
    hidden = torch.randn(3, model.config.hidden_size)
    before = model.compute_logits(hidden)
    params = {id(p) for p in model.parameters()}
    assert pack_linears(model) == 4 * len(model.model.layers) + 1  # qkv, o, gate_up, down; the lm_head
    assert all(layer.mlp.down_proj.packed is not None for layer in model.model.layers)
    assert model.lm_head.packed is not None
    assert {id(p) for p in model.parameters()} == params  # (a tied lm_head's weight is the embedding's)
    torch.testing.assert_close(model.compute_logits(hidden), before, atol=1e-4, rtol=1e-5)
