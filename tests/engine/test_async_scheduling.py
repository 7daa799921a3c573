"""Async scheduling (each step launched before the previous step's tokens are read) changes when the host learns
a token, never which token: every output equals the synchronous engine's, stops on a token in flight drop the
extra step's token, and no block leaks."""
from __future__ import annotations

import pytest

from engine import EngineArgs, LLMEngine, SamplingParams


def make_engine(async_scheduling: bool, **kw) -> LLMEngine:
    args = dict(model="random:tiny", device="cpu", kv_cache_memory=0.05, max_model_len=512,
                async_scheduling=async_scheduling)
    args.update(kw)
    return LLMEngine.from_engine_args(EngineArgs(**args))


def run_all(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]], abort_after: dict | None = None):
    """Adds the requests, steps to the end; returns {(id, index): (tokens, text, finish_reason, stop_reason,
    logprobs)}. abort_after: {request id: number of steps after which it is aborted}."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    got: dict = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, text, fin, stop, lps = got.get((out.request_id, out.index), ([], "", None, None, []))
            got[(out.request_id, out.index)] = (tokens + out.new_token_ids, text + out.new_text,
                                                out.finish_reason or fin, out.stop_reason or stop,
                                                lps + (out.new_logprobs or []))
        steps += 1
        for rid, n in (abort_after or {}).items():
            if steps == n:
                engine.abort(rid)
    assert all(c == 0 for c in engine.kv.pool.ref_cnt), "a block leaked"
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks
    return got


def prompts(n: int, vocab: int = 200) -> list[list[int]]:
    return [[(7 * i + 13 * j) % vocab + 1 for j in range(3 + 11 * i)] for i in range(n)]


@pytest.fixture(scope="module")
def engines():
    return make_engine(False), make_engine(True)


def test_greedy_stops_and_lengths_match_the_sync_engine(engines):
    sync, asyn = engines
    ps = prompts(8)
    first = [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)) for i, p in enumerate(ps)]
    base = run_all(sync, first)
    # Both engines run these first, so their prefix caches hold the same blocks below: a prompt computed whole and
    # one computed after a prefix hit may differ in the last bits (kernels/paged_attention_cpu.py).
    assert run_all(asyn, first) == base
    # Stop on a token that each request really produces mid-way (the 5th), so the step after it is in flight.
    reqs = []
    for i, p in enumerate(ps):
        tokens = base[(f"r{i}", 0)][0]
        kinds = [
            SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[tokens[4]]),
            SamplingParams(temperature=0.0, max_tokens=3 + i, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[base[(f"r{i}", 0)][1][5:8]]),
        ]
        reqs += [(f"r{i}k{k}", p, params) for k, params in enumerate(kinds)]
    want = run_all(sync, reqs)
    got = run_all(asyn, reqs)
    assert got == want
    assert any(v[2] == "stop" for v in want.values()), "no request stopped early: the test lost its point"


def test_sampling_seeds_penalties_min_tokens_and_n_match_the_sync_engine(engines):
    sync, asyn = engines
    ps = prompts(6)
    reqs = [
        ("seeded", ps[0], SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=7, max_tokens=16, ignore_eos=True)),
        ("n2", ps[1], SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=12, ignore_eos=True)),
        ("penalty", ps[2], SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5,
                                          max_tokens=16, ignore_eos=True)),
        ("min_tokens", ps[3], SamplingParams(temperature=0.0, min_tokens=6, max_tokens=16)),
        ("greedy", ps[4], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)),
        ("minp", ps[5], SamplingParams(temperature=0.7, min_p=0.05, seed=11, max_tokens=16, ignore_eos=True)),
    ]
    assert run_all(asyn, reqs) == run_all(sync, reqs)


def test_preemption_and_abort_in_flight_free_every_block():
    # 24 blocks of 16 tokens for 8 requests of up to 80 prompt tokens + 40 outputs: preemption happens (the
    # admission watermark, which would hold requests back instead, is off).
    sync, asyn = (make_engine(a, num_gpu_blocks_override=24, max_num_batched_tokens=64, max_model_len=256,
                              new_token_ratio=0.0) for a in (False, True))
    reqs = [(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
            for i, p in enumerate(prompts(8))]
    want = run_all(sync, reqs)
    got = run_all(asyn, reqs)
    assert got == want
    assert asyn.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    # Aborting requests whose next step is already launched: they end as aborted, their blocks come back.
    got = run_all(asyn, reqs, abort_after={"p1": 3, "p5": 9})
    assert got[("p1", 0)][2] == "abort" and got[("p5", 0)][2] == "abort"
    assert {k: v for k, v in got.items() if k[0] not in ("p1", "p5")} == \
        {k: v for k, v in want.items() if k[0] not in ("p1", "p5")}


def test_prefill_progress_reports_the_step_read_not_the_step_launched():
    # The prefill service streams a held request's blocks as each chunk's progress arrives: with async scheduling
    # the next chunk is already launched when a chunk is read, and must not be reported as computed yet.
    def progress(engine):
        engine.add_request("held", list(range(1, 90)), SamplingParams(temperature=0.0, max_tokens=1), kv_hold=True)
        seen = []
        while engine.has_unfinished_requests():
            seen += [(o.num_computed_tokens, o.new_token_ids) for o in engine.step() if o.request_id == "held"]
        engine.release_kv("held")
        return seen

    sync, asyn = (make_engine(a, max_num_batched_tokens=16) for a in (False, True))
    want = progress(sync)
    assert [n for n, _ in want] == [16, 32, 48, 64, 80, 89]
    assert progress(asyn) == want
