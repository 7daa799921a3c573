from engine.block_pool import BlockPool, hash_block_tokens


def test_new_blocks_come_in_order_and_exhaust():
    pool = BlockPool(4)
    assert pool.get_new_blocks(3) == [0, 1, 2]
    assert pool.num_free_blocks == 1
    assert pool.get_new_blocks(2) is None  # not enough: nothing taken
    assert pool.num_free_blocks == 1
    assert pool.get_new_blocks(1) == [3]
    assert pool.usage() == 1.0


def test_free_order_is_eviction_order_and_uncached_blocks_go_first():
    pool = BlockPool(4)
    a = pool.get_new_blocks(4)
    pool.cache_block(a[0], b"h0")
    pool.cache_block(a[1], b"h1")
    pool.free([a[1], a[0]])  # cached: back of the queue, in this order
    pool.free([a[3], a[2]])  # uncached: front
    assert list(pool.free_queue) == [2, 3, 1, 0]
    # Evicting block 1 drops its hash; block 0 stays cached.
    assert pool.get_new_blocks(3) == [2, 3, 1]
    assert pool.get_cached_block(b"h1") is None
    assert pool.get_cached_block(b"h0") == 0


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, b"x")
    pool.free([b])
    assert pool.num_free_blocks == 2
    pool.touch([b])
    assert pool.ref_cnt[b] == 1 and pool.num_free_blocks == 1
    pool.touch([b])
    pool.free([b])
    assert pool.ref_cnt[b] == 1 and pool.num_free_blocks == 1


def test_same_prefix_keeps_first_block_as_key():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"k")
    pool.cache_block(b, b"k")
    assert pool.get_cached_block(b"k") == a
    assert pool.block_hash[b] is None


def test_caching_disabled_registers_nothing():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, b"k")
    assert pool.get_cached_block(b"k") is None


def test_double_free_is_caught():
    pool = BlockPool(1)
    (a,) = pool.get_new_blocks(1)
    pool.free([a])
    try:
        pool.free([a])
    except AssertionError:
        return
    raise AssertionError("double free not detected")


def test_hash_is_chained_over_parent():
    h1 = hash_block_tokens(None, [1, 2, 3])
    assert hash_block_tokens(None, [1, 2, 3]) == h1
    assert hash_block_tokens(h1, [4]) != hash_block_tokens(None, [4])
    assert hash_block_tokens(None, [1, 2, 4]) != h1
