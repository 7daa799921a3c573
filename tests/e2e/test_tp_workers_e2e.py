"""Tensor-parallel prefill and decode workers: `tandem up --prefill-tp P --decode-tp D` (gloo ranks on the CPU, each
rank a process holding its share of the KV heads). A transfer moves whole blocks: the prefill's rank 0 gathers each
run's heads from its ranks, the decode's rank 0 scatters each rank its own (engine/sharded_kv.py), so the sizes may
differ. The tokens equal one tp=1 engine's, for equal and unequal sizes, greedy and seeded, through chunked prefill
(32-token chunks) and prefix-cache hits on both sides; every block is back after. Equal sizes also over NIXL (UCX on
host memory here), where each decode rank reads its own heads from the prefill rank of its number."""
from __future__ import annotations

import time

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos.tandem.v1 import common_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc, prefill_pb2_grpc
from stack import Stack

ENGINE = ("--model", "random:tiny", "--max-num-batched-tokens", "32", "--kv-cache-memory", "0.05")
PREFIX = [(7 * i + 3) % 250 + 5 for i in range(64)]  # four full blocks, shared by the first two prompts
PROMPTS = [PREFIX + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30],  # 84: 3 chunks
           PREFIX + [99, 98, 97, 96, 95],  # the prefix again: cached in the prefill and held by the decode
           [42, 7, 300, 5]]  # shorter than a block
MAX_TOKENS = 12
SEEDED = dict(temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
GREEDY = dict(temperature=0, ignore_eos=True)


def _generate(address: str, prompt: list[int], **params) -> tuple[list[int], generate_pb2.GenerateResponse]:
    with grpc.insecure_channel(address) as ch:
        responses = list(generate_pb2_grpc.GenerateStub(ch).Generate(generate_pb2.GenerateRequest(
            model="random:tiny", prompt_token_ids=prompt, params=common_pb2.SamplingParams(
                max_tokens=MAX_TOKENS, **params)), timeout=120))
    return [t for r in responses for t in r.delta.token_ids], responses[-1]


@pytest.fixture(scope="module")
def expected():
    """What one tp=1 engine with the workers' flags generates, greedy and seeded."""
    from engine import LLM, SamplingParams

    llm = LLM("random:tiny", device="cpu", max_num_batched_tokens=32, kv_cache_memory=0.05)
    items = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = [o.outputs[0].token_ids for o in llm.generate(items, SamplingParams(max_tokens=MAX_TOKENS, **GREEDY))]
    seeded = [o.outputs[0].token_ids for o in llm.generate(items, SamplingParams(max_tokens=MAX_TOKENS, **SEEDED))]
    llm.close()
    return greedy, seeded


@pytest.fixture(scope="module", params=[(2, 1, "grpc"), (1, 2, "grpc"), (2, 2, "grpc"), (2, 2, "nixl")],
                ids=lambda s: f"prefill_tp{s[0]}-decode_tp{s[1]}-{s[2]}")
def stack(request):
    prefill_tp, decode_tp, path = request.param
    if path == "nixl":
        pytest.importorskip("nixl_cu12")
    s = Stack(*ENGINE, "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp), "--kv-transfer", path,
              prefill=1, decode=1)
    s.path = path
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def _loads(stack: Stack) -> list[common_pb2.InstanceLoad]:
    out = []
    for name, port in stack.worker_ports.items():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = (prefill_pb2_grpc.PrefillStub if name.startswith("prefill") else decode_pb2_grpc.DecodeStub)(ch)
            out.append(stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10))
    return out


def _path_bytes(stack: Stack) -> dict[str, float]:
    """The decode worker's KV bytes received, by transfer path (its Prometheus counter)."""
    text = httpx.get(f"http://127.0.0.1:{stack.metrics_ports[1]}/metrics", timeout=10).text
    return {s.labels["path"]: s.value for fam in text_string_to_metric_families(text)
            if fam.name == "tandem:kv_transfer_path_bytes" for s in fam.samples if s.name.endswith("_total")}


@pytest.mark.slow
def test_tokens_equal_one_engine_greedy_and_seeded(stack, expected):
    greedy, seeded = expected
    for want, params in ((greedy, GREEDY), (seeded, SEEDED)):
        got, cached = [], []
        for prompt in PROMPTS:  # one after another: the second finds the first's prefix on both sides
            tokens, last = _generate(stack.grpc, prompt, **params)
            got.append(tokens)
            cached.append(last.usage.cached_prompt_tokens)
        assert got == want, params
        assert all(len(t) == MAX_TOKENS for t in got)
        assert cached[1] >= len(PREFIX), cached  # a prefix hit in the tensor-parallel prefill
    out = "".join(stack.lines)
    # The path every transfer took: NIXL rank to rank (each decode rank read its own heads from the prefill rank of
    # its number), or gRPC bytes through rank 0.
    moved = _path_bytes(stack)
    assert moved[stack.path] > 0 and not any(v for p, v in moved.items() if p != stack.path), moved
    if stack.path == "nixl":
        assert "added 2 nixl agents (one per rank)" in out
    deadline = time.monotonic() + 60
    while True:
        loads = _loads(stack)
        if not any(x.num_used_blocks or x.num_tracked_requests for x in loads):
            break
        assert time.monotonic() < deadline, loads
        time.sleep(0.2)
