"""The token bitmask of structured outputs: in place, each constrained row of the logits gets -inf at every token
its bitmask forbids.

The bitmask is xgrammar's layout, packed by constrained row: bitmask[i] belongs to logits row rows[i], and bit j of
its word w is token 32 * w + j (set: allowed). Only those rows are read or written, so the rows of a batch that
have no grammar cost nothing; bits past the vocabulary are ignored (a tokenizer's vocabulary may be smaller than
the logits' width: the grammar leaves those bits clear, and the engine's compiler covers the whole width).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_same_device, check_tensor

_BLOCK_WORDS = 128  # 4096 tokens per program


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits [batch, vocab] float; bitmask [num_rows, >= ceil(vocab / 32)] int32; rows [num_rows] int (distinct)."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [num_rows, W, 32]: bit j of word w is token 32 * w + j
    allowed = bits.flatten(1)[:, :vocab].bool()  # [num_rows, vocab]
    rows = rows.long()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,  # [batch, vocab] float, rows stride_logits apart
    bitmask_ptr,  # [num_rows, num_words] int32, rows stride_bitmask apart
    rows_ptr,  # [num_rows] int32 or int64: the logits row of each bitmask row
    vocab,
    num_words,
    stride_logits,
    stride_bitmask,
    BLOCK_WORDS: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    words = tl.program_id(1) * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)  # [BLOCK_WORDS]
    packed = tl.load(bitmask_ptr + i * stride_bitmask + words, mask=words < num_words, other=-1)
    bit = tl.arange(0, 32)
    allowed = (packed[:, None] >> bit[None, :]) & 1  # [BLOCK_WORDS, 32]
    tokens = words.to(tl.int64)[:, None] * 32 + bit[None, :]  # [BLOCK_WORDS, 32]
    forbidden = (allowed == 0) & (tokens < vocab)
    minus_inf = tl.full([BLOCK_WORDS, 32], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + tokens, minus_inf, mask=forbidden)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is clear (shapes: apply_token_bitmask_ref)."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("bitmask", bitmask, ndim=2, dtypes=(torch.int32,))
    check_tensor("rows", rows, ndim=1, dtypes=(torch.int32, torch.int64))
    check_same_device(logits=logits, bitmask=bitmask, rows=rows)
    vocab, num_rows = logits.shape[1], bitmask.shape[0]
    if rows.shape[0] != num_rows:
        raise ValueError(f"rows: {rows.shape[0]} entries, expected one per bitmask row ({num_rows})")
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask: {bitmask.shape[1]} words cover {bitmask.shape[1] * 32} tokens, fewer than the "
                         f"logits' {vocab} (allocate ceil(vocab / 32) words)")
    if num_rows == 0 or vocab == 0:
        return
    num_words = triton.cdiv(vocab, 32)
    grid = (num_rows, triton.cdiv(num_words, _BLOCK_WORDS))
    _apply_token_bitmask_kernel[grid](logits, bitmask, rows, vocab, num_words, logits.stride(0), bitmask.stride(0),
                                      BLOCK_WORDS=_BLOCK_WORDS, num_warps=4)
