"""router/core.py and router/instances.py without services: validation happens before any instance is called, and
the policies order instances as documented. (The request path itself is tested end to end in tests/e2e.)"""
from __future__ import annotations

import asyncio
import socket

import pytest

from engine.sampling_params import SamplingParams
from protos.tandem.v1 import common_pb2
from router.core import GenerateRequest, RequestError, RouterConfig, RouterCore
from router.instances import InstancePool


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def run_with_core(fn, **cfg):
    async def main():
        core = await RouterCore.create(RouterConfig(prefill_addrs=[closed_port()], decode_addrs=[closed_port()],
                                                    model="random:tiny", max_model_len=64, **cfg))
        try:
            return await fn(core)
        finally:
            await core.close()
    return asyncio.run(main())


async def first_delta(core, **kw):
    req = dict(request_id="r1", model="random:tiny", prompt=None, prompt_token_ids=None, params=SamplingParams())
    req.update(kw)
    it = core.generate(GenerateRequest(**req))
    try:
        return await it.__anext__()
    finally:
        await it.aclose()


@pytest.mark.parametrize("kw,code,field", [
    (dict(model="nope", prompt="hi"), "not_found", "model"),
    (dict(prompt=""), "invalid_argument", "prompt"),
    (dict(), "invalid_argument", "prompt"),
    (dict(prompt="hi", prompt_token_ids=[1]), "invalid_argument", "prompt"),
    (dict(prompt_token_ids=[]), "invalid_argument", "prompt_token_ids"),
    (dict(prompt_token_ids=[1, 512]), "invalid_argument", "prompt_token_ids"),
    (dict(prompt="x" * 64), "invalid_argument", "prompt"),
    (dict(prompt="x" * 10, params=SamplingParams(max_tokens=60)), "invalid_argument", "max_tokens"),
    (dict(prompt="fine"), "unavailable", None),  # valid, but no instance is up
])
def test_generate_raises_before_the_first_delta(kw, code, field):
    async def check(core):
        assert not core.ready()
        with pytest.raises(RequestError) as ei:
            await first_delta(core, **kw)
        return ei.value

    err = run_with_core(check)
    assert (err.code, err.field) == (code, field), err.message
    if field:
        assert err.message.startswith(field), err.message


def test_models_tokenizer_and_limits():
    async def check(core):
        return core.models(), await core.tokenize("ab"), core.max_model_len, core.tokenizer.eos_token

    models, toks, mml, eos = run_with_core(check, served_model_name="tiny")
    assert models == ["tiny"] and toks == [97, 98] and mml == 64 and eos == "<|im_end|>"


def test_tokenizer_flag_replaces_the_models_tokenizer(other_tokenizer_dir):
    """--tokenizer: the router tokenizes prompts, renders chats and detokenizes with that directory's tokenizer (the
    one the workers were given), not random:tiny's synthetic one; the model still bounds the token ids."""
    from router.chat_template import Chat, prompt_ids

    async def check(core):
        chat = await prompt_ids(core, Chat([{"role": "user", "content": "abc"}]))
        return (await core.tokenize("abc"), chat, core.tokenizer.decode([256]), core.tokenizer.eos_token,
                core.vocab_size)

    toks, chat, text, eos, vocab = run_with_core(check, tokenizer=str(other_tokenizer_dir))
    assert toks == [256, 99] and text == "ab" and eos == "</s>" and vocab == 512
    assert chat == [ord(c) for c in "<user>"] + [256, 99]
    assert run_with_core(lambda core: core.tokenize("abc")) == [97, 98, 99]  # without it: the model's own


def test_tokenizer_flag_refuses_a_tokenizer_larger_than_the_model(tmp_path):
    from engine.tokenizer import synthetic_tokenizer

    synthetic_tokenizer(600).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"600 tokens, more than the vocab_size 512"):
        run_with_core(lambda core: None, tokenizer=str(tmp_path))


def test_config_rejects_bad_policy_and_context():
    with pytest.raises(ValueError, match="policy"):
        asyncio.run(RouterCore.create(RouterConfig([closed_port()], [closed_port()], policy="random",
                                                   model="random:tiny")))
    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(RouterCore.create(RouterConfig([closed_port()], [closed_port()], model="random:tiny",
                                                   max_model_len=10**6)))


def _pool(role, policy, n=3):
    async def make():
        return InstancePool(role, [f"127.0.0.1:{1000 + i}" for i in range(n)], policy)
    pool = asyncio.run(make())
    for inst in pool.instances:
        inst.healthy = True
    return pool


def test_round_robin_rotates_over_healthy_instances():
    pool = _pool("decode", "round_robin")
    firsts = [pool.ordered()[0].address for _ in range(6)]
    assert firsts == ["127.0.0.1:1000", "127.0.0.1:1001", "127.0.0.1:1002"] * 2
    pool.mark_down(pool.instances[1], "test")
    assert all(i.address != "127.0.0.1:1001" for _ in range(4) for i in pool.ordered())
    assert len(pool.ordered()) == 2


def test_least_loaded_decode_prefers_free_kv_then_fewer_inflight():
    pool = _pool("decode", "least_loaded")
    a, b, c = pool.instances
    a.load = common_pb2.InstanceLoad(kv_cache_usage=0.52)
    b.load = common_pb2.InstanceLoad(kv_cache_usage=0.11)
    c.load = common_pb2.InstanceLoad(kv_cache_usage=0.14)
    b.inflight, c.inflight = 5, 2
    assert [i.address for i in pool.ordered()] == [c.address, b.address, a.address]


