"""The prefill service in-process (a real engine, real gRPC on loopback), alone and with a real decode service in the
same process: first tokens, freed blocks on every ending, transfer failures."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from engine import LLM, SamplingParams
from protos.tandem.v1 import common_pb2, decode_pb2, prefill_pb2
from svc_pair import ARGS, free_port, run_pair


def run(engines, scenario):
    return run_pair(engines, lambda pcore, *stubs: scenario(*stubs), default_kv_timeout_s=5)


async def idle(*stubs):
    for _ in range(100):
        loads = [await s.GetLoad(common_pb2.GetLoadRequest()) for s in stubs]
        if all(x.num_used_blocks == 0 and x.num_tracked_requests == 0 for x in loads):
            break
        await asyncio.sleep(0.05)
    return loads


def params(**kw):
    return common_pb2.SamplingParams(**{"temperature": 0.0, "max_tokens": 6, **kw})


PROMPT = list(range(20, 120))  # 100 tokens: 4 chunks of 32, 7 blocks


def test_prefill_without_decode_target_returns_first_token_and_frees(engines):
    expected = LLM(**ARGS).generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=1))

    async def scenario(pstub, dstub, daddr):
        resps = [r async for r in pstub.Prefill(prefill_pb2.PrefillRequest(
            request_id="a", prompt_token_ids=PROMPT, params=params(max_tokens=1)))]
        return resps, await idle(pstub)

    resps, loads = run(engines, scenario)
    assert len(resps) == 1 and resps[0].HasField("first_token")
    ft = resps[0].first_token
    assert list(ft.delta.token_ids) == expected[0].outputs[0].token_ids
    assert ft.delta.finish_reason == common_pb2.FINISH_REASON_LENGTH and ft.num_prompt_tokens == 100
    assert loads[0].num_used_blocks == 0


def test_prefill_to_decode_streams_all_blocks_and_matches_offline(engines):
    expected = LLM(**ARGS).generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=6))

    async def scenario(pstub, dstub, daddr):
        dcall = dstub.Decode(decode_pb2.DecodeRequest(request_id="b", prompt_token_ids=PROMPT, params=params()))
        await dcall.read()
        resps = [r async for r in pstub.Prefill(prefill_pb2.PrefillRequest(
            request_id="b", prompt_token_ids=PROMPT, params=params(), decode_address=daddr))]
        toks = list(resps[0].first_token.delta.token_ids)
        while (r := await dcall.read()) is not grpc.aio.EOF:
            toks += r.delta.token_ids
        return resps, toks, await idle(pstub, dstub)

    resps, toks, loads = run(engines, scenario)
    assert resps[0].first_token.delta.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    done = resps[1].transfer_done
    assert done.num_blocks == 7 and done.transfer_bytes == 7 * engines[0].kv_cache[0].numel() * engines[0].kv_cache.element_size()
    assert toks == expected[0].outputs[0].token_ids
    assert all(x.num_used_blocks == 0 for x in loads)


def test_unreachable_decode_fails_the_request_and_frees(engines):
    async def scenario(pstub, dstub, daddr):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in pstub.Prefill(prefill_pb2.PrefillRequest(
                    request_id="c", prompt_token_ids=PROMPT, params=params(), decode_address=f"127.0.0.1:{free_port()}")):
                pass
        return ei.value, await idle(pstub)

    err, loads = run(engines, scenario)
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "kv transfer" in err.details()
    assert loads[0].num_used_blocks == 0


def test_decode_without_reservation_fails_the_request(engines):
    async def scenario(pstub, dstub, daddr):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in pstub.Prefill(prefill_pb2.PrefillRequest(
                    request_id="d", prompt_token_ids=PROMPT, params=params(), decode_address=daddr)):
                pass
        return ei.value, await idle(pstub, dstub)

    err, loads = run(engines, scenario)
    assert err.code() == grpc.StatusCode.NOT_FOUND and "no reservation" in err.details()
    assert all(x.num_used_blocks == 0 for x in loads)


def test_bad_params_and_cancel(engines):
    async def scenario(pstub, dstub, daddr):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in pstub.Prefill(prefill_pb2.PrefillRequest(request_id="e", prompt_token_ids=PROMPT,
                                                                    params=params(top_p=2.0))):
                pass
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and ei.value.details().startswith("top_p")
        call = pstub.Prefill(prefill_pb2.PrefillRequest(request_id="f", prompt_token_ids=list(range(1, 900)),
                                                        params=params()))
        await asyncio.sleep(0.05)
        call.cancel()
        return await idle(pstub, dstub)

    loads = run(engines, scenario)
    assert all(x.num_used_blocks == 0 and x.num_tracked_requests == 0 for x in loads)
