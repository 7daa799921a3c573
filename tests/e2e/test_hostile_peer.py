"""A hostile peer inside the mesh, end to end (`tandem up`: real router, prefill and decode processes): while
legitimate streams run through the router, a peer talks to the workers' ports directly and sends a forged commit
with a token outside the vocabulary, oversized transfer deadlines, a decode address the prefill may not reach,
ids and addresses too long to log, and a resumed request's prior tokens outside the vocabulary or too many. Each
forged request fails alone with INVALID_ARGUMENT naming the field; the legitimate streams produce the tokens an
undisturbed offline run gives; no block stays held."""
from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from engine import LLM, SamplingParams
from kv_transfer.layout import layout_of
from protos.tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kv_transfer_pb2 as kv, prefill_pb2
from protos.tandem.v1 import prefill_pb2_grpc
from stack import Stack

PROMPTS = [[5 + i, 17, 99, 250, 3, 42] * 4 for i in range(4)]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def tiny():
    return LLM(model="random:tiny", device="cpu")


@pytest.fixture(scope="module")
def stack():
    s = Stack("--model", "random:tiny", prefill=1, decode=1).wait_ready()
    yield s
    s.stop()


def _addr(stack, name: str) -> str:
    return f"127.0.0.1:{stack.worker_ports[name]}"


async def _legit(http: httpx.AsyncClient, prompt: list[int]) -> list[int]:
    r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                 "ignore_eos": True, "logprobs": 0,
                                                 "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


async def _code(awaitable) -> tuple[grpc.StatusCode, str] | str:
    try:
        await awaitable
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    return "OK"


async def _forged_commit(decode: decode_pb2_grpc.DecodeStub, layout) -> tuple:
    """A reservation of our own, its blocks sent right, then a commit with first_token_id = 10**9."""
    call = decode.Decode(decode_pb2.DecodeRequest(request_id="evil-commit", prompt_token_ids=[3] * 20,
                                                  params=common_pb2.SamplingParams(max_tokens=8),
                                                  kv_transfer_timeout_ms=20_000))
    assert (await call.read()).HasField("reserved")

    async def messages():
        yield kv.KvTransferMessage(open=kv.KvTransferOpen(request_id="evil-commit", layout=layout,
                                                          num_prompt_tokens=20, num_blocks=2))
        yield kv.KvTransferMessage(blocks=kv.KvBlocks(first_block_index=0, num_blocks=2,
                                                      data=bytes(2 * layout.block_bytes)))
        yield kv.KvTransferMessage(commit=kv.KvTransferCommit(first_token_id=10**9))

    transfer = await _code(decode.TransferKv(messages()))
    stream = await _code(call.read())
    return transfer, stream


async def _hostile(stack, layout) -> dict:
    async with grpc.aio.insecure_channel(_addr(stack, "decode-0")) as dch, \
            grpc.aio.insecure_channel(_addr(stack, "prefill-0")) as pch:
        decode, prefill = decode_pb2_grpc.DecodeStub(dch), prefill_pb2_grpc.PrefillStub(pch)

        async def first(call):
            return await call.read()

        def prefill_req(**kw):
            base = dict(request_id="evil-prefill", prompt_token_ids=[3] * 20,
                        params=common_pb2.SamplingParams(max_tokens=8))
            return prefill_pb2.PrefillRequest(**{**base, **kw})

        out = {"commit": await _forged_commit(decode, layout)}
        out["decode timeout"] = await _code(first(decode.Decode(decode_pb2.DecodeRequest(
            request_id="evil-timeout", prompt_token_ids=[3] * 20, kv_transfer_timeout_ms=4_000_000_000))))
        out["prefill timeout"] = await _code(first(prefill.Prefill(prefill_req(
            decode_address=_addr(stack, "decode-0"), kv_transfer_timeout_ms=4_000_000_000))))
        # A loopback address nothing listens on and that is not the prefill's decode instance: refused undialled.
        out["foreign decode"] = await _code(first(prefill.Prefill(prefill_req(decode_address="127.0.0.2:9"))))
        out["long address"] = await _code(first(prefill.Prefill(prefill_req(decode_address="x" * 5000 + ":1"))))
        out["long id"] = await _code(first(decode.Decode(decode_pb2.DecodeRequest(
            request_id="i" * 5000, prompt_token_ids=[3] * 20))))
        # A resumed request's prior tokens (a moved stream's), forged: outside the vocabulary, or too many.
        out["prior vocab"] = await _code(first(decode.Decode(decode_pb2.DecodeRequest(
            request_id="evil-prior", prompt_token_ids=[3] * 20, params=common_pb2.SamplingParams(max_tokens=8),
            prior_output_token_ids=[5, 10**6], prefill_locally=True))))
        out["prior length"] = await _code(first(prefill.Prefill(prefill_req(
            decode_address=_addr(stack, "decode-0"), prior_output_token_ids=[5] * 100_000))))
        loads = [await decode.GetLoad(common_pb2.GetLoadRequest()), await prefill.GetLoad(common_pb2.GetLoadRequest())]
        return {**out, "loads": loads}