def test_least_loaded_prefill_prefers_fewer_queued_tokens():
    pool = _pool("prefill", "least_loaded")
    a, b, c = pool.instances
    a.inflight_tokens, b.inflight_tokens, c.inflight_tokens = 900, 10, 10
    b.load = common_pb2.InstanceLoad(num_queued_tokens=500)
    c.load = common_pb2.InstanceLoad(num_queued_tokens=20)
    assert [i.address for i in pool.ordered()] == [c.address, b.address, a.address]


def test_no_healthy_instance_means_empty_order():
    pool = _pool("prefill", "round_robin", n=2)
    for inst in pool.instances:
        pool.mark_down(inst, "test")
    assert pool.ordered() == []


def test_cache_aware_prefill_goes_where_the_prefix_is_unless_that_queue_costs_more():
    from router.prefix_index import block_hashes

    pool = _pool("prefill", "cache_aware", n=2)
    a, b = pool.instances
    system = list(range(100, 164))  # 64 tokens: 4 blocks of 16
    first, second = system + [1, 2, 3], system + [7, 8, 9, 10]
    assert pool.ordered(first) == [a, b]  # nothing cached anywhere: as least_loaded (a tie: the first)
    pool.sent(a, first)
    assert a.prefixes.match(block_hashes(second, 16)) == 4  # the shared 64 tokens, not the differing tail
    b.inflight_tokens = 40  # b's queue is shorter, but by less than the 64 tokens a has cached
    a.inflight_tokens = 60
    assert pool.prefill_cost(a, second) == 60 + 68 - 64 and pool.prefill_cost(b, second) == 40 + 68
    assert pool.ordered(second) == [a, b]
    a.inflight_tokens = 200  # now a's queue outweighs the cached prefix
    assert pool.ordered(second) == [b, a]
    assert pool.ordered([5] * 20) == [b, a]  # unrelated prompts: the shorter queue
    b.load = common_pb2.InstanceLoad(num_queued_tokens=1000)  # polled: other routers' requests queue there
    assert pool.ordered([5] * 20) == [a, b]
    # A whole-prompt hit still computes its last token.
    a.inflight_tokens = b.inflight_tokens = 0
    b.load = None
    assert pool.prefill_cost(a, system) == 1


def test_cache_aware_decode_is_least_loaded_and_other_policies_record_nothing():
    pool = _pool("decode", "cache_aware")
    a, b, c = pool.instances
    a.load = common_pb2.InstanceLoad(kv_cache_usage=0.5)
    assert pool.ordered([1] * 40)[-1] is a
    rr = _pool("prefill", "round_robin", n=2)
    rr.sent(rr.instances[0], [1] * 40)
    assert len(rr.instances[0].prefixes) == 0


def test_prefix_index_forgets_tails_first_and_follows_the_polled_block_count():
    from router.prefix_index import PrefixIndex, block_hashes

    index = PrefixIndex(capacity_blocks=3)
    one, two = block_hashes(list(range(48)), 16), block_hashes(list(range(1000, 1032)), 16)
    assert len(one) == 3 and len(block_hashes(list(range(47)), 16)) == 2  # full blocks only
    index.insert(one)
    assert index.match(one) == 3
    index.insert(two)  # 5 blocks > 3: one's last two blocks go first, its first block stays a prefix
    assert index.match(two) == 2 and index.match(one) == 1 and len(index) == 3
    pool = _pool("prefill", "cache_aware", n=1)
    (inst,) = pool.instances
    inst.load = common_pb2.InstanceLoad(num_total_blocks=2, block_size=32)
    pool.sent(inst, list(range(96)))  # 3 blocks of 32, capacity 2: the first two stay
    assert inst.prefixes.capacity_blocks == 2 and inst.prefixes.match(block_hashes(list(range(96)), 32)) == 2


def test_a_stream_cancelled_by_anyio_comes_off_the_running_gauge():
    """Starlette cancels a streaming response whose client went away through an anyio cancel scope, which cancels
    the task again at every await until it returns: the core's cleanup (waiting for the sub-requests to free what
    they hold) must not be cut short, or num_requests_running keeps one per disconnect."""
    import anyio

    from router.backend import GenerateDelta
    from scripted_backend import Scripted

    class Endless(Scripted):
        async def serve_one(self, rid, index, prompt, params, queue) -> None:
            try:
                while True:
                    queue.put_nowait(GenerateDelta(index, [97], "a", None, None, len(prompt), 1))
                    await asyncio.sleep(0.001)
            finally:
                await asyncio.sleep(0.01)  # freeing what it holds takes a call to the services

    async def main():
        core = RouterCore(Endless())
        for n in (1, 3):
            started = anyio.Event()

            async def consume():
                req = GenerateRequest(request_id=f"r{n}", model="tiny", prompt="hi", prompt_token_ids=None,
                                      params=SamplingParams(n=n, max_tokens=32))
                async for _ in core.generate(req):
                    started.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                await started.wait()
                assert core._running == 1
                tg.cancel_scope.cancel()
            assert core._running == 0 and not core._queues, n
        return core.metrics

    metrics = asyncio.run(main())
    assert metrics.num_requests_running._value.get() == 0
