"""The host KV tier (--swap-space): preempted requests swapped out and back give the tokens an unpreempted run gives;
blocks evicted from the device's prefix cache come back from the host as prefix hits holding the right KV; copies run
in the order they were recorded; nothing leaks on either pool."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import EngineArgs, LLMEngine, SamplingParams
from engine.block_pool import hash_block_tokens
from engine.host_kv import HostKVTier
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from tests.engine.test_async_scheduling import prompts, run_all


# ---- the tier by itself --------------------------------------------------------------------------------------
def test_copies_run_in_recorded_order_and_runs_coalesce():
    dev = torch.arange(8, dtype=torch.float32).repeat_interleave(4).view(8, 4)  # block b holds b
    host = HostKVTier([dev], num_blocks=3)
    h = [hash_block_tokens(None, [i]) for i in range(5)]
    for b in range(3):
        host.store(b, h[b])  # blocks 0,1,2 -> host 0,1,2: one run
    host.flush()
    assert [row[0].item() for row in host.host_tensors[0]] == [0.0, 1.0, 2.0]
    # A load reads host 0 (device block 0's copy); the store after it, recorded later, reuses that host block
    # (least recently used): the load must see the old contents.
    host.load(h[0], 5)
    host.store(7, h[3])  # takes host block 1 (h[1] is now the least recently used)
    host.store(6, h[4])  # takes host block 2
    assert host.pending == 3
    host.flush()
    assert dev[5, 0].item() == 0.0
    assert not host.has(h[1]) and not host.has(h[2]) and host.has(h[0]) and host.has(h[3])
    assert [row[0].item() for row in host.host_tensors[0]] == [0.0, 7.0, 6.0]
    assert (host.stored, host.loaded) == (5, 1)


def test_swap_out_takes_prefix_blocks_and_refuses_what_it_cannot_hold():
    dev = torch.arange(6, dtype=torch.float32).view(6, 1)
    host = HostKVTier([dev], num_blocks=2)
    host.store(0, hash_block_tokens(None, [1]))
    assert host.swap_out([3, 4, 5]) is None and host.pending == 1  # 3 blocks do not fit in 2: nothing taken
    got = host.swap_out([3, 4])  # drops the prefix block for room
    assert got is not None and len(got) == 2 and host.owned == 2 and not host.prefix
    host.flush()
    dev[3:5] = -1
    host.swap_in(got, [1, 2])
    host.flush()
    assert dev[1:3, 0].tolist() == [3.0, 4.0] and host.owned == 0 and len(host.free) == 2


# ---- through the block manager -------------------------------------------------------------------------------
def test_an_evicted_prefix_comes_back_from_the_host_with_its_kv():
    bs, nb = 4, 6
    dev = torch.zeros(nb, bs)
    host = HostKVTier([dev], num_blocks=8)
    kv = KVCacheManager(nb, bs, enable_caching=True, host=host)

    def admit(rid, tokens):
        r = Request(rid, tokens, SamplingParams(max_tokens=1), max_tokens=1)
        hits, n_hit = kv.get_computed_blocks(r)
        assert kv.allocate_slots(r, r.num_tokens - n_hit, hits)
        r.num_computed_tokens = r.num_tokens
        for i, b in enumerate(kv.get_block_ids(rid)[n_hit // bs:]):  # "compute" its KV: token values
            start = n_hit + i * bs
            dev[b] = torch.tensor(tokens[start: start + bs] + [0] * (bs - len(tokens[start: start + bs])),
                                  dtype=dev.dtype)
        kv.cache_blocks(r, r.num_tokens)
        return r, n_hit

    a = list(range(100, 113))  # 13 tokens: 3 full blocks + 1
    r, _ = admit("a", a)
    r.status = r.status.FINISHED_STOPPED
    kv.free(r)
    o, _ = admit("o", list(range(200, 224)))  # takes every block: a's cached blocks are evicted (and stored)
    o.status = o.status.FINISHED_STOPPED
    kv.free(o)
    assert host.stored == 3
    assert kv.pool.get_cached_block(hash_block_tokens(None, a[:4])) is None, "a's first block is still on the device"
    r2 = Request("a2", a, SamplingParams(max_tokens=1), max_tokens=1)
    hits, n_hit = kv.get_computed_blocks(r2)
    assert n_hit == 12 and kv.host_hits > 0
    for i, b in enumerate(hits):
        assert dev[b].tolist() == [float(t) for t in a[i * bs:(i + 1) * bs]], (i, b)
    assert kv.allocate_slots(r2, 1, hits)
    r2.status = r2.status.FINISHED_STOPPED
    kv.free(r2)
    assert kv.pool.num_free_blocks == nb and all(c == 0 for c in kv.pool.ref_cnt)


# ---- through the engine --------------------------------------------------------------------------------------
def make_engine(**kw) -> LLMEngine:
    args = dict(model="random:tiny", device="cpu", kv_cache_memory=0.05, max_model_len=256, max_num_batched_tokens=64,
                new_token_ratio=0.0)
    args.update(kw)
    return LLMEngine.from_engine_args(EngineArgs(**args))


@pytest.fixture(scope="module")
def reference():
    """8 requests on a pool that holds them all: no preemption."""
    reqs = [(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
            for i, p in enumerate(prompts(8))]
    return reqs, run_all(make_engine(), reqs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_swapped_requests_continue_exactly(reference, async_scheduling):
    reqs, want = reference
    engine = make_engine(num_gpu_blocks_override=24, swap_space=0.01, preemption_mode="swap",
                         async_scheduling=async_scheduling)
    got = run_all(engine, reqs)  # (checks that no device block leaked)
    assert got == want
    s = engine.stats()
    assert engine.scheduler.num_preemptions > 0 and s.num_swaps == engine.scheduler.num_preemptions, \
        "the pool was meant to force preemption, and every preemption to swap"
    assert s.swapped_out_blocks == s.swapped_in_blocks > 0
    assert s.num_swapped == 0 and engine.kv.host.owned == 0


def test_auto_swaps_requests_of_a_block_or_more(reference):
    """auto: a request with a full block of computed KV is swapped, one with less is recomputed; either way the
    tokens are an unpreempted run's."""
    reqs, want = reference
    engine = make_engine(num_gpu_blocks_override=24, swap_space=0.01, preemption_mode="auto")
    sched, bs = engine.scheduler, engine.kv.block_size
    probe = SimpleNamespace(num_computed_tokens=bs - 1)
    assert not sched._should_swap(probe)
    probe.num_computed_tokens = bs
    assert sched._should_swap(probe)
    got = run_all(engine, reqs)
    assert got == want
    s = engine.stats()
    assert engine.scheduler.num_preemptions > 0 and s.num_swaps > 0, (s.num_swaps, engine.scheduler.num_preemptions)
    assert s.swapped_out_blocks == s.swapped_in_blocks > 0 and engine.kv.host.owned == 0