def test_forged_messages_fail_alone_and_legit_streams_are_exact(stack, tiny):
    expected = [o.outputs[0].token_ids for o in tiny.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                   ignore_eos=True))]
    layout = layout_of(tiny.engine.kv_cache)

    async def main():
        async with httpx.AsyncClient(base_url=stack.http, timeout=120) as http:
            legit = [asyncio.create_task(_legit(http, p)) for p in PROMPTS]
            await asyncio.sleep(0.3)  # (the forgeries land while the legitimate requests are in flight or queued)
            hostile = await _hostile(stack, layout)
            return await asyncio.gather(*legit), hostile

    got, hostile = asyncio.run(main())
    assert got == expected  # no legitimate request noticed anything
    bad = grpc.StatusCode.INVALID_ARGUMENT
    (tcode, tmsg), (scode, smsg) = hostile["commit"]
    assert tcode == bad and tmsg.startswith("commit.first_token_id=1000000000: outside the vocabulary"), tmsg
    assert scode == bad and "first_token_id" in smsg, smsg
    for key, field in (("decode timeout", "kv_transfer_timeout_ms=4000000000: must be at most"),
                       ("prefill timeout", "kv_transfer_timeout_ms=4000000000: must be at most"),
                       ("foreign decode", "decode_address='127.0.0.2:9': not a decode instance this prefill may"),
                       ("long address", "decode_address: 5002 characters, must be at most 256"),
                       ("long id", "request_id: 5000 characters, must be at most 256"),
                       ("prior vocab", "prior_output_token_ids: token id 1000000 is outside the vocabulary"),
                       ("prior length", "prior_output_token_ids: 100000 tokens, must be fewer than max_tokens=8")):
        code, msg = hostile[key]
        assert code == bad and msg.startswith(field), (key, msg)
    # The forgeries hold nothing (legitimate requests may still be finishing: only blocks beyond theirs count).
    for load in hostile["loads"]:
        assert load.num_tracked_requests <= len(PROMPTS), load


def test_nothing_is_held_afterwards(stack):
    async def main():
        for _ in range(100):
            loads = []
            for name in ("decode-0", "prefill-0"):
                async with grpc.aio.insecure_channel(_addr(stack, name)) as ch:
                    stub = (decode_pb2_grpc.DecodeStub if name.startswith("decode") else prefill_pb2_grpc.PrefillStub)
                    loads.append(await stub(ch).GetLoad(common_pb2.GetLoadRequest()))
            if all(x.num_used_blocks == 0 and x.num_tracked_requests == 0 for x in loads):
                return loads
            await asyncio.sleep(0.1)
        return loads

    assert all(x.num_used_blocks == 0 and x.num_tracked_requests == 0 for x in asyncio.run(main()))
