"""The decode service's side of the CUDA IPC negotiation, on the CPU (a real engine and gRPC server on loopback):
the handshake answers GRPC with the reason, an open that insists on CUDA_IPC is refused naming the field, and the
two paths' messages cannot be mixed. No block may stay allocated."""
from __future__ import annotations

import grpc
import pytest

from kv_transfer.cuda_ipc import host_identity
from kv_transfer.layout import layout_of
from protos.tandem.v1 import common_pb2, decode_pb2, kv_transfer_pb2 as kv
from decode_one import idle, run_decode


def run(engine, scenario):
    return run_decode(engine, lambda stub, core: scenario(stub))


def offer() -> kv.CudaIpcCache:
    """What a GPU prefill process on this host would offer (another process: its own process_id)."""
    peer = host_identity()
    peer.process_id, peer.gpu_uuids[:] = "another-process", ["GPU-test"]
    return kv.CudaIpcCache(host=peer, device_uuid="GPU-test", mem_handle=b"\x01" * 64, storage_size_bytes=1 << 20,
                           num_blocks=4)


def reserve(stub, rid, n_tokens):
    return stub.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=[3] * n_tokens,
                                                params=common_pb2.SamplingParams(temperature=0.0, max_tokens=4),
                                                kv_transfer_timeout_ms=10_000))


def test_handshake_answers_grpc_with_the_reason(engine):
    async def scenario(stub):
        layout = layout_of(engine.kv_cache)
        with_cache = await stub.KvHandshake(kv.KvHandshakeRequest(host=host_identity(), layout=layout,
                                                                  cache=offer()))
        without = await stub.KvHandshake(kv.KvHandshakeRequest(host=host_identity(), layout=layout))
        return with_cache, without

    with_cache, without = run(engine, scenario)
    assert with_cache.path == kv.KV_TRANSFER_PATH_GRPC
    assert with_cache.reason == "this instance's KV cache is on cpu, not a CUDA device"
    assert with_cache.host.boot_id == host_identity().boot_id and with_cache.host.process_id
    assert without.path == kv.KV_TRANSFER_PATH_GRPC and "KV cache is on cpu" in without.reason


@pytest.mark.parametrize("field, value, shown", [("num_layers", 3, "3"), ("dtype", "int8", "'int8'"),
                                                 ("block_size", 32, "32")])
def test_a_cache_of_another_layout_is_refused_at_the_handshake(engine, field, value, shown):
    """No path carries blocks between caches of two layouts (an int8 prefill cache into a bf16 one, say): the
    handshake itself is FAILED_PRECONDITION naming the field and both values, with or without a CUDA IPC offer."""
    async def scenario(stub):
        wrong = kv.KvLayout()
        wrong.CopyFrom(layout_of(engine.kv_cache))
        setattr(wrong, field, value if field != "num_layers" else wrong.num_layers + 1)
        codes = []
        for cache in (offer(), None):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.KvHandshake(kv.KvHandshakeRequest(host=host_identity(), layout=wrong, cache=cache))
            codes.append((ei.value.code(), ei.value.details()))
        return codes

    mine = getattr(layout_of(engine.kv_cache), field)
    for code, details in run(engine, scenario):
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert details.startswith(f"layout.{field}={shown}: this decode instance's KV cache has {field}={mine!r}")
        assert "--kv-cache-dtype" in details


def test_an_ipc_open_on_a_cpu_cache_is_refused_and_frees(engine):
    async def scenario(stub):
        call = reserve(stub, "r", 40)
        assert (await call.read()).reserved.num_blocks == 3
        op = kv.KvTransferOpen(request_id="r", layout=layout_of(engine.kv_cache), num_prompt_tokens=40, num_blocks=3,
                               path=kv.KV_TRANSFER_PATH_CUDA_IPC, cache=offer())

        async def messages():
            yield kv.KvTransferMessage(open=op)
            yield kv.KvTransferMessage(ready=kv.KvBlocksReady(first_block_index=0, block_ids=[0, 1, 2]))

        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.TransferKv(messages())
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert ei.value.details() == "open.path=CUDA_IPC: this instance's KV cache is on cpu, not a CUDA device"
        with pytest.raises(grpc.aio.AioRpcError) as ei:  # the Decode call fails with the same status
            await call.read()
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        return await idle(stub)

    assert run(engine, scenario).num_used_blocks == 0


def test_the_paths_messages_do_not_mix(engine):
    async def scenario(stub):
        call = reserve(stub, "m", 20)
        await call.read()
        layout = layout_of(engine.kv_cache)

        async def messages():
            yield kv.KvTransferMessage(open=kv.KvTransferOpen(request_id="m", layout=layout, num_prompt_tokens=20,
                                                              num_blocks=2, path=kv.KV_TRANSFER_PATH_GRPC))
            yield kv.KvTransferMessage(ready=kv.KvBlocksReady(first_block_index=0, block_ids=[5, 6]))

        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.TransferKv(messages())
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.details() == ("ready: this transfer opened with path=KV_TRANSFER_PATH_GRPC, which sends "
                                      "`blocks` messages")
        return await idle(stub)

    assert run(engine, scenario).num_used_blocks == 0


def test_an_unset_path_is_grpc_and_the_ack_says_so(engine):
    async def scenario(stub):
        call = reserve(stub, "g", 20)
        await call.read()
        layout = layout_of(engine.kv_cache)

        async def messages():  # a sender that predates the path field
            yield kv.KvTransferMessage(open=kv.KvTransferOpen(request_id="g", layout=layout, num_prompt_tokens=20,
                                                              num_blocks=2))
            yield kv.KvTransferMessage(blocks=kv.KvBlocks(first_block_index=0, num_blocks=2,
                                                          data=bytes(2 * layout.block_bytes)))
            yield kv.KvTransferMessage(commit=kv.KvTransferCommit(first_token_id=65))

        ack = await stub.TransferKv(messages())
        while await call.read() is not grpc.aio.EOF:
            pass
        return ack, await idle(stub)

    ack, load = run(engine, scenario)
    assert ack.path == kv.KV_TRANSFER_PATH_GRPC and ack.received_bytes == 2 * layout_of(engine.kv_cache).block_bytes
    assert load.num_used_blocks == 0
