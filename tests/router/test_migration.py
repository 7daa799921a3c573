"""Request migration (router/migration.py): a stream whose instance goes away continues on another one, token-exact,
on the same client stream; past --migration-limit or --migration-timeout the client gets the error.

Real services in this process (random:tiny engines on the CPU, real gRPC on loopback) driven by a real RouterCore.
An instance "dies" when its gRPC server stops (its port closes, its calls end); its core stays, so the test can
check that what the dead calls held was freed, and a "restart" serves the same core on the same port again."""
from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest
import torch

from decode_svc.core import DecodeCore
from decode_svc.servicer import add_to_server
from engine import LLM, EngineArgs, LLMEngine, SamplingParams
from prefill_svc.core import PrefillCore
from prefill_svc.servicer import PrefillServicer
from protos.tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from router.core import GenerateRequest, RequestError, RouterConfig, RouterCore
from serving.metrics import Metrics
from serving.rpc import add_health_and_reflection, new_server, set_serving

ARGS = dict(model="random:tiny", device="cpu", num_gpu_blocks_override=128, max_model_len=1024, block_size=16,
            max_num_batched_tokens=256)
PROMPTS = [list(range(20 + i, 120 + i)) for i in range(2)]  # 100 tokens each: 7 blocks
LONG = 900  # tokens a stream asks for: seconds of decoding, so a stream is surely mid-way when its instance dies
GREEDY = SamplingParams(temperature=0.0, max_tokens=LONG, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=50, seed=3, max_tokens=LONG, ignore_eos=True, logprobs=1,
                        repetition_penalty=1.1)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: five engines stepping in one process on a shared CPU (torch's default, a thread per
    core, made a 300-token run 40x slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engines():
    """Two prefill and two decode engines, shared by the module's tests."""
    return [LLMEngine.from_engine_args(EngineArgs(**ARGS)) for _ in range(4)]


@pytest.fixture(scope="module")
def expected():
    llm = LLM(**ARGS)
    return {(i, name): llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids
            for i, p in enumerate(PROMPTS) for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """`prefills` prefill and `decodes` decode instances and a RouterCore over them, in this process."""

    def __init__(self, engines, prefills: int = 1, decodes: int = 2, poll_interval_s: float = 3600, **router_kw):
        self.cores = ([PrefillCore(e, Metrics("random:tiny", "prefill"), default_kv_timeout_s=5)
                       for e in engines[:prefills]]
                      + [DecodeCore(e, Metrics("random:tiny", "decode")) for e in engines[2:2 + decodes]])
        self.roles = ["prefill"] * prefills + ["decode"] * decodes
        self.addrs = [f"127.0.0.1:{free_port()}" for _ in self.cores]
        self.servers: list[grpc.aio.Server | None] = [None] * len(self.cores)
        self.poll_interval_s = poll_interval_s
        self.router_kw = router_kw

    async def serve(self, i: int) -> None:
        """Serves core i on its address (again, after `kill`)."""
        role, core = self.roles[i], self.cores[i]
        server = new_server()
        if role == "prefill":
            service = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
            prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(core), server)
        else:
            service = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
            add_to_server(core, server)
        hs = add_health_and_reflection(server, [service])
        server.add_insecure_port(self.addrs[i])
        await server.start()
        await set_serving(hs, [service], True)
        self.servers[i] = server

    async def kill(self, i: int) -> None:
        """Instance i goes away: its port closes and its calls end (what they held is freed by its core)."""
        server, self.servers[i] = self.servers[i], None
        await server.stop(0)

    async def start(self) -> None:
        for i, core in enumerate(self.cores):
            await core.start()
            await self.serve(i)
        self.router = await RouterCore.create(RouterConfig(
            prefill_addrs=[a for a, r in zip(self.addrs, self.roles) if r == "prefill"],
            decode_addrs=[a for a, r in zip(self.addrs, self.roles) if r == "decode"], model="random:tiny",
            max_model_len=1024, kv_transfer_timeout_s=5, poll_interval_s=self.poll_interval_s, **self.router_kw))
        self._base = self._counts()

    async def stop(self) -> None:
        await self.router.close()
        for server in self.servers:
            if server is not None:
                await server.stop(0)
        for core in self.cores:
            await core.close()

    async def loads(self) -> list[common_pb2.InstanceLoad]:
        """Every core's load once none holds a block or tracks a request (or after 5 s, for the assert)."""
        for _ in range(100):
            loads = [await core.load() for core in self.cores]
            if all(x.num_used_blocks == 0 and x.num_tracked_requests == 0 for x in loads):
                break
            await asyncio.sleep(0.05)
        return loads

    def _counts(self) -> dict[str, float]:
        return {r: c._value.get() for r, c in self.router.backend.migration.metrics.request_migrations.items()}

    def migrations(self) -> dict[str, float]:
        """tandem:request_migrations_total by reason, since this stack started (the counters are process-wide)."""
        return {r: n - self._base[r] for r, n in self._counts().items()}


def run(engines, scenario, **stack_kw):
    async def main():
        stack = Stack(engines, **stack_kw)
        await stack.start()
        try:
            return await scenario(stack)
        finally:
            await stack.stop()
    return asyncio.run(main())


class Client:
    """One stream through the router: its deltas as they come, and a semaphore released at its `at`th token."""

    def __init__(self, router: RouterCore, rid: str, prompt, params: SamplingParams, at: int = 5):
        self.deltas, self.started, self.at = [], asyncio.Event(), at
        self.task = asyncio.create_task(self._run(router, rid, prompt, params))

    async def _run(self, router, rid, prompt, params):
        req = GenerateRequest(request_id=rid, model="random:tiny", prompt=None, prompt_token_ids=list(prompt),
                              params=params)
        async for d in router.generate(req):
            self.deltas.append(d)
            if sum(len(x.token_ids) for x in self.deltas) >= self.at:
                self.started.set()

    @property
    def tokens(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]

    def check_continuous(self) -> None:
        """Usage counts every token once, in order; logprobs, when asked for, one entry per token."""
        n = 0
        for d in self.deltas:
            n += len(d.token_ids)
            assert d.completion_tokens == n and d.prompt_tokens == 100
            assert d.logprobs is None or len(d.logprobs) == len(d.token_ids)
        assert self.deltas[-1].finish_reason == "length" and n == LONG


async def clean(stack: Stack) -> bool:
    loads = await stack.loads()
    return all(x.num_used_blocks == 0 and x.num_tracked_requests == 0 for x in loads)


@pytest.mark.parametrize("name", ["greedy", "seeded"])
def test_a_stream_on_a_decode_that_dies_continues_on_the_other_token_exact(engines, expected, name):
    params = GREEDY if name == "greedy" else SEEDED

    async def scenario(stack):
        clients = [Client(stack.router, f"{name}{i}", PROMPTS[i], params) for i in range(2)]  # one on each decode
        await asyncio.gather(*(c.started.wait() for c in clients))
        await stack.kill(1)  # decode 0
        await asyncio.gather(*(c.task for c in clients))
        return clients, stack.migrations(), await clean(stack)

    clients, moved, idle = run(engines, scenario)
    for i, c in enumerate(clients):
        assert c.tokens == expected[i, name], i
        c.check_continuous()
    assert moved == {"decode_unavailable": 1, "decode_unhealthy": 0, "prefill_unavailable": 0, "kv_transfer": 0}
    assert idle


def test_with_no_prefill_left_a_decode_prefills_the_moved_stream_itself(engines, expected):
    """The prefill instance and the stream's decode instance both die: the move finds the prefill gone (its first
    try fails), then the surviving decode instance prefills prompt + tokens so far locally; new requests too."""
    async def scenario(stack):
        clients = [Client(stack.router, f"l{i}", PROMPTS[i], GREEDY) for i in range(2)]
        await asyncio.gather(*(c.started.wait() for c in clients))
        await stack.kill(0)  # the prefill
        await stack.kill(1)  # decode 0
        await asyncio.gather(*(c.task for c in clients))
        after = Client(stack.router, "after", PROMPTS[1], GREEDY)
        await after.task
        return clients, after, stack.migrations(), await clean(stack)

    clients, after, moved, idle = run(engines, scenario)
    for i, c in enumerate(clients):
        assert c.tokens == expected[i, "greedy"], i
        c.check_continuous()
    assert after.tokens == expected[1, "greedy"]
    assert moved["decode_unavailable"] == 1 and moved["prefill_unavailable"] <= 1, moved
    assert idle


def test_a_prefill_that_dies_before_the_first_token_is_replaced(engines, expected):
    """Two prefill instances: the one computing a long prompt dies mid-prefill (its transfer already open); the
    request starts again on the other, with a new reservation, and the client sees nothing of it."""
    prompt = [(i * 7) % 500 + 3 for i in range(890)]  # 4 steps of 256

    async def scenario(stack):
        c = Client(stack.router, "p", prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        busy = None
        for _ in range(400):  # until one prefill holds blocks
            used = [(await stack.cores[i].load()).num_used_blocks for i in (0, 1)]
            if any(used):
                busy = used.index(max(used))
                break
            await asyncio.sleep(0.005)
        await stack.kill(busy)
        await c.task
        return c, busy, stack.migrations(), await clean(stack)

    c, busy, moved, idle = run(engines, scenario, prefills=2, decodes=1)
    assert busy is not None
    assert c.tokens == LLM(**ARGS).generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True))[0].outputs[0].token_ids
    assert [d.completion_tokens for d in c.deltas][-1] == 20
    assert sum(moved.values()) == 1 and moved["decode_unhealthy"] == 0, moved
    assert idle


