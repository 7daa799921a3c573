"""Same-host KV transfer through CUDA IPC, end to end on one GPU and across two: a real decode process and a real
prefill process (on cuda:0 and cuda:1 in the second case, where the copy goes GPU to GPU) started with
`--kv-transfer ipc` (so a refused handshake fails the test instead of falling back to bytes), driven
the way the router drives them. Greedy outputs must equal `engine.LLM`'s on the same model and settings, every
transfer must report the CUDA IPC path, no KV byte may have gone over gRPC (the path-labelled metrics of both
processes), and no block may stay allocated. Skipped without CUDA (tests/prefill_svc and tests/decode_svc cover the
negotiation and the fallback on the CPU)."""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from protos.tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kv_transfer_pb2 as kv, prefill_pb2
from protos.tandem.v1 import prefill_pb2_grpc
from ports import free_ports

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[2]
# float32 on the GPU: greedy tokens are then decided far from rounding; chunks of 48 tokens, so prompts longer
# than that are prefilled, and shipped, over several steps.
ENGINE = dict(model="random:tiny", device="cuda", dtype="float32", kv_cache_memory=0.0625, block_size=16,
              max_model_len=1024, max_num_batched_tokens=48, max_num_seqs=16, enforce_eager=True)
PROMPT_LENS = (5, 40, 100, 333)


def flags(device: str = "cuda", kv_cache_dtype: str = "auto") -> list[str]:
    out = []
    for k, v in {**ENGINE, "device": device, "kv_cache_dtype": kv_cache_dtype}.items():
        out += [f"--{k.replace('_', '-')}"] if v is True else [f"--{k.replace('_', '-')}", str(v)]
    return out


# (an int8 cache: its per-slot scales travel inside each block's bytes, as on the other paths)
@pytest.fixture(scope="module", params=[("cuda:0", "auto"), ("cuda:0", "int8"), ("cuda:1", "auto")],
                ids=["decode-same-gpu", "decode-same-gpu-int8", "decode-on-second-gpu"])
def stack(request):
    decode_device, kv_cache_dtype = request.param
    if torch.cuda.device_count() <= torch.device(decode_device).index:
        pytest.skip(f"needs {decode_device}: {torch.cuda.device_count()} GPU(s) here")
    dport, pport, dmetrics, pmetrics = free_ports(4)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = {name: Path(os.environ.get("TMPDIR", "/tmp")) / f"tandem-ipc-{name}-{os.getpid()}.log"
            for name in ("decode", "prefill")}
    procs = {
        "decode": subprocess.Popen([sys.executable, "-m", "decode_svc.server", "--port", str(dport),
                                    "--metrics-port", str(dmetrics), *flags(decode_device, kv_cache_dtype)], cwd=ROOT, env=env,
                                   stdout=logs["decode"].open("w"), stderr=subprocess.STDOUT),
        "prefill": subprocess.Popen([sys.executable, "-m", "prefill_svc.server", "--port", str(pport),
                                     "--metrics-port", str(pmetrics), "--kv-transfer", "ipc", *flags("cuda:0", kv_cache_dtype)],
                                    cwd=ROOT,
                                    env=env, stdout=logs["prefill"].open("w"), stderr=subprocess.STDOUT),
    }

    def tail() -> str:
        return "\n".join(f"== {k}\n{p.read_text()[-3000:]}" for k, p in logs.items())

    async def ready() -> bool:
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{dport}") as d, \
                    grpc.aio.insecure_channel(f"127.0.0.1:{pport}") as p:
                await decode_pb2_grpc.DecodeStub(d).GetLoad(common_pb2.GetLoadRequest(), timeout=2)
                await prefill_pb2_grpc.PrefillStub(p).GetLoad(common_pb2.GetLoadRequest(), timeout=2)
            return True
        except grpc.aio.AioRpcError:
            return False

    try:
        deadline = time.monotonic() + 180
        while not asyncio.run(ready()):
            dead = [n for n, p in procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                pytest.fail(f"{dead or 'stack'} not serving:\n{tail()}")
            time.sleep(0.5)
        yield dict(decode=f"127.0.0.1:{dport}", prefill=f"127.0.0.1:{pport}", metrics=(pmetrics, dmetrics),
                   tail=tail, kv_cache_dtype=kv_cache_dtype)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def path_bytes(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {"grpc": 0.0, "ipc": 0.0, "nixl": 0.0}
    for m in re.finditer(r'^tandem:kv_transfer_path_bytes_total\{([^}]*)\} (\S+)$', text, re.M):
        path = re.search(r'path="(\w+)"', m.group(1)).group(1)
        out[path] += float(m.group(2))
    return out


async def serve_one(stack, rid: str, prompt: list[int], max_tokens: int):
    """What the router does for one request: reserve on decode, prefill with the decode target, join the streams."""
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    async with grpc.aio.insecure_channel(stack["decode"]) as dch, grpc.aio.insecure_channel(stack["prefill"]) as pch:
        dcall = decode_pb2_grpc.DecodeStub(dch).Decode(decode_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=prompt, params=params, kv_transfer_timeout_ms=60_000))
        assert (await dcall.read()).HasField("reserved")
        resps = [r async for r in prefill_pb2_grpc.PrefillStub(pch).Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, params=params, decode_address=stack["decode"],
            kv_transfer_timeout_ms=60_000))]
        tokens = list(resps[0].first_token.delta.token_ids)
        while (r := await dcall.read()) is not grpc.aio.EOF:
            tokens += r.delta.token_ids
        return tokens, resps[-1].transfer_done


