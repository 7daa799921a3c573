"""Steps with prompt tokens through PrefillGraphs' padded inputs (capture=False on the CPU: the same static
buffers, padding sequence and empty rows, run eagerly) give the eager engine's tokens and logprobs, write no KV for
padding tokens and leak no block. On CUDA the graphs themselves replay (tests/engine/test_cuda_parity.py)."""
from __future__ import annotations

import pytest
import torch

from engine import EngineArgs, LLMEngine, SamplingParams
from engine.cuda_graphs import PrefillGraphs
from tests.engine.test_async_scheduling import prompts, run_all


def make_engine(padded: bool, **kw) -> LLMEngine:
    args = dict(model="random:tiny", device="cpu", kv_cache_memory=0.05, max_model_len=256,
                max_num_batched_tokens=64, max_num_seqs=8)
    args.update(kw)
    engine = LLMEngine.from_engine_args(EngineArgs(**args))
    if padded:
        r = engine.runner
        r.prefill_graphs = PrefillGraphs(r, 64, args["max_num_seqs"], engine.max_model_len, capture=False)
    return engine


def test_sizes_and_keys():
    engine = make_engine(True)
    g = engine.runner.prefill_graphs
    assert g.token_sizes == [16, 32, 64]
    assert g.seq_sizes == [2, 8, 9]  # max_num_seqs 8 + the padding row
    assert g.key_for(1, 1) == (16, 2)
    assert g.key_for(16, 1) == (16, 2)  # no padding token: the padding row is an empty sequence
    assert g.key_for(17, 2) == (32, 8)
    assert g.key_for(40, 8) == (64, 9)
    assert g.key_for(65, 1) is None  # past the largest graph: eager
    assert g.key_for(10, 9) is None  # more rows than the step may have


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_padded_steps_match_the_eager_engine(async_scheduling):
    """Chunked prompts (64-token budget), decodes mixed into prompt steps, a shared prefix (prefix-cache hits: a
    chunk with context), n=2, logprobs."""
    ps = prompts(6)
    ps.append(ps[5][:40] + [3, 1, 4, 1, 5])  # shares 2 full blocks with prompt 5
    ps.append(list(range(1, 100)))  # two chunks and a bit
    reqs = [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2))
            for i, p in enumerate(ps)]
    reqs.append(("n2", ps[2], SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)))
    eager = run_all(make_engine(False, async_scheduling=async_scheduling), reqs)
    engine = make_engine(True, async_scheduling=async_scheduling)
    calls = []
    run = engine.runner.prefill_graphs.run
    engine.runner.prefill_graphs.run = lambda key, *a: calls.append(key) or run(key, *a)
    padded = run_all(engine, reqs)
    assert len(calls) >= 5 and any(k[1] > 2 for k in calls), calls  # prompt steps, some with several sequences
    assert padded.keys() == eager.keys()
    for key, (tokens, text, fin, stop, lps) in eager.items():
        p_tokens, p_text, p_fin, _, p_lps = padded[key]
        assert p_tokens == tokens and p_text == text and p_fin == fin, key
        for a, b in zip(lps, p_lps):
            for tok, lp in a.items():
                assert b[tok] == pytest.approx(lp, abs=1e-4), key


def test_padding_writes_no_kv():
    engine = make_engine(True, enable_prefix_caching=False)
    r = engine.runner
    r.kv_cache.fill_(float("nan"))
    engine.add_request("a", list(range(1, 21)), SamplingParams(temperature=0.0, max_tokens=1))  # 20 tokens -> 32
    engine.step()
    engine.step()
    written = ~torch.isnan(r.kv_cache).all(dim=(1, 2, 3, 4, 5))  # blocks with any slot written
    assert int(written.sum()) == 2  # the prompt's 2 blocks; the 12 padding tokens wrote nothing
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks
