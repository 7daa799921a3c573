from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


def make(num_blocks=16, block_size=4, max_num_seqs=8, budget=16, caching=True, ratio=0.0):
    """ratio: the admission watermark's new_token_ratio; 0 (off) for the tests of the mechanics below it, which
    admit into a pool too small on purpose."""
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     new_token_ratio=ratio), kv), kv


def req(rid, n, max_tokens=8):
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens), max_tokens)


def run_step(s, out):
    s.update_from_output(out)
    for (r, _), samples in zip(out.scheduled, out.samples):
        if samples:
            r.output_token_ids.append(7)


def ids(out):
    return [(r.request_id, n) for r, n in out.scheduled]


def test_chunked_prefill_splits_long_prompt_and_mixes_with_decode():
    s, _ = make(budget=8)
    a, b = req("a", 3), req("b", 12)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert ids(out) == [("a", 3), ("b", 5)]
    run_step(s, out)
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0
    out = s.schedule()
    assert ids(out) == [("a", 1), ("b", 7)]  # a decodes while b's prefill continues
    run_step(s, out)
    assert b.num_output_tokens == 1
    assert ids(s.schedule()) == [("a", 1), ("b", 1)]


def test_max_num_seqs_limits_admission():
    s, _ = make(max_num_seqs=2, budget=100)
    for i in range(3):
        s.add_request(req(f"r{i}", 2))
    assert [r for r, _ in ids(s.schedule())] == ["r0", "r1"]
    assert len(s.waiting) == 1


def test_preempts_most_recent_when_pool_is_full_and_recomputes():
    # 4 blocks of 2 tokens. a and b take 2 blocks each (3 prompt tokens); at 5 tokens a needs a 3rd block.
    s, kv = make(num_blocks=4, block_size=2, budget=100)
    a, b = req("a", 3), req("b", 3)
    s.add_request(a)
    s.add_request(b)
    run_step(s, s.schedule())  # both prefilled, one token each: 4 tokens in 2 blocks each
    out = s.schedule()
    assert ids(out) == [("a", 1), ("b", 1)]
    run_step(s, out)  # 5 tokens each: both need a 3rd block next
    out = s.schedule()
    assert out.preempted == [b]
    assert ids(out) == [("a", 1)]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(s.waiting) == [b] and s.num_preemptions == 1
    assert kv.get_block_ids("b") == []
    run_step(s, out)
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    assert kv.pool.num_free_blocks == 4 or kv.enable_caching
    out = s.schedule()
    # b comes back with its prompt and its 2 outputs; 4 tokens (2 full blocks) were cached before preemption,
    # and a hit must leave the last token to compute.
    assert out.scheduled[0][0] is b
    assert out.scheduled[0][1] == 1 and b.num_computed_tokens == b.num_tokens == 5


def test_single_request_preempts_itself_rather_than_deadlock():
    s, kv = make(num_blocks=2, block_size=2, budget=100)
    a = req("a", 3)
    s.add_request(a)
    run_step(s, s.schedule())  # 3 computed + 1 sampled
    run_step(s, s.schedule())  # 4 computed + 1 sampled: the 5th token needs a 3rd block
    out = s.schedule()  # no victim but itself
    assert out.preempted == [a] and out.scheduled == []
    assert kv.pool.num_free_blocks == 2


def test_no_admission_in_a_step_that_preempted():
    s, _ = make(num_blocks=4, block_size=2, budget=100)
    a, b = req("a", 3), req("b", 3)
    s.add_request(a)
    s.add_request(b)
    run_step(s, s.schedule())
    run_step(s, s.schedule())
    c = req("c", 1)
    s.add_request(c)
    out = s.schedule()
    assert out.preempted == [b]
    assert [r.request_id for r in s.waiting] == ["b", "c"]


def test_prefix_hit_skips_cached_tokens():
    s, kv = make(num_blocks=16, block_size=4, budget=100)
    a = req("a", 9)
    s.add_request(a)
    run_step(s, s.schedule())
    b = req("b", 9)  # same prompt
    s.add_request(b)
    out = s.schedule()
    assert ids(out) == [("a", 1), ("b", 1)]
    assert b.num_cached_tokens == 8
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]


def test_finish_frees_blocks_unless_held():
    s, kv = make()
    a = req("a", 5)
    a.kv_hold = True
    s.add_request(a)
    run_step(s, s.schedule())
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    assert kv.get_block_ids("a") == [0, 1]
    assert s.running == []
    kv.free(a)
    assert kv.get_block_ids("a") == []


