"""A prefill and a decode service in one process (real engines, real gRPC on loopback), for the prefill and the
kv_transfer tests (tests/ is on sys.path: its conftest.py; their conftests take the `engines` fixture from here)."""
from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from engine import EngineArgs, LLMEngine
from decode_svc.core import DecodeCore
from decode_svc.servicer import add_to_server
from prefill_svc.core import PrefillCore
from prefill_svc.servicer import PrefillServicer
from protos.tandem.v1 import decode_pb2_grpc, prefill_pb2_grpc
from serving.metrics import Metrics
from serving.rpc import new_server

# 100-token prompts prefill in 4 chunks of 32 tokens and fill 7 blocks of 16.
ARGS = dict(model="random:tiny", device="cpu", num_gpu_blocks_override=256, max_model_len=1024, block_size=16,
            max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def engines():
    """A prefill engine and a decode engine (random:tiny on the CPU), shared by a module's tests."""
    return LLMEngine.from_engine_args(EngineArgs(**ARGS)), LLMEngine.from_engine_args(EngineArgs(**ARGS))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(engines, scenario, **prefill_kwargs):
    """Serves engines[0] as a prefill and engines[1] as a decode instance and returns
    `await scenario(prefill_core, PrefillStub, DecodeStub, decode_address)`; both are shut down after."""
    async def main():
        pcore = PrefillCore(engines[0], Metrics("random:tiny", "prefill"), **prefill_kwargs)
        dcore = DecodeCore(engines[1], Metrics("random:tiny", "decode"))
        await pcore.start()
        await dcore.start()
        ps, ds = new_server(), new_server()
        prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(pcore), ps)
        add_to_server(dcore, ds)
        pa, da = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        ps.add_insecure_port(pa)
        ds.add_insecure_port(da)
        await ps.start()
        await ds.start()
        try:
            async with grpc.aio.insecure_channel(pa) as pch, grpc.aio.insecure_channel(da) as dch:
                return await scenario(pcore, prefill_pb2_grpc.PrefillStub(pch), decode_pb2_grpc.DecodeStub(dch), da)
        finally:
            await ps.stop(0)
            await ds.stop(0)
            await pcore.close()
            await dcore.close()
    return asyncio.run(main())
