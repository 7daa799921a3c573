"""The decode service in-process (a real engine, a real gRPC server on loopback), driven the way a prefill instance
and the router drive it: reservations, refusals, layout checks, deadlines. No block may stay allocated."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

import kv_transfer.grpc_bytes as grpc_bytes
from decode_svc.servicer import DecodeServicer, add_to_server
from kv_transfer.grpc_bytes import KvBlocksOut, StagedBlocks
from kv_transfer.layout import block_rows, layout_of
from protos.tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kv_transfer_pb2 as kv
from decode_one import idle, run_decode


def run(engine, scenario, register=add_to_server):
    return run_decode(engine, scenario, register)


def decode_req(rid, n_tokens, timeout_ms=10_000, **params):
    return decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=[3] * n_tokens,
                                    params=common_pb2.SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **params}),
                                    kv_transfer_timeout_ms=timeout_ms)


def test_reserve_refuse_and_cancel(engine):
    async def scenario(stub, core):
        big = stub.Decode(decode_req("big", 1000))
        assert (await big.read()).reserved.num_blocks == 63
        assert (await stub.GetLoad(common_pb2.GetLoadRequest())).num_used_blocks == 63
        small = stub.Decode(decode_req("small", 1000))
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await small.read()
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        big.cancel()
        return await idle(stub)

    assert run(engine, scenario).num_used_blocks == 0


def test_a_reservation_is_refused_while_the_admitted_requests_growth_needs_the_blocks(engine):
    # The admission watermark (engine/scheduler.py): "a" holds 32 of the 64 blocks and is expected to grow by
    # 0.7 x 400 tokens (17 blocks); "b" needs 19 blocks for its prompt and 20 at its end, more than the 15 left
    # beyond a's growth, although 32 are free. Once a is gone, b is granted.
    async def scenario(stub, core):
        a = stub.Decode(decode_req("a", 500, max_tokens=400))
        assert (await a.read()).reserved.num_blocks == 32
        b = stub.Decode(decode_req("b", 300))
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await b.read()
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (await stub.GetLoad(common_pb2.GetLoadRequest())).num_used_blocks == 32
        a.cancel()
        await idle(stub)
        b = stub.Decode(decode_req("b2", 300))
        assert (await b.read()).reserved.num_blocks == 19
        b.cancel()
        return await idle(stub)

    assert run(engine, scenario).num_used_blocks == 0
    assert not engine.kv.req_to_hashes, "a refused reservation left its block hashes behind"


def test_deadline_frees_a_stalled_partial_transfer(engine):
    async def scenario(stub, core):
        call = stub.Decode(decode_req("r", 40, timeout_ms=500))
        assert (await call.read()).reserved.num_blocks == 3
        layout = layout_of(engine.kv_cache)
        q: asyncio.Queue = asyncio.Queue()

        async def messages():
            while (m := await q.get()) is not None:
                yield m

        transfer = stub.TransferKv(messages())
        q.put_nowait(kv.KvTransferMessage(open=kv.KvTransferOpen(request_id="r", layout=layout, num_prompt_tokens=40,
                                                                  num_blocks=3)))
        q.put_nowait(kv.KvTransferMessage(blocks=kv.KvBlocks(first_block_index=0, num_blocks=1,
                                                             data=bytes(layout.block_bytes))))
        with pytest.raises(grpc.aio.AioRpcError) as ei:  # then nothing: the transfer stalls
            await call.read()
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "reservation was freed" in ei.value.details()
        q.put_nowait(kv.KvTransferMessage(blocks=kv.KvBlocks(first_block_index=1, num_blocks=1,
                                                             data=bytes(layout.block_bytes))))
        with pytest.raises(grpc.aio.AioRpcError) as ei:  # a late block is refused, never written
            await transfer
        assert ei.value.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED)
        return await idle(stub)

    assert run(engine, scenario).num_used_blocks == 0


@pytest.mark.parametrize("field,change", [
    ("layout.dtype", dict(dtype="float16")), ("layout.block_size", dict(block_size=32)),
    ("layout.num_layers", dict(num_layers=3)), ("layout.num_kv_heads", dict(num_kv_heads=4)),
    ("layout.head_dim", dict(head_dim=64)), ("open.num_blocks", None)])
def test_layout_mismatch_is_refused_naming_the_field(engine, field, change):
    async def scenario(stub, core):
        call = stub.Decode(decode_req("r", 40))
        await call.read()
        layout = layout_of(engine.kv_cache)
        for k, v in (change or {}).items():
            setattr(layout, k, v)
        op = kv.KvTransferOpen(request_id="r", layout=layout, num_prompt_tokens=40, num_blocks=3 if change else 4)

        async def messages():
            yield kv.KvTransferMessage(open=op)

        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.TransferKv(messages())
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.details().startswith(field), ei.value.details()
        with pytest.raises(grpc.aio.AioRpcError):  # the request fails on the router's side too
            await call.read()
        return await idle(stub)

    assert run(engine, scenario).num_used_blocks == 0


def test_transfer_without_reservation_and_bad_first_message(engine):
    async def scenario(stub, core):
        async def only(msg):
            yield msg

        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.TransferKv(only(kv.KvTransferMessage(open=kv.KvTransferOpen(request_id="ghost"))))
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.TransferKv(only(kv.KvTransferMessage(commit=kv.KvTransferCommit(first_token_id=1))))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Decode(decode_req("x", 10, temperature=-1.0)).read()
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and ei.value.details().startswith("temperature")
        return await idle(stub)

    assert run(engine, scenario).num_used_blocks == 0


def test_full_transfer_commits_and_generates(engine):
    """KV of zeros is a valid (if meaningless) prompt cache: the request joins the batch and finishes."""
    async def scenario(stub, core):
        call = stub.Decode(decode_req("r", 20, ignore_eos=True))
        await call.read()
        layout = layout_of(engine.kv_cache)

        async def messages():
            yield kv.KvTransferMessage(open=kv.KvTransferOpen(request_id="r", layout=layout, num_prompt_tokens=20,
                                                              num_blocks=2))
            yield kv.KvTransferMessage(blocks=kv.KvBlocks(first_block_index=0, num_blocks=2,
                                                          data=bytes(2 * layout.block_bytes)))
            yield kv.KvTransferMessage(commit=kv.KvTransferCommit(first_token_id=65))

        ack = await stub.TransferKv(messages())
        assert ack.num_blocks == 2 and ack.received_bytes == 2 * layout.block_bytes
        toks, reason = [], 0
        while (r := await call.read()) is not grpc.aio.EOF:
            toks += r.delta.token_ids
            reason = r.delta.finish_reason or reason
        assert len(toks) == 7 and reason == common_pb2.FINISH_REASON_LENGTH  # 8 minus the first, from prefill
        return await idle(stub)

    assert run(engine, scenario).num_used_blocks == 0


def generated_registration(core, server):
    decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(core), server)


@pytest.mark.parametrize("register", [add_to_server, generated_registration])
@pytest.mark.parametrize("window", [None, 1])  # the default write window; one write at a time
def test_blocks_arrive_bit_exact(engine, monkeypatch, register, window):
    """Blocks in any order and run length, as pre-serialized KvBlocks (parsed without a copy by add_to_server's
    deserializer, or by protobuf under the generated registration) land bit-exact in the reserved blocks."""
    if window is not None:
        monkeypatch.setattr(grpc_bytes, "WRITE_WINDOW_BYTES", window)
    layout = layout_of(engine.kv_cache)
    data = torch.randint(0, 256, (4, layout.block_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))

    async def scenario(stub, core):
        call = stub.Decode(decode_req("r", 64, max_tokens=40, ignore_eos=True))
        assert (await call.read()).reserved.num_blocks == 4
        ids = core._reqs["r"].block_ids

        async def messages():
            yield kv.KvTransferMessage(open=kv.KvTransferOpen(request_id="r", layout=layout, num_prompt_tokens=64,
                                                              num_blocks=4))
            for first, n in ((3, 1), (0, 2), (2, 1)):
                yield KvBlocksOut(first, n, n * layout.block_bytes, StagedBlocks([data[first:first + n]]))
            yield kv.KvTransferMessage(commit=kv.KvTransferCommit(first_token_id=65))

        ack = await stub.transfer_kv(messages())
        assert ack.num_blocks == 4 and ack.received_bytes == 4 * layout.block_bytes
        got = await core.worker.call(lambda eng: block_rows(eng.kv_cache)[ids].clone())
        while await call.read() is not grpc.aio.EOF:
            pass
        return got, await idle(stub)

    got, load = run(engine, scenario, register)
    assert torch.equal(got, data) and load.num_used_blocks == 0


def test_a_reused_prefix_is_not_written():
    """With prefix caching, a prompt whose first 64 tokens an earlier transferred prompt had shares those 4 blocks
    (they were cached at its commit): the transfer still carries them (the prefill cannot know), but only the fifth
    block is written; the shared ones keep their contents, which running requests may be reading."""
    from engine import EngineArgs, LLMEngine
    from decode_one import ARGS

    engine = LLMEngine.from_engine_args(EngineArgs(**ARGS))
    layout = layout_of(engine.kv_cache)
    gen = torch.Generator().manual_seed(2)
    first = torch.randint(0, 256, (4, layout.block_bytes), dtype=torch.uint8, generator=gen)
    second = torch.randint(0, 256, (5, layout.block_bytes), dtype=torch.uint8, generator=gen)

    async def transfer(stub, rid, n_tokens, data):
        call = stub.Decode(decode_req(rid, n_tokens, max_tokens=2, ignore_eos=True))
        assert (await call.read()).reserved.num_blocks == data.shape[0]

        async def messages():
            yield kv.KvTransferMessage(open=kv.KvTransferOpen(request_id=rid, layout=layout,
                                                              num_prompt_tokens=n_tokens, num_blocks=data.shape[0]))
            yield KvBlocksOut(0, data.shape[0], data.numel(), StagedBlocks([data]))
            yield kv.KvTransferMessage(commit=kv.KvTransferCommit(first_token_id=65))

        return call, await stub.transfer_kv(messages())

    async def scenario(stub, core):
        call, _ = await transfer(stub, "a", 64, first)
        ids_a = core._reqs["a"].block_ids
        while await call.read() is not grpc.aio.EOF:
            pass
        call, ack = await transfer(stub, "b", 80, second)  # [3] * 80: the 64 of "a" and one more block
        d = core._reqs["b"]
        got = await core.worker.call(lambda eng: block_rows(eng.kv_cache)[d.block_ids].clone())
        while await call.read() is not grpc.aio.EOF:
            pass
        return ids_a, d.block_ids, d.num_reused, ack, got, await idle(stub)

    ids_a, ids_b, reused, ack, got, load = run(engine, scenario)
    assert reused == 4 and ids_b[:4] == ids_a and ack.num_blocks == 5
    assert torch.equal(got[:4], first) and torch.equal(got[4], second[4])  # the shared four kept "a"'s bytes
    assert load.num_used_blocks == 0


def test_a_failed_write_fails_the_transfer_and_frees(engine, monkeypatch):
    calls = []

    def write_blocks(kv_cache, block_ids, data):
        calls.append(block_ids)
        if len(calls) == 2:
            raise RuntimeError("copy failed")

    monkeypatch.setattr(grpc_bytes, "write_blocks", write_blocks)
    layout = layout_of(engine.kv_cache)

    async def scenario(stub, core):
        call = stub.Decode(decode_req("r", 48))
        await call.read()

        async def messages():
            yield kv.KvTransferMessage(open=kv.KvTransferOpen(request_id="r", layout=layout, num_prompt_tokens=48,
                                                              num_blocks=3))
            for i in range(3):
                yield kv.KvTransferMessage(blocks=kv.KvBlocks(first_block_index=i, num_blocks=1,
                                                              data=bytes(layout.block_bytes)))
            yield kv.KvTransferMessage(commit=kv.KvTransferCommit(first_token_id=65))

        with pytest.raises(grpc.aio.AioRpcError) as transfer_error:
            await stub.TransferKv(messages())
        with pytest.raises(grpc.aio.AioRpcError) as decode_error:
            await call.read()
        return transfer_error.value, decode_error.value, await idle(stub)

    transfer_error, decode_error, load = run(engine, scenario)
    assert transfer_error.code() == grpc.StatusCode.INTERNAL and "copy failed" in transfer_error.details()
    assert decode_error.code() == grpc.StatusCode.ABORTED and "copy failed" in decode_error.details()
    assert load.num_used_blocks == 0


def test_malformed_protobuf_is_invalid_argument_and_frees_the_reservation(engine):
    """Bytes that are no KvTransferMessage after a valid open: the transfer and its Decode call fail with
    INVALID_ARGUMENT, the reservation is freed, and a unary call with garbage gets the same code."""
    truncated = b"\x0a\x05ab"  # field 1, length 5, two bytes

    async def scenario(stub, core):
        call = stub.Decode(decode_req("m", 20))
        await call.read()
        layout = layout_of(engine.kv_cache)
        raw = stub.channel.stream_unary("/tandem.v1.Decode/TransferKv", request_serializer=lambda b: b,
                                        response_deserializer=kv.KvTransferAck.FromString)

        async def messages():
            yield kv.KvTransferMessage(open=kv.KvTransferOpen(request_id="m", layout=layout, num_prompt_tokens=20,
                                                              num_blocks=2)).SerializeToString()
            yield truncated

        with pytest.raises(grpc.aio.AioRpcError) as transfer:
            await raw(messages())
        with pytest.raises(grpc.aio.AioRpcError) as decode:
            await call.read()
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await stub.channel.unary_unary("/tandem.v1.Decode/KvHandshake", request_serializer=lambda b: b,
                                                        response_deserializer=lambda b: b)(truncated)
        return transfer.value, decode.value, unary.value, await idle(stub)

    transfer, decode, unary, load = run(engine, scenario)
    assert transfer.code() == grpc.StatusCode.INVALID_ARGUMENT, transfer
    assert transfer.details().startswith("tandem.v1.Decode.TransferKv: tandem.v1.KvTransferMessage: not a valid message")
    assert decode.code() == grpc.StatusCode.ABORTED and "not a valid message" in decode.details(), decode
    assert unary.code() == grpc.StatusCode.INVALID_ARGUMENT and "KvHandshakeRequest" in unary.details(), unary
    assert load.num_used_blocks == 0 and load.num_tracked_requests == 0
