"""SmolLM2-135M-Instruct through the public gRPC API (one prefill, one decode, the router as processes): greedy
output equals the offline engine's for the same prompts, with a real tokenizer (multi-byte text deltas)."""
from __future__ import annotations

import asyncio

import pytest

from protos.tandem.v1 import common_pb2

from test_grpc_e2e import GrpcStack, generate, offline_greedy, wait_idle  # noqa: E402 - same directory

FLAGS = ["--device", "cpu", "--kv-cache-memory", "0.25", "--max-num-batched-tokens", "32", "--block-size", "16",
         "--max-model-len", "1024"]
# The second prompt is longer than the token budget (32): prefilled and shipped in chunks.
PROMPTS = ["Café, naïve, 東京 and emoji 🚀 are",
           "Once upon a time, in a land far away, there lived a king who had three daughters. The eldest was"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    s = GrpcStack("smollm2", decode_extra=[[]], engine_flags=FLAGS).wait_ready()
    yield s
    s.stop()


@pytest.mark.slow
def test_smollm2_greedy_matches_offline_engine(smol):
    expected = offline_greedy("smollm2", PROMPTS, MAX_TOKENS, engine_flags=FLAGS)

    async def run():
        return await asyncio.gather(*(generate(smol.address, p, temperature=0.0, max_tokens=MAX_TOKENS)
                                      for p in PROMPTS))

    for p, exp, (toks, text, reason, _) in zip(PROMPTS, expected, asyncio.run(run())):
        assert toks == exp.token_ids, p
        assert text == exp.text, p
        assert reason == {"length": common_pb2.FINISH_REASON_LENGTH, "stop": common_pb2.FINISH_REASON_STOP}[
            exp.finish_reason]
    loads = asyncio.run(wait_idle(smol))
    assert all(x.num_used_blocks == 0 for x in loads), loads