async def loads(stack):
    out = []
    for addr, stub in ((stack["prefill"], prefill_pb2_grpc.PrefillStub), (stack["decode"], decode_pb2_grpc.DecodeStub)):
        async with grpc.aio.insecure_channel(addr) as ch:
            for _ in range(50):
                load = await stub(ch).GetLoad(common_pb2.GetLoadRequest())
                if load.num_used_blocks == 0 and load.num_tracked_requests == 0:
                    break
                await asyncio.sleep(0.1)
            out.append(load)
    return out


def test_ipc_transfers_match_the_offline_engine_and_move_no_bytes_over_grpc(stack):
    from engine import LLM, SamplingParams

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(300, 500, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    offline = LLM(**ENGINE, kv_cache_dtype=stack["kv_cache_dtype"])
    expected = offline.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    block_bytes = offline.engine.runner.kv_bytes_per_block
    offline.close()
    before = [path_bytes(p) for p in stack["metrics"]]

    async def scenario():
        one = [await serve_one(stack, "solo", prompts[2], 12)]  # alone, then all at once (batched on both sides)
        many = await asyncio.gather(*(serve_one(stack, f"r{i}", p, 12) for i, p in enumerate(prompts)))
        return one + list(many), await loads(stack)

    results, (pload, dload) = asyncio.run(scenario())
    after = [path_bytes(p) for p in stack["metrics"]]
    want = [expected[2].outputs[0].token_ids] + [e.outputs[0].token_ids for e in expected]
    assert [toks for toks, _ in results] == want, stack["tail"]()
    for (_, done), n in zip(results, (PROMPT_LENS[2], *PROMPT_LENS)):
        assert done.path == kv.KV_TRANSFER_PATH_CUDA_IPC
        assert done.num_blocks == -(-n // 16) and done.transfer_bytes == done.num_blocks * block_bytes
    total = sum(done.transfer_bytes for _, done in results)
    for b, a in zip(before, after):  # prefill, then decode
        assert a["grpc"] == b["grpc"] and a["nixl"] == b["nixl"], (b, a)
        assert a["ipc"] - b["ipc"] == total, (b, a)
    for load in (pload, dload):
        assert load.num_used_blocks == 0 and load.num_tracked_requests == 0, load
