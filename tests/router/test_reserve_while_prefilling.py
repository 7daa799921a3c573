"""The router sends the prompt to prefill while the decode instance reserves
(router/disaggregated.py:_reserve_and_prefill), and a decode instance holds a transfer that opens before its
reservation (decode_svc/core.py:_reservation).

Real services in this process (random:tiny engines on the CPU, real gRPC on loopback) driven by a real RouterCore.
Every failure order ends with no block held and no request tracked on any instance; `tandem.hops` (DEBUG) shows
which order happened."""
from __future__ import annotations

import asyncio
import logging
import socket
import time

import grpc
import pytest

import decode_svc.core as decode_module
from decode_svc.core import DecodeCore
from decode_svc.servicer import add_to_server
from engine import LLM, EngineArgs, LLMEngine, SamplingParams
from kv_transfer.layout import layout_of
from prefill_svc.core import PrefillCore
from prefill_svc.servicer import PrefillServicer
from protos.tandem.v1 import (common_pb2, decode_pb2, decode_pb2_grpc, kv_transfer_pb2 as kv, prefill_pb2,
                              prefill_pb2_grpc)
from router.core import AdmissionConfig, GenerateRequest, RequestError, RouterConfig, RouterCore
from serving.metrics import Metrics
from serving.rpc import add_health_and_reflection, new_server, set_serving

# 64 blocks of 16 tokens per engine; prompts up to 256 tokens prefill in one step.
ARGS = dict(model="random:tiny", device="cpu", num_gpu_blocks_override=64, max_model_len=1024, block_size=16,
            max_num_batched_tokens=256)
PROMPT = list(range(20, 120))  # 100 tokens: 7 blocks
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def engines():
    """One prefill and two decode engines, shared by the module's tests."""
    return [LLMEngine.from_engine_args(EngineArgs(**ARGS)) for _ in range(3)]


@pytest.fixture(scope="module")
def expected():
    out = LLM(**ARGS).generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return out[0].outputs[0].token_ids


@pytest.fixture
def hops(caplog):
    """request id -> the hop events logged for it, in order."""
    caplog.set_level(logging.DEBUG, logger="tandem.hops")

    def of(rid: str) -> list[str]:
        return [r.getMessage().split()[2] for r in caplog.records
                if r.name == "tandem.hops" and r.getMessage().split()[1] == rid]
    return of


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """A prefill instance, `decodes` decode instances and a RouterCore over them, in this process. The router polls
    once, at start: its view of the decode instances' load stays what it was then."""

    def __init__(self, engines, decodes: int, admission: AdmissionConfig = AdmissionConfig()):
        self.admission = admission
        self.pcore = PrefillCore(engines[0], Metrics("random:tiny", "prefill"), default_kv_timeout_s=5)
        self.dcores = [DecodeCore(e, Metrics("random:tiny", "decode")) for e in engines[1:1 + decodes]]
        self.servers, self.channels = [], []

    async def start(self) -> None:
        addrs = []
        prefill = (self.pcore, prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name,
                   lambda c, s: prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(c), s))
        decode = [(d, decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name, add_to_server) for d in self.dcores]
        for core, service, register in [prefill, *decode]:
            await core.start()
            server = new_server()
            register(core, server)
            hs = add_health_and_reflection(server, [service])
            addr = f"127.0.0.1:{free_port()}"
            server.add_insecure_port(addr)
            await server.start()
            await set_serving(hs, [service], True)
            self.servers.append(server)
            addrs.append(addr)
        self.paddr, self.daddrs = addrs[0], addrs[1:]
        self.channels = [grpc.aio.insecure_channel(a) for a in addrs]
        self.pstub = prefill_pb2_grpc.PrefillStub(self.channels[0])
        self.dstubs = [decode_pb2_grpc.DecodeStub(ch) for ch in self.channels[1:]]
        self.router = await RouterCore.create(RouterConfig(
            prefill_addrs=[self.paddr], decode_addrs=self.daddrs, model="random:tiny", max_model_len=1024,
            kv_transfer_timeout_s=5, poll_interval_s=3600), admission=self.admission)

    async def stop(self) -> None:
        await self.router.close()
        for ch in self.channels:
            await ch.close()
        for server in self.servers:
            await server.stop(0)
        await self.pcore.close()
        for d in self.dcores:
            await d.close()

    async def idle(self) -> list[common_pb2.InstanceLoad]:
        """Every instance's load once none holds a block or tracks a request (or after 5 s, for the assert)."""
        for _ in range(100):
            loads = [await s.GetLoad(common_pb2.GetLoadRequest()) for s in [self.pstub, *self.dstubs]]
            if all(x.num_used_blocks == 0 and x.num_tracked_requests == 0 for x in loads):
                break
            await asyncio.sleep(0.05)
        return loads


