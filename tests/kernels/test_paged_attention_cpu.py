"""kernels/paged_attention_cpu.py and kernels/cpu_native.py: the CPU paths against paged_attention_ref, with NaN in
every slot no sequence owns (its last block's tail, spare blocks, the block table's padding), on the layer views of
one strided cache as the engine makes them; the C kernel's build, its cache key and its fallback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import cpu_native
from kernels import paged_attention_cpu as pac
from kernels.paged_attention import paged_attention_ref, paged_attention_torch
from kernels.paged_attention_cpu import (decode_attention_cpu_ok, native_attention_cpu_ok,
                                         paged_decode_attention_cpu, paged_decode_attention_native)
from tests.kernels.test_paged_attention import TOL, make_batch, step_kv

SEQ_LENS = [[1], [16], [17, 1, 33], [150, 129, 160, 3, 64, 16, 31, 140]]
# float32: the kernel and the reference sum the same float32 products in different orders. bfloat16: both round a
# float32 result once, so they differ by at most one bfloat16 step (2 ** -8 relative).
NATIVE_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=8e-3)}
HAS_NATIVE = pac._native_kernel() is not None
needs_native = pytest.mark.skipif(not HAS_NATIVE, reason="the C kernel did not build here (no gcc?)")


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """An empty kernel cache and no library loaded yet; the process's own library is loaded again afterwards."""
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path))
    cpu_native.load_library.cache_clear()
    pac._native_kernel.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    cpu_native.load_library.cache_clear()
    pac._native_kernel.cache_clear()


def native(args) -> torch.Tensor:
    out = torch.full(args["q"].shape, float("nan"), dtype=args["q"].dtype)
    return paged_decode_attention_native(args["q"], args["k_cache"], args["v_cache"], args["block_tables"],
                                         args["seq_lens"], args["query_start_loc"], args["scale"], out)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2), (8, 1)])  # query heads per KV head: 1, 3, 4, 8
@pytest.mark.parametrize("seq_lens", SEQ_LENS)
def test_native_matches_reference(seq_lens, heads, head_dim, block_size, dtype):
    num_heads, num_kv_heads = heads
    args = make_batch([(1, n) for n in seq_lens], num_heads, num_kv_heads, head_dim, block_size, dtype,
                      seed=len(seq_lens) + block_size, device="cpu")
    assert native_attention_cpu_ok(args["q"], args["k_cache"], args["v_cache"], 1.0, 1.0, None)
    assert not args["k_cache"].is_contiguous()  # a layer's view of the engine's one cache tensor
    ref = paged_attention_ref(**args)
    before = args["k_cache"].clone()
    out = native(args)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **NATIVE_TOL[dtype])
    torch.testing.assert_close(args["k_cache"], before, atol=0, rtol=0, equal_nan=True)
    assert torch.equal(kernels.paged_attention(**args), out)  # the dispatcher takes this path


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 32, 72, 80, 96, 256])  # off the 16-float vector, or not 64 / 128
def test_native_head_dim_off_the_vector_width(head_dim, dtype):
    args = make_batch([(1, 37), (1, 5), (1, 70)], 6, 2, head_dim, 16, dtype, seed=3, device="cpu")
    torch.testing.assert_close(native(args), paged_attention_ref(**args), **NATIVE_TOL[dtype])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_splits_kv_heads_past_the_item_budget(dtype):
    """40 query heads of 256 over 8 KV heads hold 10240 floats, past the kernel's MAX_ELEMS (8192): a sequence's
    KV heads go in two items (6 and 2), whose rows must still be the reference's."""
    assert 40 * 256 > pac.MAX_GROUP_ELEMS >= 5 * 256
    args = make_batch([(1, 45), (1, 1), (1, 100)], 40, 8, 256, 16, dtype, seed=11, device="cpu")
    assert native_attention_cpu_ok(args["q"], args["k_cache"], args["v_cache"], 1.0, 1.0, None)
    torch.testing.assert_close(native(args), paged_attention_ref(**args), **NATIVE_TOL[dtype])


def test_native_declines_heads_past_its_stack_budget():
    q = torch.zeros(2, 4, 512)
    cache = torch.zeros(3, 16, 2, 512)
    assert not native_attention_cpu_ok(q, cache, cache, 1.0, 1.0, None)  # head_dim > MAX_HEAD_DIM
    q, cache = torch.zeros(2, 64, 256), torch.zeros(3, 16, 1, 256)
    assert not native_attention_cpu_ok(q, cache, cache, 1.0, 1.0, None)  # one KV head's group > MAX_GROUP_ELEMS
    q, cache = torch.zeros(2, 512, 8), torch.zeros(3, 16, 1, 8)
    assert not native_attention_cpu_ok(q, cache, cache, 1.0, 1.0, None)  # the group's scores: 512 x 32 floats


