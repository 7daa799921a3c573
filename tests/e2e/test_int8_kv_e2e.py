"""`--kv-cache-dtype int8` end to end: router, one prefill and one decode instance as real processes (random:tiny on
the CPU, real gRPC on loopback); the int8 blocks and their per-row scales cross the gRPC bytes path, and greedy
outputs equal the offline engine's with the same int8 cache, token for token."""
from __future__ import annotations

import asyncio

import pytest

from protos.tandem.v1 import common_pb2
from test_grpc_e2e import ENGINE_FLAGS, GrpcStack, generate, wait_idle  # noqa: E402 - same directory

INT8_FLAGS = [*ENGINE_FLAGS, "--kv-cache-dtype", "int8"]
PROMPTS = ["Hello, my name is", "a" * 130]  # 130 tokens: 3 prefill chunks, 9 blocks
MAX_TOKENS = 12


@pytest.mark.slow
def test_int8_stack_matches_offline_int8_engine():
    from engine import LLM, SamplingParams

    llm = LLM(model="random:tiny", device="cpu", kv_cache_memory=0.03125, max_num_batched_tokens=48, block_size=16,
              max_model_len=1024, kv_cache_dtype="int8")
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0,
                                                                                      max_tokens=MAX_TOKENS))]
    del llm
    stack = GrpcStack("random:tiny", decode_extra=[[]], engine_flags=INT8_FLAGS).wait_ready()
    try:
        async def run():
            return await asyncio.gather(*(generate(stack.address, p, temperature=0.0, max_tokens=MAX_TOKENS)
                                          for p in PROMPTS))

        got = asyncio.run(run())
        for p, exp, (toks, _, reason, resps) in zip(PROMPTS, expected, got):
            assert toks == exp, p
            assert reason == common_pb2.FINISH_REASON_LENGTH and len(resps) >= 2  # prefill's token, then decode's
        loads = asyncio.run(wait_idle(stack))
        assert all(x.num_used_blocks == 0 and x.num_tracked_requests == 0 for x in loads), loads
    finally:
        stack.stop()
