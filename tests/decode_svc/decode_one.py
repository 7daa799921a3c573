"""One decode service in-process (a real engine, a real gRPC server on loopback), for the decode tests."""
from __future__ import annotations

import asyncio
import socket

import grpc

from decode_svc.core import DecodeCore
from decode_svc.servicer import add_to_server
from kv_transfer.sender import KvSender
from protos.tandem.v1 import common_pb2, decode_pb2_grpc
from serving.metrics import Metrics
from serving.rpc import new_server

ARGS = dict(model="random:tiny", device="cpu", num_gpu_blocks_override=64, max_model_len=1024, block_size=16)


def run_decode(engine, scenario, register=add_to_server):
    """Serves engine as a decode instance (registered with `register`) and returns `await scenario(stub, core)`;
    stub.transfer_kv is a TransferKv that also sends pre-serialized KvBlocksOut messages."""
    async def main():
        core = DecodeCore(engine, Metrics("random:tiny", "decode"))
        await core.start()
        server = new_server()
        register(core, server)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = decode_pb2_grpc.DecodeStub(ch)
                stub.transfer_kv = KvSender.transfer_kv(ch)
                stub.channel = ch
                return await scenario(stub, core)
        finally:
            await server.stop(0)
            await core.close()
    return asyncio.run(main())


async def idle(stub):
    """The decode instance's load once it holds no block and tracks no request (or after 2.5 s, for the assert)."""
    for _ in range(50):
        load = await stub.GetLoad(common_pb2.GetLoadRequest())
        if load.num_used_blocks == 0 and load.num_tracked_requests == 0:
            return load
        await asyncio.sleep(0.05)
    return load
