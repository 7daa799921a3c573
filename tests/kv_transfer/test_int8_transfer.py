"""An int8 KV cache over the gRPC bytes path (in-process prefill and decode services, real gRPC on loopback): each
block's values and scales arrive bit-exact and decode continues as the offline int8 engine; a prefill whose cache
dtype differs from the decode's is refused at the handshake naming the dtype, and neither side keeps a block."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from engine import LLM, EngineArgs, LLMEngine, SamplingParams
from engine.block_pool import hash_block_tokens
from kernels.quant_int8 import int8_cache_views
from kv_transfer.layout import LAYOUT_NAME_INT8, layout_mismatch, layout_of
from protos.tandem.v1 import common_pb2, decode_pb2, prefill_pb2
from svc_pair import ARGS, run_pair

PROMPT = list(range(20, 120))  # 100 tokens: 4 chunks of 32, 7 blocks
INT8 = {**ARGS, "kv_cache_dtype": "int8"}


def params(**kw):
    return common_pb2.SamplingParams(**{"temperature": 0.0, "max_tokens": 6, **kw})


async def idle(*stubs):
    for _ in range(200):
        loads = [await s.GetLoad(common_pb2.GetLoadRequest()) for s in stubs]
        if all(x.num_used_blocks == 0 and x.num_tracked_requests == 0 for x in loads):
            break
        await asyncio.sleep(0.05)
    return loads


def test_int8_layout_names_the_block_format():
    lay = layout_of(torch.zeros(3, 2, 2, 16, 2, 16 + 4, dtype=torch.int8))
    assert (lay.dtype, lay.layout, lay.head_dim, lay.block_bytes) == ("int8", LAYOUT_NAME_INT8, 16, 2 * 2 * 16 * 2 * 20)
    assert LAYOUT_NAME_INT8 == "block_layer_kv_token_head_dim_then_scales_head_token"
    # A process of the earlier row layout (each row's values, then its scale) names its blocks otherwise, with the
    # same sizes: either side refuses the other by that name alone.
    old = type(lay)()
    old.CopyFrom(lay)
    old.layout = "block_layer_kv_token_head_dim_scale"
    assert layout_mismatch(lay, old) == ("layout.layout='block_layer_kv_token_head_dim_scale': this decode "
                                         "instance's KV cache has layout='" + LAYOUT_NAME_INT8 + "'")


@pytest.mark.slow
def test_int8_blocks_and_scales_arrive_bit_exact():
    engines = LLMEngine.from_engine_args(EngineArgs(**INT8)), LLMEngine.from_engine_args(EngineArgs(**INT8))
    expected = LLM(**INT8).generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=6))

    async def scenario(pcore, pstub, dstub, daddr):
        dcall = dstub.Decode(decode_pb2.DecodeRequest(request_id="b", prompt_token_ids=PROMPT, params=params()))
        await dcall.read()
        resps = []
        async for r in pstub.Prefill(prefill_pb2.PrefillRequest(request_id="b", prompt_token_ids=PROMPT,
                                                                params=params(), decode_address=daddr)):
            resps.append(r)
        toks = list(resps[0].first_token.delta.token_ids)
        while (r := await dcall.read()) is not grpc.aio.EOF:
            toks += r.delta.token_ids
        return resps, toks, await idle(pstub, dstub)

    resps, toks, loads = run_pair(engines, scenario, default_kv_timeout_s=10)
    done = resps[1].transfer_done
    assert done.num_blocks == 7 and done.transfer_bytes == 7 * engines[0].runner.kv_bytes_per_block
    assert toks == expected[0].outputs[0].token_ids
    # Both pools keep the prompt's 6 full blocks in their prefix caches (freed, not cleared), under the same
    # block hashes: their bytes, values and scales, are equal on both sides.
    hashes, parent = [], None
    for i in range(6):
        parent = hash_block_tokens(parent, PROMPT[i * 16:(i + 1) * 16])
        hashes.append(parent)
    pre, dec = engines
    pre_ids = [pre.kv.pool.get_cached_block(h) for h in hashes]
    dec_ids = [dec.kv.pool.get_cached_block(h) for h in hashes]
    assert None not in pre_ids and None not in dec_ids
    assert torch.equal(pre.kv_cache[pre_ids], dec.kv_cache[dec_ids])
    scales = int8_cache_views(dec.kv_cache[dec_ids])[1]
    assert (scales > 0).all()  # every slot of a full block was written, with its own scale
    assert all(x.num_used_blocks == 0 for x in loads)


@pytest.mark.parametrize("decode_dtype", ["auto", "fp8"])
def test_a_dtype_mismatch_is_refused_at_the_handshake(decode_dtype):
    """The decode instance refuses the int8 prefill cache at the handshake (FAILED_PRECONDITION naming the dtype):
    the prefill fails the request before computing it (its engine never saw the prompt), the router's cancel of the
    reservation frees it, and neither side keeps a block. A transfer opened anyway (a sender that skipped the
    handshake) is INVALID_ARGUMENT naming the same field (tests/decode_svc/test_decode_service.py)."""
    engines = (LLMEngine.from_engine_args(EngineArgs(**INT8)),
               LLMEngine.from_engine_args(EngineArgs(**{**ARGS, "kv_cache_dtype": decode_dtype})))

    async def scenario(pcore, pstub, dstub, daddr):
        dcall = dstub.Decode(decode_pb2.DecodeRequest(request_id="m", prompt_token_ids=PROMPT, params=params()))
        await dcall.read()
        errors = []
        for _ in range(2):  # a refusal is not kept: each request asks again, and is refused again
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                async for _ in pstub.Prefill(prefill_pb2.PrefillRequest(request_id="m", prompt_token_ids=PROMPT,
                                                                        params=params(), decode_address=daddr)):
                    pass
            errors.append(ei.value)
        dcall.cancel()  # what the router does when the prefill fails
        return errors, await idle(pstub, dstub)

    errors, loads = run_pair(engines, scenario, default_kv_timeout_s=10)
    want = "float32" if decode_dtype == "auto" else "float8_e4m3fn"
    for err in errors:
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, (err.code(), err.details())
        assert f"layout.dtype='int8': this decode instance's KV cache has dtype='{want}'" in err.details()
        assert "--kv-cache-dtype" in err.details()
    assert engines[0].stats().prefix_cache_queries == 0  # the prompt never reached the prefill engine
    assert all(x.num_used_blocks == 0 and x.num_tracked_requests == 0 for x in loads), loads