def test_the_health_poll_moves_the_streams_of_an_instance_it_cannot_reach(engines, expected):
    """Decode 0 stops answering health polls (its streams still run): after LOST_AFTER_POLLS unanswered polls its
    stream moves to decode 1; the abandoned call's blocks are freed."""
    async def scenario(stack):
        clients = [Client(stack.router, f"h{i}", PROMPTS[i], GREEDY) for i in range(2)]
        await asyncio.gather(*(c.started.wait() for c in clients))
        silent = stack.router.backend.decode.instances[0]

        async def unanswered(*_a, **_kw):
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "Deadline Exceeded")
        silent.health = unanswered
        await asyncio.gather(*(c.task for c in clients))
        return clients, stack.migrations(), await clean(stack)

    clients, moved, idle = run(engines, scenario, poll_interval_s=0.1)
    for i, c in enumerate(clients):
        assert c.tokens == expected[i, "greedy"], i
        c.check_continuous()
    assert moved["decode_unhealthy"] == 1 and sum(moved.values()) == 1, moved
    assert idle


def test_past_the_migration_limit_the_client_gets_the_error(engines):
    async def scenario(stack):
        c = Client(stack.router, "x", PROMPTS[0], GREEDY)
        await c.started.wait()
        await stack.kill(1)
        with pytest.raises(RequestError) as ei:
            await c.task
        return ei.value, stack.migrations(), await clean(stack)

    err, moved, idle = run(engines, scenario, decodes=1, migration_limit=0)
    assert err.code == "unavailable" and "(the request was not moved: --migration-limit 0)" in err.message, err.message
    assert sum(moved.values()) == 0
    assert idle