@needs_native
def test_native_small_head_dim_many_heads():
    """head_dim 8 under 32 keys a tile: the scores set the item's size (96 x 32 floats fit, all in one item)."""
    args = make_batch([(1, 33), (1, 70)], 96, 4, 8, 16, torch.float32, seed=12, device="cpu")
    assert native_attention_cpu_ok(args["q"], args["k_cache"], args["v_cache"], 1.0, 1.0, None)
    torch.testing.assert_close(native(args), paged_attention_ref(**args), **NATIVE_TOL[torch.float32])


@needs_native
def test_native_reads_no_slot_past_seq_len():
    """The table's entries past a sequence's last block may be anything: ids outside the cache too."""
    args = make_batch([(1, 17), (1, 1), (1, 64), (1, 40)], 8, 2, 64, 16, torch.float32, seed=5, device="cpu")
    ref = paged_attention_ref(**args)
    bt = args["block_tables"]
    for i, n in enumerate(args["seq_lens"].tolist()):
        bt[i, -(-n // 16):] = 10 ** 9
    out = native(args)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **NATIVE_TOL[torch.float32])


@needs_native
def test_native_rejects_tables_outside_the_cache():
    args = make_batch([(1, 20), (1, 9)], 4, 2, 64, 16, torch.float32, seed=6, device="cpu")
    args["block_tables"][1, 0] = args["k_cache"].shape[0]
    with pytest.raises(ValueError, match="sequence 1:"):
        native(args)
    args = make_batch([(1, 20)], 4, 2, 64, 16, torch.float32, seed=6, device="cpu")
    args["seq_lens"][0] = args["block_tables"].shape[1] * 16 + 1
    with pytest.raises(ValueError, match="sequence 0:"):
        native(args)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_decode_rows_match_decode_steps(dtype):
    """In a step with prompt chunks the one-query rows take the C kernel too: a decode has the same bits in a
    mixed step as in a decode-only one (what keeps async scheduling's tokens the sync engine's); the chunks match
    the reference."""
    specs = [(1, 40), (5, 20), (1, 3), (7, 7), (1, 129), (0, 12), (1, 1)]
    args = make_batch(specs, 9, 3, 64, 16, dtype, seed=7, device="cpu")
    out = kernels.paged_attention(**args)
    ref = paged_attention_ref(**args)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    qsl = args["query_start_loc"].tolist()
    decodes = [i for i, (ql, _) in enumerate(specs) if ql == 1]
    rows = [qsl[i] for i in decodes]
    alone = dict(args, q=args["q"][rows], block_tables=args["block_tables"][decodes],
                 seq_lens=args["seq_lens"][decodes], max_query_len=1,
                 query_start_loc=torch.arange(len(decodes) + 1, dtype=torch.int32),
                 max_seq_len=int(args["seq_lens"][decodes].max()))
    assert torch.equal(kernels.paged_attention(**alone), out[rows])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("specs", [
    [(128, 128)] * 4,  # a burst of fresh prompts of one length: SDPA over views of the step's rows
    [(1, 40), (33, 33), (5, 20), (17, 17), (1, 3), (33, 33), (7, 7), (0, 12), (1, 1), (2, 2)],  # mixed, by length
])
def test_chunks_from_position_0_attend_over_the_steps_own_kv(specs, dtype):
    """Chunks that start at position 0 read the step's k/v, not the cache (their cached slots are NaN here, so a
    read from there would show); the other rows are the paths' as before, a decode's bits unchanged."""
    args = make_batch(specs, 9, 3, 64, 16, dtype, seed=9, device="cpu")
    k, v, ref = step_kv(args, poison=False)
    block_size, fresh = args["k_cache"].shape[1], [i for i, (ql, sl) in enumerate(specs) if ql == sl > 1]
    for i in fresh:
        ids = args["block_tables"][i, :-(-specs[i][1] // block_size)].long()
        args["k_cache"][ids] = float("nan")
        args["v_cache"][ids] = float("nan")
    out = kernels.paged_attention(**args, k=k, v=v)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    qsl = args["query_start_loc"].tolist()
    others = [t for i in range(len(specs)) if i not in fresh for t in range(qsl[i], qsl[i + 1])]
    assert torch.equal(kernels.paged_attention(**args)[others], out[others])


@needs_native
def test_native_bits_do_not_depend_on_threads():
    args = make_batch([(1, n) for n in SEQ_LENS[-1]], 9, 3, 64, 16, torch.float32, seed=8, device="cpu")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native(args)
        torch.set_num_threads(4)
        four = native(args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, four)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("seq_lens", SEQ_LENS)
def test_torch_decode_matches_reference(seq_lens, heads, block_size, dtype):
    num_heads, num_kv_heads = heads
    args = make_batch([(1, n) for n in seq_lens], num_heads, num_kv_heads, 64, block_size, dtype, seed=len(seq_lens),
                      device="cpu")
    assert decode_attention_cpu_ok(args["q"], args["k_cache"], args["max_query_len"], len(seq_lens), 1.0, 1.0, None)
    before = args["k_cache"].clone()
    out = paged_decode_attention_cpu(args["q"], args["k_cache"], args["v_cache"], args["block_tables"],
                                     args["seq_lens"], args["max_seq_len"], args["scale"])
    ref = paged_attention_ref(**args)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(args["k_cache"], before, atol=0, rtol=0, equal_nan=True)
    # bit for bit what the mixed-step path computes, so sync and async scheduling agree to the last bit
    assert torch.equal(out, paged_attention_torch(**args))


def test_other_steps_are_not_taken():
    args = make_batch([(3, 20), (1, 5)], 4, 2, 64, 16, torch.float32, seed=0, device="cpu")
    q, kc, vc = args["q"], args["k_cache"], args["v_cache"]
    assert not decode_attention_cpu_ok(q, kc, 3, 2, 1.0, 1.0, None)  # a prefill chunk in the step
    assert not decode_attention_cpu_ok(q[:2], kc.to(torch.bfloat16), 1, 2, 1.0, 1.0, None)  # cache dtype differs
    assert not decode_attention_cpu_ok(q[:2], kc, 1, 2, 0.5, 1.0, None)  # a scaled (fp8) cache
    assert not native_attention_cpu_ok(q, kc.to(torch.bfloat16), vc.to(torch.bfloat16), 1.0, 1.0, None)
    assert not native_attention_cpu_ok(q, kc, vc, 0.5, 1.0, None)
    assert not native_attention_cpu_ok(q.half(), kc.half(), vc.half(), 1.0, 1.0, None)  # no float16 loads
    assert not native_attention_cpu_ok(q, kc[..., ::2], vc[..., ::2], 1.0, 1.0, None)  # strided rows


def test_disabled_takes_the_torch_path(fresh_native, monkeypatch):
    monkeypatch.setenv("TANDEM_CPU_NATIVE", "0")
    args = make_batch([(1, 17), (1, 3)], 9, 3, 64, 16, torch.float32, seed=1, device="cpu")
    assert not native_attention_cpu_ok(args["q"], args["k_cache"], args["v_cache"], 1.0, 1.0, None)
    out = kernels.paged_attention(**args)
    assert torch.equal(out, paged_attention_torch(**args))
    assert not list(fresh_native.iterdir())  # nothing was built


def test_no_compiler_takes_the_torch_path(fresh_native, monkeypatch):
    monkeypatch.setattr(cpu_native, "CC", str(fresh_native / "no-such-gcc"))
    cpu_native._toolchain.cache_clear()
    try:
        assert cpu_native.load_library("paged_decode_attention") is None
        args = make_batch([(1, 17)], 4, 2, 64, 16, torch.float32, seed=2, device="cpu")
        assert not native_attention_cpu_ok(args["q"], args["k_cache"], args["v_cache"], 1.0, 1.0, None)
    finally:
        cpu_native._toolchain.cache_clear()


@needs_native
def test_cache_key_follows_the_source_and_the_directory(fresh_native, monkeypatch):
    src = (cpu_native.CSRC / "paged_decode_attention.c").read_bytes()
    path = cpu_native.library_path("paged_decode_attention", src)
    assert path.parent == fresh_native
    assert cpu_native.library_path("paged_decode_attention", src) == path
    assert cpu_native.library_path("paged_decode_attention", src + b"\n") != path
    monkeypatch.setattr(cpu_native, "CFLAGS", cpu_native.CFLAGS + ("-DX",))
    assert cpu_native.library_path("paged_decode_attention", src) != path


@needs_native
def test_concurrent_builds_leave_one_whole_library(fresh_native):
    """Processes that build at once (the services of `tandem up`) each rename a whole file into place."""
    code = "from kernels.cpu_native import build, load_library; print(build('paged_decode_attention')); " \
           "assert load_library('paged_decode_attention') is not None"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TANDEM_KERNEL_CACHE": str(fresh_native), "PYTHONPATH": str(root)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1
    assert [p.name for p in fresh_native.iterdir()] == [Path(paths.pop()).name]  # no temporary left behind
