"""The prefill service in-process (a real engine, real gRPC on loopback), alone and with a real decode service in the
same process: first tokens, freed blocks on every ending, transfer failures."""
from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from decode_svc.core import DecodeCore
from decode_svc.servicer import add_to_server
from engine import LLM, EngineArgs, LLMEngine, SamplingParams
from engine.metrics import Metrics
from prefill_svc.core import PrefillCore
from prefill_svc.servicer import PrefillServicer
from protos.runtime import new_server
from protos.tandem.v1 import (common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc)

ARGS = dict(model="random:tiny", device="cpu", num_gpu_blocks_override=256, max_model_len=1024, block_size=16,
            max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def engines():
    return LLMEngine.from_engine_args(EngineArgs(**ARGS)), LLMEngine.from_engine_args(EngineArgs(**ARGS))


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(engines, scenario):
    async def main():
        pcore = PrefillCore(engines[0], Metrics("random:tiny", "prefill"), default_kv_timeout_s=5)
        dcore = DecodeCore(engines[1], Metrics("random:tiny", "decode"))
        await pcore.start()
        await dcore.start()
        ps, ds = new_server(), new_server()
        prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(pcore), ps)
        add_to_server(dcore, ds)
        pa, da = f"127.0.0.1:{port()}", f"127.0.0.1:{port()}"
        ps.add_insecure_port(pa)
        ds.add_insecure_port(da)
        await ps.start()
        await ds.start()
        try:
            async with grpc.aio.insecure_channel(pa) as pch, grpc.aio.insecure_channel(da) as dch:
                return await scenario(prefill_pb2_grpc.PrefillStub(pch), decode_pb2_grpc.DecodeStub(dch), da)
        finally:
            await ps.stop(0)
            await ds.stop(0)
            await pcore.close()
            await dcore.close()
    return asyncio.run(main())


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
                    request_id="c", prompt_token_ids=PROMPT, params=params(), decode_address=f"127.0.0.1:{port()}")):
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