def run(engines, scenario, decodes: int = 1, admission: AdmissionConfig = AdmissionConfig()):
    async def main():
        stack = Stack(engines, decodes, admission)
        await stack.start()
        try:
            return await scenario(stack)
        finally:
            await stack.stop()
    return asyncio.run(main())


async def generate(router: RouterCore, rid: str, prompt=PROMPT, max_tokens=MAX_TOKENS) -> list[int]:
    req = GenerateRequest(request_id=rid, model="random:tiny", prompt=None, prompt_token_ids=list(prompt),
                          params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return [t async for d in router.generate(req) for t in d.token_ids]


async def hold(stub, n_tokens: int = 1000):
    """A reservation whose KV never comes: 1000 tokens hold 63 of a decode instance's 64 blocks."""
    call = stub.Decode(decode_pb2.DecodeRequest(request_id=f"hold-{time.monotonic_ns()}",
                                                prompt_token_ids=[5] * n_tokens,
                                                params=common_pb2.SamplingParams(max_tokens=10),
                                                kv_transfer_timeout_ms=60_000))
    assert (await call.read()).HasField("reserved")
    return call


def clean(loads) -> bool:
    return all(x.num_used_blocks == 0 and x.num_tracked_requests == 0 for x in loads)


def hops_of_one_request(engines, expected, hops, request_id: str) -> list[str]:
    """One request through the stack, alone: its tokens are the expected ones, every engine ends idle; its hops."""
    async def scenario(stack):
        return await generate(stack.router, request_id), await stack.idle()

    toks, loads = run(engines, scenario)
    assert toks == expected and clean(loads), loads
    return hops(request_id)


def test_the_prompt_reaches_prefill_before_the_reservation_answers(engines, expected, hops):
    events = hops_of_one_request(engines, expected, hops, "a")
    assert events.index("router.prefill_sent") < events.index("router.reserved"), events
    assert "prefill.in" in events and "decode.reserved" in events


def test_a_refusal_after_the_prefill_started_waits_for_room_then_fails_and_frees_both_sides(engines, hops):
    # The decode instance has no room: the request waits for some (router/admission.py), trying again under new
    # ids, reservation first (no prefill is wasted on them), and is refused once --queue-timeout has passed.
    async def scenario(stack):
        held = await hold(stack.dstubs[0])  # after the router's poll: it still sees an empty instance
        with pytest.raises(RequestError) as ei:
            await generate(stack.router, "b")
        during = await stack.pstub.GetLoad(common_pb2.GetLoadRequest())
        for _ in range(100):
            if during.num_used_blocks == 0 and during.num_tracked_requests == 0:
                break
            await asyncio.sleep(0.05)
            during = await stack.pstub.GetLoad(common_pb2.GetLoadRequest())
        decode_load = await stack.dstubs[0].GetLoad(common_pb2.GetLoadRequest())
        held.cancel()
        return ei.value, during, decode_load, await stack.idle()

    err, prefill_load, decode_load, loads = run(engines, scenario, admission=AdmissionConfig(queue_timeout_s=1.0))
    assert err.code == "resource_exhausted" and err.retry_after_s >= 1, err.message
    assert "no decode instance has room for 100 prompt tokens" in err.message and "--queue-timeout" in err.message
    assert prefill_load.num_used_blocks == 0 and prefill_load.num_tracked_requests == 0
    assert decode_load.num_used_blocks == 63 and decode_load.num_tracked_requests == 1  # the hold alone
    assert clean(loads), loads
    assert "prefill.in" in hops("b") and "decode.reserved" in hops("b")  # prefill had started; decode refused
    retry = hops("b.r1")  # the first of the tries: the head is woken every ROOM_RETRY_S (0.25 s) of the 1 s
    assert "decode.reserved" in retry and "prefill.in" not in retry, retry


def test_a_refusal_falls_over_to_the_next_decode_under_a_new_id(engines, expected, hops):
    async def scenario(stack):
        held = await hold(stack.dstubs[0])
        toks = [await generate(stack.router, rid) for rid in ("c", "d")]  # round robin: one tries decode 0 first
        held.cancel()
        return toks, await stack.idle()

    toks, loads = run(engines, scenario, decodes=2)
    assert toks == [expected, expected] and clean(loads), loads
    retried = [rid for rid in ("c", "d") if hops(f"{rid}.2")]
    assert len(retried) == 1, (hops("c"), hops("d"))
    assert "prefill.in" in hops(retried[0])  # the first attempt reached prefill, then was cancelled
    assert "prefill.yield" in hops(f"{retried[0]}.2") and "decode.reserved" in hops(f"{retried[0]}.2")


@pytest.mark.parametrize("order", ["prefill_fails_after_the_reservation", "prefill_fails_before_the_reservation"])
def test_a_failed_prefill_frees_the_reservation(engines, monkeypatch, order, hops):
    prefill_engine, decode_engine = engines[0], engines[1]
    add, reserve = prefill_engine.add_request, decode_engine.reserve_prefilled

    def failing_add(rid, *a, **kw):  # engine thread
        if rid == "e":
            if order == "prefill_fails_after_the_reservation":
                time.sleep(0.3)
            raise RuntimeError("the prefill engine failed")
        return add(rid, *a, **kw)

    def slow_reserve(rid, *a, **kw):  # engine thread
        if rid == "e" and order == "prefill_fails_before_the_reservation":
            time.sleep(0.3)
        return reserve(rid, *a, **kw)

    monkeypatch.setattr(prefill_engine, "add_request", failing_add)
    monkeypatch.setattr(decode_engine, "reserve_prefilled", slow_reserve)

    async def scenario(stack):
        with pytest.raises(RequestError) as ei:
            await generate(stack.router, "e")
        return ei.value, await stack.idle()

    err, loads = run(engines, scenario)
    assert err.code == "internal" and "the prefill engine failed" in err.message, err.message
    assert clean(loads), loads
    events = hops("e")
    assert "decode.reserved" in events and "prefill.added" in events


def test_an_unreachable_decode_cancels_the_prefill(engines, hops):
    async def scenario(stack):
        await stack.servers[1].stop(0)  # the decode instance goes away after the router's poll
        with pytest.raises(RequestError) as ei:
            await generate(stack.router, "f")
        stack.dstubs = []  # (gone)
        return ei.value, await stack.idle()

    err, loads = run(engines, scenario)
    assert err.code == "unavailable" and "no healthy decode instance" in err.message, err.message
    assert clean(loads), loads
    assert "prefill.in" in hops("f")


def test_a_client_gone_before_the_first_token_frees_both_sides(engines):
    async def scenario(stack):
        task = asyncio.create_task(generate(stack.router, "g", prompt=list(range(10, 900)), max_tokens=20))
        for _ in range(200):  # until the prefill holds blocks: 890 tokens take 4 steps of 256
            if (await stack.pstub.GetLoad(common_pb2.GetLoadRequest())).num_used_blocks > 0:
                break
            await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return await stack.idle()

    assert clean(run(engines, scenario))


# ------------------------------------------------------------------------------ the decode side, driven directly
def open_message(engine, rid: str, n_tokens: int) -> kv.KvTransferMessage:
    return kv.KvTransferMessage(open=kv.KvTransferOpen(request_id=rid, layout=layout_of(engine.kv_cache),
                                                       num_prompt_tokens=n_tokens, num_blocks=-(-n_tokens // 16)))


def decode_request(rid: str, n_tokens: int) -> decode_pb2.DecodeRequest:
    return decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=[3] * n_tokens, kv_transfer_timeout_ms=10_000,
                                    params=common_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))


def test_a_transfer_that_opens_first_waits_for_its_reservation(engines):
    layout = layout_of(engines[1].kv_cache)

    async def scenario(stack):
        stub = stack.dstubs[0]
        reserved = asyncio.Event()

        async def messages():
            yield open_message(engines[1], "h", 20)
            await reserved.wait()
            yield kv.KvTransferMessage(blocks=kv.KvBlocks(first_block_index=0, num_blocks=2,
                                                          data=bytes(2 * layout.block_bytes)))
            yield kv.KvTransferMessage(commit=kv.KvTransferCommit(first_token_id=65))

        transfer = asyncio.ensure_future(stub.TransferKv(messages()))
        await asyncio.sleep(0.3)  # the open waits here for a Decode call
        call = stub.Decode(decode_request("h", 20))
        assert (await call.read()).HasField("reserved")
        reserved.set()
        ack = await transfer
        toks = []
        while (r := await call.read()) is not grpc.aio.EOF:
            toks += r.delta.token_ids
        return ack, toks, await stack.idle()

    ack, toks, loads = run(engines, scenario)
    assert ack.num_blocks == 2 and len(toks) == 3 and clean(loads)


def test_a_transfer_waiting_for_a_refused_reservation_fails_at_once(engines, monkeypatch):
    monkeypatch.setattr(decode_module, "RESERVATION_WAIT_S", 30.0)  # so that only the refusal can end the wait

    async def scenario(stack):
        stub = stack.dstubs[0]
        held = await hold(stub)

        async def messages():
            yield open_message(engines[1], "i", 100)
            await asyncio.sleep(60)

        transfer = asyncio.ensure_future(stub.TransferKv(messages()))
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Decode(decode_request("i", 100)).read()
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await transfer
        waited = time.monotonic() - t0
        held.cancel()
        return refused.value, failed.value, waited, await stack.idle()

    refused, failed, waited, loads = run(engines, scenario)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert failed.code() == grpc.StatusCode.NOT_FOUND and "refused" in failed.details()
    assert waited < 5 and clean(loads)


def test_a_transfer_without_any_decode_call_gives_up_after_the_wait(engines, monkeypatch):
    monkeypatch.setattr(decode_module, "RESERVATION_WAIT_S", 0.3)

    async def scenario(stack):
        async def only():
            yield open_message(engines[1], "ghost", 20)

        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stack.dstubs[0].TransferKv(only())
        return ei.value, time.monotonic() - t0, await stack.idle()

    err, waited, loads = run(engines, scenario)
    assert err.code() == grpc.StatusCode.NOT_FOUND and "no reservation here" in err.details()
    assert 0.3 <= waited < 3 and clean(loads)


# ------------------------------------------------------------------ the prefill side: nothing on its loop mid-step
def test_a_one_chunk_prompt_opens_its_transfer_after_the_first_token(engines, expected, hops):
    events = hops_of_one_request(engines, expected, hops, "j")
    assert events.index("prefill.yield") < events.index("prefill.tx_open"), events


def test_a_long_prompt_opens_its_transfer_after_its_first_chunk(engines, hops):
    async def scenario(stack):  # 600 tokens: 3 steps of 256; the blocks of step 1 open the transfer
        return await generate(stack.router, "k", prompt=[10 + i % 490 for i in range(600)]), await stack.idle()

    toks, loads = run(engines, scenario)
    assert len(toks) == MAX_TOKENS and clean(loads), loads
    events = hops("k")
    assert events.index("prefill.tx_open") < events.index("prefill.yield"), events


def test_a_prompt_the_engine_refuses_fails_its_prefill_call(engines):
    async def scenario(stack):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in stack.pstub.Prefill(prefill_pb2.PrefillRequest(
                    request_id="l", prompt_token_ids=[3] * 1100,
                    params=common_pb2.SamplingParams(temperature=0.0, max_tokens=1))):
                pass
        return ei.value, await stack.idle()

    err, loads = run(engines, scenario)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("prompt: 1100 tokens")
    assert clean(loads), loads