def test_a_restarted_decode_takes_the_paused_stream_back(engines, expected):
    """The only decode instance dies and comes back on the same port 0.5 s later: the stream pauses, then continues
    there token-exact (within --migration-timeout)."""
    async def scenario(stack):
        c = Client(stack.router, "r", PROMPTS[0], GREEDY)
        await c.started.wait()
        n = len(c.tokens)
        await stack.kill(1)
        await asyncio.sleep(0.5)
        paused = len(c.tokens)
        t0 = time.monotonic()
        await stack.serve(1)
        await c.task
        return c, n, paused, time.monotonic() - t0, stack.migrations(), await clean(stack)

    c, n, paused, back_s, moved, idle = run(engines, scenario, decodes=1, poll_interval_s=0.2)
    assert c.tokens == expected[0, "greedy"]
    c.check_continuous()
    assert paused < LONG and moved["decode_unavailable"] == 1, moved
    assert idle


def test_with_no_decode_back_within_the_timeout_the_client_gets_the_error(engines):
    async def scenario(stack):
        c = Client(stack.router, "t", PROMPTS[0], GREEDY)
        await c.started.wait()
        await stack.kill(1)
        t0 = time.monotonic()
        with pytest.raises(RequestError) as ei:
            await c.task
        return ei.value, time.monotonic() - t0, await clean(stack)

    err, waited, idle = run(engines, scenario, decodes=1, poll_interval_s=0.2, migration_timeout_s=1.0)
    assert err.code == "unavailable" and "no decode instance was healthy within 1 s" in err.message, err.message
    assert 0.9 < waited < 5
    assert idle
