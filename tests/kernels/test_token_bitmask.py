"""kernels/token_bitmask.py: the in-place token bitmask against its reference (and xgrammar's layout), constrained
rows only."""
from __future__ import annotations

import pytest
import torch

from kernels.token_bitmask import apply_token_bitmask_ref, apply_token_bitmask_triton

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")


def random_case(batch: int, vocab: int, rows: list[int], dtype=torch.float32, extra_words: int = 0, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32 + extra_words
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), words), generator=gen, dtype=torch.int64).to(torch.int32)
    if rows:
        bitmask[0] = -1  # every token allowed
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    return logits.to(DEVICE), bitmask.to(DEVICE), torch.tensor(rows, dtype=torch.int64, device=DEVICE)


def both(logits, bitmask, rows):
    fast, ref = logits.clone(), logits.clone()
    apply_token_bitmask_triton(fast, bitmask, rows)
    apply_token_bitmask_ref(ref, bitmask, rows)
    return fast, ref


SHAPES = [(1, 31, [0]), (3, 512, [2, 0]), (5, 1000, [4, 1, 3]), (4, 4097, [1]), (6, 130, [])]
if ON_CUDA:
    SHAPES += [(256, 152064, list(range(0, 256, 3))), (64, 151936, list(range(64)))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,vocab,rows", SHAPES)
def test_matches_reference(batch, vocab, rows, dtype):
    logits, bitmask, idx = random_case(batch, vocab, rows, dtype, seed=batch * vocab)
    fast, ref = both(logits, bitmask, idx)
    assert torch.equal(fast, ref)
    untouched = [r for r in range(batch) if r not in rows]
    assert torch.equal(fast[untouched], logits[untouched])  # a row without a grammar is not written
    if rows:
        assert torch.equal(fast[rows[0]], logits[rows[0]])  # an all-ones mask forbids nothing


def test_the_bit_layout_is_xgrammars():
    """Bit j of word w is token 32 * w + j, the sign bit included; bits past the vocabulary are ignored."""
    vocab, allowed = 70, [0, 31, 32, 63, 69]
    words = [0] * 4  # 3 words cover the vocabulary, one spare (0: ignored)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    words[2] |= ~((1 << 6) - 1) & 0xFFFFFFFF  # tokens 70..95 "allowed": past the vocabulary, ignored
    bitmask = torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in words]], dtype=torch.int32)
    logits = torch.zeros(2, vocab, device=DEVICE)
    apply_token_bitmask_triton(logits, bitmask.to(DEVICE), torch.tensor([1], device=DEVICE))
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == allowed
    assert torch.isfinite(logits[0]).all()


def test_a_wider_bitmask_and_strided_logits():
    logits, bitmask, idx = random_case(4, 300, [3, 1], extra_words=5, seed=1)
    wide = torch.randn(4, 512, device=DEVICE)
    wide[:, :300] = logits
    view = wide[:, :300]  # rows 512 apart
    fast, ref = view.clone(), view.clone()
    apply_token_bitmask_triton(view, bitmask, idx)
    apply_token_bitmask_ref(ref, bitmask, idx)
    assert torch.equal(view, ref) and torch.equal(wide[:, 300:].isinf(), torch.zeros(4, 212, dtype=torch.bool,
                                                                                     device=DEVICE))


def test_bad_arguments_name_the_argument():
    logits, bitmask, idx = random_case(2, 100, [0])
    with pytest.raises(ValueError, match="bitmask: 3 words cover 96 tokens"):
        apply_token_bitmask_triton(logits, bitmask[:, :3], idx)
    with pytest.raises(ValueError, match="rows: 2 entries"):
        apply_token_bitmask_triton(logits, bitmask, torch.tensor([0, 1], device=DEVICE))
    with pytest.raises(ValueError, match="bitmask: dtype"):
        apply_token_bitmask_triton(logits, bitmask.long(), idx)


@cuda_only
def test_rows_past_int32_offsets():
    """Logits of more than 2**31 elements (14200 rows of Qwen2.5's 152064, half precision): the last rows'
    offsets overflow int32."""
    batch, vocab = 14200, 152064
    logits = torch.zeros(batch, vocab, dtype=torch.float16, device="cuda")
    assert logits.numel() > 2**31
    rows = [0, batch - 2, batch - 1]
    _, bitmask, idx = random_case(1, vocab, rows, seed=3)
    last = logits[-3:].clone()
    apply_token_bitmask_triton(logits, bitmask, idx)
    ref = torch.zeros(3, vocab, dtype=torch.float16, device="cuda")
    apply_token_bitmask_ref(ref, bitmask, torch.tensor([0, 1, 2], device="cuda"))
    assert torch.equal(logits[-2:], ref[1:]) and torch.equal(logits[0], ref[0])
    assert torch.equal(logits[-3], last[0])