def test_aborting_a_swapped_request_frees_its_host_blocks(reference):
    reqs, _ = reference
    engine = make_engine(num_gpu_blocks_override=24, swap_space=0.01, preemption_mode="swap")
    for rid, p, params in reqs:
        engine.add_request(rid, p, params)
    swapped = None
    while engine.has_unfinished_requests() and swapped is None:
        engine.step()
        swapped = next((r for r in engine.scheduler.waiting if r.swapped_blocks is not None), None)
    assert swapped is not None, "no request was swapped out"
    engine.abort(swapped.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.host.owned == 0 and len(engine.kv.host.free) + len(engine.kv.host.prefix) == \
        engine.kv.host.num_blocks
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks


def test_a_prefix_evicted_from_the_device_is_a_hit_from_the_host():
    engine = make_engine(num_gpu_blocks_override=12, swap_space=0.01, max_model_len=160)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    system = [(5 * j) % 190 + 3 for j in range(64)]  # 4 full blocks
    first = run_all(engine, [("a", system + [7, 8], params)])
    for k in range(4):  # unrelated prompts that need every block: the system prompt's blocks leave the device
        run_all(engine, [(f"o{k}", [(11 * j + k) % 190 + 3 for j in range(150)], params)])
    before = engine.stats()
    again = run_all(engine, [("b", system + [7, 8], params)])
    after = engine.stats()
    assert again[("b", 0)][0] == first[("a", 0)][0]
    assert after.host_prefix_hits - before.host_prefix_hits >= 48, (before, after)
    assert after.host_stored_blocks > 0


def test_swap_flags_are_validated():
    with pytest.raises(ValueError, match="swap_space"):
        EngineArgs(model="random:tiny", swap_space=-1).create_engine_config()
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineArgs(model="random:tiny", preemption_mode="sometimes").create_engine_config()
