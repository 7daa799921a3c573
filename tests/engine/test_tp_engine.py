"""Tensor parallelism driven by the engine (engine/tp_executor.py, engine/tp_worker.py): LLM(tensor_parallel_size=2)
runs rank 0 here and rank 1 in a spawned process (gloo on the CPU, NCCL on two GPUs) and generates what tp=1 does,
token for token."""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams

# Lengths 3..150 with a token budget of 32: prefill is chunked, short prompts decode while long ones prefill. The last
# prompt shares the longest one's first 96 tokens (prefix cache hits). 32 blocks of 8 tokens cannot hold every
# request at once: the scheduler preempts (and later recomputes) some, with the admission watermark off (it would hold
# requests back instead).
PROMPT_LENS = [3, 11, 40, 77, 150]
ENGINE = dict(max_num_batched_tokens=32, block_size=8, num_gpu_blocks_override=32, max_model_len=256, max_num_seqs=8,
              new_token_ratio=0.0)
MAX_TOKENS = 10


def make_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return prompts + [prompts[-1][:96] + torch.randint(3, vocab, (9,), generator=g).tolist()]


def params(n: int) -> list[SamplingParams]:
    """Greedy for most prompts, seeded random sampling for two (the sampler runs on rank 0 only)."""
    return [SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=MAX_TOKENS, ignore_eos=True) if i % 3 == 1
            else SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True) for i in range(n)]


def run(model, tp: int, **kw) -> tuple[list[list[int]], int, int]:
    """Tokens of every prompt, preemptions, prefix-cache hit tokens. On the CPU (gloo) unless kw names a device."""
    llm = LLM(str(model), tensor_parallel_size=tp, **{**ENGINE, "device": "cpu", **kw})
    try:
        prompts = make_prompts(llm.engine.runner.hf_config.vocab_size)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params(len(prompts)))
        eng = llm.engine
        return [o.outputs[0].token_ids for o in outs], eng.scheduler.num_preemptions, eng.kv.prefix_hits
    finally:
        llm.close()


@pytest.mark.parametrize("fixture, async_scheduling", [("tiny_llama_dir", True), ("tiny_qwen2_dir", False)])
def test_two_ranks_generate_what_one_does(request, fixture, async_scheduling):
    """Async scheduling (llama): a decode's input is the previous step's token still on rank 0, which rank 0
    broadcasts to the worker. Qwen2 adds q/k/v biases (split with their rows)."""
    model = request.getfixturevalue(fixture)
    want, preempted, hits = run(model, 1, async_scheduling=async_scheduling)
    assert preempted >= 1 and hits >= 96, (preempted, hits)  # the regimes the test means to cover happened
    got, preempted2, hits2 = run(model, 2, async_scheduling=async_scheduling)
    assert got == want
    assert (preempted2, hits2) == (preempted, hits)


def _zombie(pid: int) -> bool:
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_two_ranks_with_a_host_kv_tier_generate_what_one_does(tiny_llama_dir, mode):
    """--swap-space with two ranks: rank 0 decides what moves between device and host, every rank copies its own KV
    heads (the swapped requests' blocks, and prefix blocks evicted from the device and found on the host again)."""
    def swapping(tp):
        llm = LLM(str(tiny_llama_dir), tensor_parallel_size=tp, swap_space=0.01, preemption_mode=mode,
                  **{**ENGINE, "device": "cpu"})
        try:
            prompts = make_prompts(llm.engine.runner.hf_config.vocab_size)
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params(len(prompts)))
            st = llm.engine.stats()
            return [o.outputs[0].token_ids for o in outs], (st.swapped_out_blocks, st.swapped_in_blocks,
                                                            st.host_stored_blocks, st.num_swaps)
        finally:
            llm.close()

    want, moved = swapping(1)
    assert moved[0] > 0 and moved[1] > 0 and moved[3] > 0, moved  # requests did swap out and back in
    got, moved2 = swapping(2)
    assert got == want
    assert moved2 == moved


