"""kernels/paged_attention_cpu.py: the CPU decode path against paged_attention_ref, with NaN in every slot no
sequence owns (its last block's tail, spare blocks, the block table's padding)."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels.paged_attention import paged_attention_ref, paged_attention_torch
from kernels.paged_attention_cpu import decode_attention_cpu_ok, paged_decode_attention_cpu
from tests.kernels.test_paged_attention import TOL, make_batch

SEQ_LENS = [[1], [16], [17, 1, 33], [150, 129, 160, 3, 64, 16, 31, 140]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("seq_lens", SEQ_LENS)
def test_matches_reference(seq_lens, heads, block_size, dtype):
    num_heads, num_kv_heads = heads
    args = make_batch([(1, n) for n in seq_lens], num_heads, num_kv_heads, 64, block_size, dtype, seed=len(seq_lens),
                      device="cpu")
    assert decode_attention_cpu_ok(args["q"], args["k_cache"], args["max_query_len"], len(seq_lens), 1.0, 1.0, None)
    out = paged_decode_attention_cpu(args["q"], args["k_cache"], args["v_cache"], args["block_tables"],
                                     args["seq_lens"], args["max_seq_len"], args["scale"])
    ref = paged_attention_ref(**args)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    # the dispatcher takes this path for such a step, and leaves the cache as it was
    before = args["k_cache"].clone()
    torch.testing.assert_close(kernels.paged_attention(**args), out, atol=0, rtol=0)
    torch.testing.assert_close(args["k_cache"], before, atol=0, rtol=0, equal_nan=True)
    # bit for bit what the mixed-step path computes, so sync and async scheduling agree to the last bit
    assert torch.equal(out, paged_attention_torch(**args))


def test_other_steps_are_not_taken():
    args = make_batch([(3, 20), (1, 5)], 4, 2, 64, 16, torch.float32, seed=0, device="cpu")
    q, kc = args["q"], args["k_cache"]
    assert not decode_attention_cpu_ok(q, kc, 3, 2, 1.0, 1.0, None)  # a prefill chunk in the step
    assert not decode_attention_cpu_ok(q[:2], kc.to(torch.bfloat16), 1, 2, 1.0, 1.0, None)  # cache dtype differs
    assert not decode_attention_cpu_ok(q[:2], kc, 1, 2, 0.5, 1.0, None)  # a scaled (fp8) cache
