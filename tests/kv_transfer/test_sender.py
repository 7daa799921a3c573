"""kv_transfer/sender.py: the prefill side's choice of KV transfer path, on the CPU: the --kv-transfer flag, the handshake with a real
decode service (in-process, real gRPC on loopback), and whole transfers on the forced and the automatic path, which
on CPU caches must be the gRPC bytes path (the metrics by path say which one moved the bytes)."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from decode_svc.core import DecodeCore
from decode_svc.servicer import add_to_server
from engine import LLM, SamplingParams
from kv_transfer.base import CUDA_IPC, GRPC
from kv_transfer.cuda_ipc import host_identity
from kv_transfer.grpc_bytes import KvBlocksOut, serialize
from kv_transfer.layout import block_rows
from kv_transfer.sender import CLIENT_WRITE_RACE, KvSender, transfer_failure
from prefill_svc.core import PrefillCore
from prefill_svc.server import ROLE, build_parser
from protos.tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kv_transfer_pb2 as kv, prefill_pb2
from serving.discovery import DiscoveryConfig
from serving.errors import ServiceError
from serving.metrics import Metrics
from serving.rpc import new_server
from svc_pair import ARGS, free_port, run_pair

PROMPT = list(range(20, 120))  # 100 tokens: 7 blocks, prefilled in 4 chunks


def run(engines, kv_transfer, scenario):
    return run_pair(engines, scenario, default_kv_timeout_s=5, kv_transfer=kv_transfer)


def path_bytes(role: str, path: str) -> float:
    return REGISTRY.get_sample_value("tandem:kv_transfer_path_bytes_total",
                                     {"model_name": "random:tiny", "role": role, "path": path}) or 0.0


def test_the_flag_and_its_validation(engines):
    assert build_parser().parse_args([]).kv_transfer == "auto"
    ns = build_parser().parse_args(["--kv-transfer", "grpc"])
    assert ROLE.core_kwargs(ns) == {"kv_transfer": "grpc", "tls": None, "decode_allowlist": None,
                                    "discovery": DiscoveryConfig()}
    ns = build_parser().parse_args(["--decode-allowlist", "a:1, b:2"])
    assert ROLE.core_kwargs(ns)["decode_allowlist"] == ["a:1", "b:2"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv-transfer", "nvlink"])
    with pytest.raises(ValueError, match=r"^kv_transfer='ipc': CUDA IPC needs the KV cache on a CUDA device, this "
                                         r"one is on cpu; use auto or grpc"):
        PrefillCore(engines[0], Metrics("random:tiny", "prefill"), kv_transfer="ipc")
    with pytest.raises(ValueError, match=r"^kv_transfer='nvlink': must be one of auto, grpc, ipc"):
        KvSender(engines[0].kv_cache, "nvlink")
    assert KvSender(engines[0].kv_cache, "auto").cache is None  # a CPU cache offers nothing to map


@pytest.mark.parametrize("kv_transfer", ["grpc", "auto"])
def test_cpu_transfers_take_the_bytes_path(engines, kv_transfer):
    expected = LLM(**ARGS).generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=6))
    before = {(r, p): path_bytes(r, p) for r in ("prefill", "decode") for p in ("grpc", "ipc")}

    async def scenario(pcore, pstub, dstub, daddr):
        params = common_pb2.SamplingParams(temperature=0.0, max_tokens=6)
        dcall = dstub.Decode(decode_pb2.DecodeRequest(request_id="t", prompt_token_ids=PROMPT, params=params))
        await dcall.read()
        resps = [r async for r in pstub.Prefill(prefill_pb2.PrefillRequest(
            request_id="t", prompt_token_ids=PROMPT, params=params, decode_address=daddr))]
        toks = list(resps[0].first_token.delta.token_ids)
        while (r := await dcall.read()) is not grpc.aio.EOF:
            toks += r.delta.token_ids
        loads = [await s.GetLoad(common_pb2.GetLoadRequest()) for s in (pstub, dstub)]
        return resps[1].transfer_done, toks, loads

    done, toks, loads = run(engines, kv_transfer, scenario)
    assert toks == expected[0].outputs[0].token_ids
    assert done.path == kv.KV_TRANSFER_PATH_GRPC and done.num_blocks == 7
    for role in ("prefill", "decode"):
        assert path_bytes(role, "grpc") - before[(role, "grpc")] == done.transfer_bytes
        assert path_bytes(role, "ipc") == before[(role, "ipc")]
    assert all(x.num_used_blocks == 0 for x in loads)


def test_negotiation_with_a_decode_that_cannot_map(engines):
    """A sender that offers a cache (as a GPU prefill does) to a decode service whose cache is on the CPU: auto falls
    back to gRPC and keeps the answer; ipc fails with the decode's reason; forget() asks again."""
    async def scenario(pcore, pstub, dstub, daddr):
        sender = KvSender(engines[0].kv_cache, "auto")
        peer = host_identity()
        sender.cache = kv.CudaIpcCache(host=peer, device_uuid="GPU-test", mem_handle=b"\x01" * 64, num_blocks=4)
        calls = []

        class CountingStub:  # the real stub, counting handshakes
            async def KvHandshake(self, req, timeout):
                calls.append(req)
                return await dstub.KvHandshake(req, timeout=timeout)

        stub = CountingStub()
        auto = [await sender.path_to(daddr, stub) for _ in range(3)]
        sender.kv_transfer = "ipc"
        with pytest.raises(ServiceError) as ei:
            await sender.path_to(daddr, stub)
        sender.forget(daddr)
        sender.kv_transfer = "auto"
        await sender.path_to(daddr, stub)
        return auto, ei.value, len(calls), calls[0]

    auto, err, ncalls, first = run(engines, "auto", scenario)
    assert auto == [GRPC] * 3 and CUDA_IPC not in auto
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert err.message.startswith("--kv-transfer ipc: decode 127.0.0.1:") and err.message.endswith(
        "cannot take CUDA IPC transfers from this instance: this instance's KV cache is on cpu, not a CUDA device")
    assert ncalls == 2  # once, then once more after forget()
    assert first.cache.mem_handle == b"\x01" * 64 and first.layout.block_size == 16