def test_close_ends_the_workers_and_a_killed_worker_raises(tiny_llama_dir):
    from engine.collectives import WorkerError

    # On the CPU also on a GPU host: a worker killed inside an NCCL collective is only seen by NCCL's watchdog
    # (engine/tp_worker.py), and its peer's stuck kernel would block that GPU for the tests after this one.
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, device="cpu", **ENGINE)
    driver = llm.engine.driver
    (proc,) = driver.procs
    llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=2))
    assert driver.num_steps >= 2 and proc.is_alive()
    llm.close()
    assert proc.exitcode == 0 and not torch.distributed.is_initialized()
    llm.close()  # twice: nothing left to do

    # A second engine in the same process (the first left its group); its worker killed mid-run.
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, async_scheduling=True, device="cpu", **ENGINE)
    eng = llm.engine
    (proc,) = eng.driver.procs
    for i, p in enumerate(make_prompts(512)):
        eng.add_request(str(i), p, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        eng.step()
    os.kill(proc.pid, signal.SIGKILL)
    # The next step needs rank 1 in its all-reduces, so it fails; however rank 0 notices first (its message to a
    # closed socket, or gloo's read error inside the forward), the error names the dead rank and its exit code.
    dead = r"^tensor-parallel group broken: .+; worker rank 1 \(pid \d+\) exited with code -9$"
    with pytest.raises(WorkerError, match=dead):
        eng.step()
    assert proc.exitcode == -9 and not _zombie(proc.pid)
    with pytest.raises(WorkerError, match="tensor-parallel group broken"):
        eng.step()
    llm.close()
    assert not torch.distributed.is_initialized()


def test_bad_tensor_parallel_size(tiny_llama_dir):
    from engine.args import EngineArgs, add_engine_args

    with pytest.raises(ValueError, match="tensor_parallel_size=3: must divide num_attention_heads=4"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=4: must divide num_key_value_heads=2"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size=0: must be >= 1"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=0)
    ns = add_engine_args(argparse.ArgumentParser()).parse_args(["--tensor-parallel-size", "2"])
    assert EngineArgs.from_cli_args(ns).create_engine_config().parallel.tensor_parallel_size == 2


def test_a_kv_transfer_moves_every_ranks_kv_heads(tiny_llama_dir):
    """engine.transfer_kv with two ranks (what the prefill and decode services send and receive): a write scatters
    each rank its own KV heads, a read gathers them back on rank 0; the layout is the whole model's."""
    from kv_transfer.layout import layout_of

    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **{**ENGINE, "device": "cpu"})
    try:
        kv, local = llm.engine.transfer_kv, llm.engine.kv_cache
        heads = llm.engine.runner.hf_config.num_key_value_heads
        assert (kv.shape[4], local.shape[4]) == (heads, heads // 2)
        assert layout_of(kv).num_kv_heads == heads and layout_of(kv).block_bytes == 2 * local[0].nbytes
        ids = [3, 4, 9, 0]
        blocks = torch.randn(len(ids), *kv.shape[1:], generator=torch.Generator().manual_seed(0)).to(kv.dtype)
        kv.write(ids, blocks)
        assert torch.equal(local[ids], blocks[:, :, :, :, :heads // 2])  # rank 0 holds the first half of the heads
        assert torch.equal(kv.read(ids), blocks)  # and rank 1 the second: they came back
        assert torch.equal(kv.read([9]), blocks[2:3])
        with pytest.raises(ValueError, match=r"block_ids: must lie in \[0, 32\)"):
            kv.read([32])  # refused before any rank is asked: the group still works
        with pytest.raises(ValueError, match="blocks: "):
            kv.write(ids, blocks[:, :, :, :, :1])
        assert torch.equal(kv.read(ids), blocks)
        out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.close()


def test_int8_kv_blocks_round_trip_between_tensor_parallel_sizes(tiny_llama_dir):
    """An int8 cache's block holds each (layer, K/V) region's values [block_size, heads, head_dim], then its scales
    [heads, block_size] (kernels/quant_int8.py): a rank's block is its heads of both, so the transfer's gather and
    scatter convert. Full-head blocks (tp=1's layout) of random bytes (scales of every bit pattern, NaN too) are
    scattered to two ranks and gathered back bit-exact, each rank holding its heads' values and scales; and the KV
    a tp=2 engine writes for a prompt, gathered, reads as tp=1's (layer 0: the same K/V up to rounding)."""
    from kernels.quant_int8 import dequantize_int8_rows_ref, int8_cache_views, int8_split_heads

    prompt = [[5 + 7 * i % 500 for i in range(37)]]
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    one = LLM(str(tiny_llama_dir), tensor_parallel_size=1, kv_cache_dtype="int8", **{**ENGINE, "device": "cpu"})
    try:
        one.engine.kv_cache.zero_()
        one.generate(prompt_token_ids=prompt, sampling_params=greedy)
        want = one.engine.transfer_kv[list(range(32))].clone()
    finally:
        one.close()
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, kv_cache_dtype="int8", **{**ENGINE, "device": "cpu"})
    try:
        kv, local = llm.engine.transfer_kv, llm.engine.kv_cache
        heads = llm.engine.runner.hf_config.num_key_value_heads
        assert kv.dtype == local.dtype == torch.int8 and (kv.shape[4], local.shape[4]) == (heads, heads // 2)
        ids = [3, 4, 9, 0]
        blocks = torch.randint(-128, 128, (len(ids), *kv.shape[1:]), generator=torch.Generator().manual_seed(0),
                               dtype=torch.int8)
        kv.write(ids, blocks)
        assert torch.equal(local[ids], int8_split_heads(blocks, 2)[0])  # rank 0: the first half of the heads
        (v_full, s_full), (v_mine, s_mine) = int8_cache_views(blocks), int8_cache_views(local[ids])
        assert torch.equal(v_mine, v_full[..., :heads // 2, :])
        assert torch.equal(s_mine.view(torch.int32), s_full[..., :heads // 2].view(torch.int32))
        assert torch.equal(kv.read(ids), blocks)  # and rank 1 the second: they came back, bit for bit
        assert torch.equal(kv.read([9]), blocks[2:3])

        kv.write(list(range(32)), torch.zeros(32, *kv.shape[1:], dtype=torch.int8))
        llm.generate(prompt_token_ids=prompt, sampling_params=greedy)
        got = kv.read(list(range(32)))
    finally:
        llm.close()
    (v_want, s_want), (v_got, s_got) = int8_cache_views(want), int8_cache_views(got)
    assert torch.equal(s_got > 0, s_want > 0) and (s_want > 0).sum() >= 37 * heads * 2 * 3  # the prompt's slots
    written = s_want[:, 0] > 0  # layer 0: K/V from the embeddings, no all-reduce before them
    a, b = dequantize_int8_rows_ref(v_got[:, 0], s_got[:, 0]), dequantize_int8_rows_ref(v_want[:, 0], s_want[:, 0])
    assert torch.allclose(a[written], b[written], atol=2 * float(s_want[:, 0][written].max()), rtol=0)


def test_a_tensor_parallel_prefill_refuses_cuda_ipc(capsys):
    """CUDA IPC maps one process's cache; a tensor-parallel prefill's KV goes by NIXL (each rank its heads) or as
    gRPC bytes through rank 0."""
    from prefill_svc.server import main as prefill_main

    with pytest.raises(SystemExit) as e:
        prefill_main(["--model", "random:tiny", "--tensor-parallel-size", "2", "--kv-transfer", "ipc"])
    assert e.value.code == 2
    assert "--kv-transfer ipc with --tensor-parallel-size 2: CUDA IPC maps one process's cache" in capsys.readouterr().err


# ---- ranks on several hosts: two "nodes" on 127.0.0.1 -----------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_node(model, tp: int, port: int) -> subprocess.Popen:
    """Node 1 as an operator starts it on its host: the worker's command line with --node-rank 1 (it serves nothing;
    it runs ranks tp/2 .. tp-1)."""
    flags = [x for k, v in ENGINE.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    return subprocess.Popen([sys.executable, "-m", "cli", "decode", "--model", str(model), "--device", "cpu",
                             "--tensor-parallel-size", str(tp), "--nnodes", "2", "--node-rank", "1",
                             "--master-addr", "127.0.0.1", "--master-port", str(port), *flags],
                            cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _stop(node: subprocess.Popen) -> str:
    if node.poll() is None:
        os.killpg(node.pid, signal.SIGKILL)
    return node.communicate(timeout=60)[0]


@pytest.mark.slow
@pytest.mark.parametrize("fixture, tp", [("tiny_llama_dir", 2), ("tiny_llama_4kv_dir", 4)])
def test_ranks_on_two_nodes_generate_what_one_process_does(request, fixture, tp):
    """tp=2: one rank per node; tp=4: ranks 0-1 here (rank 1 a local worker), ranks 2-3 on node 1. Every rank gets
    rank 0's steps over the gloo control group; a graceful close stops node 1's ranks, and node 1 exits 0."""
    model = request.getfixturevalue(fixture)
    want, preempted, hits = run(model, 1)
    port = _free_port()
    node = _start_node(model, tp, port)
    try:
        got, preempted2, hits2 = run(model, tp, nnodes=2, node_rank=0, master_port=port)
        assert got == want
        assert (preempted2, hits2) == (preempted, hits)
        assert node.wait(timeout=120) == 0, _stop(node)
    finally:
        out = _stop(node)
    assert "ranks stopped (exit 0)" in out, out


@pytest.mark.slow
def test_a_node_that_dies_breaks_the_engine_and_a_bad_node_rank_is_refused(tiny_llama_dir):
    from engine.collectives import WorkerError

    port = _free_port()
    node = _start_node(tiny_llama_dir, 2, port)
    try:
        llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, nnodes=2, node_rank=0, master_port=port,
                  **{**ENGINE, "device": "cpu"})
        sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=sp)[0].outputs[0].token_ids) == 4
        os.killpg(node.pid, signal.SIGKILL)  # node 1 and its rank: their connections close
        node.wait(timeout=60)
        with pytest.raises(WorkerError, match="tensor-parallel group broken"):
            llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=sp)
        llm.close()
        assert not torch.distributed.is_initialized()
    finally:
        _stop(node)
    for kw, match in ((dict(nnodes=2, node_rank=2), "node_rank=2: must be below nnodes=2"),
                      (dict(nnodes=3), "nnodes=3: must divide tensor_parallel_size=2")):
        with pytest.raises(ValueError, match=match):
            LLM(str(tiny_llama_dir), tensor_parallel_size=2, **kw)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_gpus_generate_what_one_does(tiny_qwen2_dir, dtype):
    """NCCL ranks on cuda:0 and cuda:1 with CUDA graphs (decode and prompt steps) and async scheduling (CUDA's
    default), against one GPU with the same settings."""
    kw = dict(device="cuda", dtype=dtype, enforce_eager=False, max_prefill_cudagraph_tokens=64)
    want, _, _ = run(tiny_qwen2_dir, 1, **kw)
    got, _, _ = run(tiny_qwen2_dir, 2, **kw)
    first = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None) for g, w in zip(got, want)]
    assert got == want, f"first differing token per prompt: {first}"
