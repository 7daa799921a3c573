from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=8), 8)


def test_allocate_rounds_up_to_blocks_and_grows():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = req("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    assert kv.get_block_ids("a") == [0, 1, 2]
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2)  # 12 tokens: still 3 blocks
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.allocate_slots(r, 3)  # 13 tokens: a 4th block
    assert kv.get_block_ids("a") == [0, 1, 2, 3]


def test_allocate_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = req("a", list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert kv.get_block_ids("a") == []
    assert kv.pool.num_free_blocks == 2


def test_prefix_hit_reuses_blocks_and_counts_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", list(range(10)))
    assert kv.get_computed_blocks(a) == ([], 0)
    kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.cache_blocks(a, 10)  # blocks 0 and 1 are full
    b = req("b", list(range(8)) + [99, 98, 97])
    hits, n = kv.get_computed_blocks(b)
    assert (hits, n) == ([0, 1], 8)
    assert kv.allocate_slots(b, 3, hits)
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert kv.pool.ref_cnt[0] == 2 and kv.pool.ref_cnt[1] == 2
    assert (kv.prefix_queries, kv.prefix_hits) == (10 + 11, 8)


def test_full_hit_leaves_last_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.cache_blocks(a, 8)
    b = req("b", list(range(8)))
    hits, n = kv.get_computed_blocks(b)
    assert (hits, n) == ([0], 4)  # (8 - 1) // 4 = 1 block at most


def test_freed_cached_blocks_are_hit_then_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)  # blocks 0,1,2
    kv.cache_blocks(a, 5)  # 0 and 1 cached
    a.status = a.status.FINISHED_STOPPED
    kv.free(a)
    # Free queue: uncached 3 and 2 first, then cached tail-first: 1, 0.
    assert list(kv.pool.free_queue) == [2, 3, 1, 0]
    b = req("b", [1, 2, 3, 4, 9])
    hits, n = kv.get_computed_blocks(b)
    assert (hits, n) == ([0, 1], 4)
    c = req("c", [7, 7, 7, 7, 7, 7, 7])
    assert kv.allocate_slots(c, 7)  # takes 2, 3, 1, 0: evicts the cached ones too
    assert kv.get_block_ids("c") == [2, 3, 1, 0]
    assert kv.pool.get_cached_block(kv.req_to_hashes["b"][0]) is None


def test_hit_on_free_block_counts_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = req("a", [1, 2, 3])
    kv.allocate_slots(a, 3)
    kv.cache_blocks(a, 3)
    a.status = a.status.FINISHED_STOPPED
    kv.free(a)
    b = req("b", [1, 2, 5, 6, 7, 8, 9])
    hits, _ = kv.get_computed_blocks(b)
    assert hits == [0]
    # b needs 4 blocks: 1 hit + 3 new, but only 2 others are free.
    assert not kv.allocate_slots(b, 5, hits)
    assert kv.pool.ref_cnt[0] == 0


def test_block_tables_are_the_padded_lists_through_growth_reuse_and_hits():
    """block_tables() is the zero-padded block id lists of the requests asked for, in their order: after growth past
    the array's first 64 rows and 64 columns, after frees (a freed row is reused clean), and with prefix hits."""
    import random

    import numpy as np

    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=20000, block_size=2)
    live: dict[str, Request] = {}
    for step in range(150):
        if live and rng.random() < 0.2:  # finish (or preempt) one
            rid = rng.choice(sorted(live))
            kv.free(live.pop(rid))
        if rng.random() < 0.8:  # a new request, sometimes sharing a cached prefix
            rid = f"r{step}"
            tokens = ([7] * 6 if rng.random() < 0.3 else []) + [rng.randrange(100) for _ in range(rng.randrange(1, 9))]
            r = req(rid, tokens)
            hits, n = kv.get_computed_blocks(r)
            assert kv.allocate_slots(r, len(tokens) - n, hits)
            r.num_computed_tokens = len(tokens)
            kv.cache_blocks(r, len(tokens))
            live[rid] = r
        for r in live.values():  # everyone grows; some a lot (past 64 blocks)
            n = 40 if rng.random() < 0.02 else rng.choice((1, 2, 3))
            assert kv.allocate_slots(r, n)
            r.num_computed_tokens += n
        ids = sorted(live, key=lambda _: rng.random())
        if ids:
            lists = [kv.get_block_ids(r) for r in ids]
            expect = np.zeros((len(ids), max(map(len, lists))), dtype=np.int32)
            for i, blocks in enumerate(lists):
                expect[i, : len(blocks)] = blocks
            got = kv.block_tables(ids)
            assert got.dtype == np.int32 and np.array_equal(got, expect)
    assert kv._table.shape[0] > 64 and kv._table.shape[1] > 64  # both grew