def test_encoded_blocks_are_the_protobuf_messages_bytes(engines):
    """KvBlocksOut (what transfer_kv sends) serializes to the bytes of the KvTransferMessage protos that
    block_messages gives for the generated stub, and counts the same payload."""
    cache = torch.randn(engines[0].kv_cache.shape, generator=torch.Generator().manual_seed(3)).to(
        engines[0].kv_cache.dtype)
    sender = KvSender(cache, "grpc")
    sender.blocks_per_message = 3
    ids = [9, 10, 11, 12, 40, 2, 3]
    encoded = sender.block_messages(cache, GRPC, 5, ids, encoded=True)
    protos = sender.block_messages(cache, GRPC, 5, ids)
    assert [type(m) for m in encoded] == [KvBlocksOut] * 3 and [m.num_blocks for m in encoded] == [3, 3, 1]
    assert [serialize(m) for m in encoded] == [m.SerializeToString() for m in protos]
    assert [sender.payload_bytes(m) for m in encoded] == [sender.payload_bytes(m) for m in protos]
    assert protos[1].blocks.first_block_index == 8 and protos[1].blocks.data == block_rows(cache)[[12, 40, 2]].numpy(
        ).tobytes()
    assert not any(sender.is_commit(m) for m in encoded + protos) and sender.is_commit(sender.commit_message(1, 0))


def test_a_prompts_kv_arrives_bit_exact_through_transfer_kv(engines):
    """The prefill engine's KV of a prompt, sent as KvBlocksOut through KvSender.transfer_kv to a real decode service,
    lands bit-exact in decode's reserved blocks, and decode continues the prompt as the offline engine does."""
    prefill, decode = engines
    expected = LLM(**ARGS).generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=6))

    async def main():
        dcore = DecodeCore(decode, Metrics("random:tiny", "decode"))
        await dcore.start()
        server = new_server()
        add_to_server(dcore, server)
        address = f"127.0.0.1:{free_port()}"
        server.add_insecure_port(address)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                stub = decode_pb2_grpc.DecodeStub(ch)
                call = stub.Decode(decode_pb2.DecodeRequest(request_id="b", prompt_token_ids=PROMPT, params=(
                    common_pb2.SamplingParams(temperature=0.0, max_tokens=6))))
                await call.read()
                prefill.add_request("b", PROMPT, SamplingParams(temperature=0.0, max_tokens=1), kv_hold=True)
                first = None
                while first is None:
                    first = next((o.new_token_ids[0] for o in prefill.step() if o.new_token_ids), None)
                sender = KvSender(prefill.kv_cache, "grpc")
                sender.blocks_per_message = 2
                ids = prefill.get_block_ids("b")[:7]
                sent = prefill.kv_cache[ids].clone()
                decode_ids = dcore._reqs["b"].block_ids

                async def messages():
                    yield sender.open_message("b", len(PROMPT), 7, 10_000, GRPC)
                    for m in sender.block_messages(prefill.kv_cache, GRPC, 0, ids, encoded=True):
                        yield m
                    yield sender.commit_message(first, 0)

                ack = await sender.transfer_kv(ch)(messages())
                received = await dcore.worker.call(lambda eng: eng.kv_cache[decode_ids].clone())
                prefill.abort("b")
                toks = [first]
                while (r := await call.read()) is not grpc.aio.EOF:
                    toks += r.delta.token_ids
                return ack, sent, received, toks, await dcore.load()
        finally:
            await server.stop(0)
            await dcore.close()

    ack, sent, received, toks, load = asyncio.run(main())
    assert ack.num_blocks == 7 and ack.received_bytes == sent.numel() * sent.element_size()
    # [block, layer, k/v, token, ...]: 6 full blocks and the last one's 4 prompt tokens (decode writes the rest)
    as_bytes = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    assert torch.equal(as_bytes(received[:6]), as_bytes(sent[:6]))
    assert torch.equal(as_bytes(received[6, :, :, :4]), as_bytes(sent[6, :, :, :4]))
    assert toks == expected[0].outputs[0].token_ids
    assert load.num_used_blocks == 0


def test_a_write_that_races_the_decodes_refusal_is_aborted_not_internal():
    """gRPC's aio client turns a write that races the server's end of a client stream into INTERNAL "Internal error
    from Core" (the server's status lost); the router would pass INTERNAL on to its client."""
    def failure(code, details):
        return transfer_failure(grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details))

    assert failure(grpc.StatusCode.INTERNAL, CLIENT_WRITE_RACE)[0] == grpc.StatusCode.ABORTED
    assert failure(grpc.StatusCode.INTERNAL, "ValueError: x") == (grpc.StatusCode.INTERNAL, "ValueError: x")
    assert failure(grpc.StatusCode.INVALID_ARGUMENT, "open.num_blocks=3: the reservation holds 2 blocks") == (
        grpc.StatusCode.INVALID_ARGUMENT, "open.num_blocks=3: the reservation holds 2 blocks")