def test_async_scheduling_schedules_the_token_in_flight_and_stops_at_max_tokens():
    # The next step is scheduled before the previous one's tokens are read: a decode's input is the token in
    # flight; a request whose token in flight is its last (max_tokens) is not scheduled again.
    s, kv = make(budget=100)
    a, b = req("a", 5, max_tokens=2), req("b", 5, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    first = s.schedule()
    assert ids(first) == [("a", 5), ("b", 5)] and first.samples == [True, True]
    assert a.num_inflight_tokens == b.num_inflight_tokens == 1 and a.num_computed_tokens == 5
    second = s.schedule()  # first's tokens still unread
    assert ids(second) == [("a", 1), ("b", 1)] and second.samples == [True, True]
    assert a.num_inflight_tokens == 2 and a.num_computed_tokens == 6 and a.num_tokens == 5
    assert ids(s.schedule()) == []  # a: both of its tokens are in flight; b: its input is not sampled yet
    run_step(s, first)
    assert a.num_output_tokens == 1 and a.num_inflight_tokens == 1
    assert ids(s.schedule()) == [("b", 1)]  # a's last token is in flight
    # Blocks enter the prefix cache only up to tokens the host knows.
    assert kv.num_cached_blocks["a"] == 1  # 6 known tokens, block size 4


# ---- the admission watermark (new_token_ratio) ---------------------------------------------------------------
def run_to_end(s, kv, reqs):
    """Steps until every request finished (at max_tokens); returns the steps at which each was first admitted."""
    for r in reqs:
        s.add_request(r)
    admitted, step = {}, 0
    while s.has_unfinished():
        out = s.schedule()
        for r, _ in out.scheduled:
            admitted.setdefault(r.request_id, step)
        run_step(s, out)
        for r in list(s.running):
            if r.num_output_tokens >= r.max_tokens:
                s.finish(r, RequestStatus.FINISHED_LENGTH)
        step += 1
    assert kv.pool.num_free_blocks == kv.num_blocks
    return admitted


def test_the_watermark_admits_what_fits_at_max_tokens_and_nothing_is_preempted():
    # 16 blocks of 4: a request of 8 prompt tokens and 8 outputs ends in 4 blocks, its prompt takes 2. Without the
    # watermark all 8 are admitted at once (16 blocks) and preempt each other as they grow; with new_token_ratio 1
    # four run at a time, and the next four start when they are done.
    for ratio, first_wave, preempted in ((0.0, 8, True), (1.0, 4, False)):
        s, kv = make(num_blocks=16, block_size=4, budget=100, ratio=ratio)
        admitted = run_to_end(s, kv, [req(f"r{i}", 8) for i in range(8)])
        assert sum(step == 0 for step in admitted.values()) == first_wave, (ratio, admitted)
        assert (s.num_preemptions > 0) == preempted, (ratio, s.num_preemptions)


def test_the_watermark_counts_the_running_requests_growth():
    s, kv = make(num_blocks=16, block_size=4, budget=100, ratio=0.5)
    for i in range(5):
        s.add_request(req(f"r{i}", 8, max_tokens=16))  # 8 + 0.5 x 16 = 16 tokens expected: 4 blocks each
    out = s.schedule()
    assert ids(out) == [(f"r{i}", 8) for i in range(4)]  # 2 blocks each now, 2 more each expected: 16 in all
    assert [r.request_id for r in s.waiting] == ["r4"]
    assert kv.pool.num_free_blocks == 8  # and r4 would need 4 of them beyond the others' 8 of growth


def test_a_first_request_is_admitted_whenever_it_fits():
    s, kv = make(num_blocks=16, block_size=4, budget=100, ratio=1.0)
    s.add_request(req("big", 8, max_tokens=100))  # expected 27 blocks, more than the pool: nothing else runs
    assert ids(s.schedule()) == [("big", 8)]


def test_the_ratio_decays_while_nothing_is_preempted_and_rises_on_a_preemption():
    s, kv = make(num_blocks=2, block_size=2, budget=100, ratio=0.7)
    assert s.min_ratio == 0.7 * 0.14 and s.ratio_decay == (0.7 - s.min_ratio) / 600
    a = req("a", 3)
    s.add_request(a)
    run_step(s, s.schedule())
    run_step(s, s.schedule())
    assert s.new_token_ratio == 0.7 - 2 * s.ratio_decay
    out = s.schedule()  # the 5th token needs a 3rd block: a preempts itself
    assert out.preempted == [a] and s.new_token_ratio == 1.0  # nothing left running: no estimate but the worst
    s.new_token_ratio = s.min_ratio
    for _ in range(2 * 600):
        s.new_token_ratio = max(s.min_ratio, s.new_token_ratio - s.ratio_decay)
    assert s.new_token_ratio == s.min_ratio


def test_a_reservation_waits_behind_running_reserved_and_preempted_requests():
    s, kv = make(num_blocks=16, block_size=4, budget=100, ratio=1.0)

    def reserve(rid):
        r = req(rid, 8)  # 2 blocks now, 4 at its end
        if not s.can_reserve(r):
            return False
        assert kv.allocate_slots(r, 8)
        s.reserved[rid] = r
        return True

    assert [reserve(f"x{i}") for i in range(5)] == [True] * 4 + [False]
    s.reserved.pop("x3")
    kv.free(req("x3", 8))
    s.waiting.append(req("preempted", 8))  # holds nothing, will want 4 blocks back
    assert not reserve("y")
    s.waiting.clear()
    assert reserve("y")
