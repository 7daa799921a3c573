"""The step-level engine: the prefill -> decode hand-off hooks, abort, stop strings, n > 1."""
from __future__ import annotations

import pytest

from engine import EngineArgs, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engines():
    args = dict(model="random:tiny", device="cpu", kv_cache_memory=0.05, max_model_len=512)
    return LLMEngine.from_engine_args(EngineArgs(**args)), LLMEngine.from_engine_args(EngineArgs(**args))


def run(engine, rid):
    tokens, text, reason = [], "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                text += out.new_text
                reason = out.finish_reason or reason
    return tokens, text, reason


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True),
])
def test_handoff_equals_one_engine(engines, params):
    """Prefill on one engine (kv_hold), KV blocks copied into another, decode there: same tokens as one engine."""
    pre, dec = engines
    prompt = [(i * 37) % 500 + 3 for i in range(70)]
    pre.add_request("single", prompt, params)
    expected, _, _ = run(pre, "single")

    first_params = SamplingParams(**{**params.__dict__, "max_tokens": 1})
    pre.add_request("p", prompt, first_params, kv_hold=True)
    first, _, _ = run(pre, "p")
    src = pre.get_block_ids("p")
    dst = dec.reserve_prefilled("p", prompt, params)
    assert dst is not None and len(dst) == len(src)
    dec.kv_cache[dst] = pre.kv_cache[src]
    pre.release_kv("p")
    out = dec.commit_prefilled("p", first[0])
    rest, _, reason = run(dec, "p")
    assert first + rest == expected
    assert reason == "length"
    assert all(r == 0 for r in pre.kv.pool.ref_cnt) and all(r == 0 for r in dec.kv.pool.ref_cnt)
    assert out.new_token_ids == first


def test_a_transferred_prompt_shares_the_prefix_blocks_decode_already_holds(engines):
    """The second prompt starts with the first one's 64 tokens: decode reserves only the blocks after them, its KV
    arrives only for those (as the decode service skips the rest), and it still decodes what one engine does."""
    pre, dec = engines
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    shared = [(i * 53) % 500 + 7 for i in range(64)]  # 4 full blocks of 16, unlike the other tests' prompts
    held = []
    for k, tail in enumerate(([7, 8, 9], [11, 12, 13, 14, 15])):
        prompt, rid = shared + tail, f"shared{k}"
        pre.add_request(rid + "-one", prompt, params)
        expected, _, _ = run(pre, rid + "-one")
        pre.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1), kv_hold=True)
        first, _, _ = run(pre, rid)
        src = pre.get_block_ids(rid)
        dst = dec.reserve_prefilled(rid, prompt, params)
        reused = dec.reused_prefix_blocks(rid)
        assert reused == (0 if k == 0 else 4), reused
        if k == 1:
            assert dst[:4] == held[:4]  # the first prompt's blocks, cached at its commit
        dec.kv_cache[dst[reused:]] = pre.kv_cache[src[reused:]]
        pre.release_kv(rid)
        dec.commit_prefilled(rid, first[0])
        rest, _, _ = run(dec, rid)
        assert first + rest == expected, k
        held = dst
    assert all(r == 0 for r in pre.kv.pool.ref_cnt) and all(r == 0 for r in dec.kv.pool.ref_cnt)


def test_reserve_refuses_when_full_and_abort_frees(engines):
    _, dec = engines
    prompt = list(range(3, 400))
    held = []
    limit = dec.kv.num_blocks // 25 + 2  # 397 tokens take 25 blocks of 16
    for i in range(limit):
        ids = dec.reserve_prefilled(f"r{i}", prompt, SamplingParams(max_tokens=4))
        if ids is None:
            break
        held.append(f"r{i}")
    assert held and len(held) == dec.kv.num_blocks // 25, "refused before the pool ran out, or never"
    assert f"r{len(held)}" not in dec.kv.req_to_hashes  # a refused reservation leaves nothing behind
    for rid in held:
        dec.abort(rid)
    assert all(r == 0 for r in dec.kv.pool.ref_cnt)
    assert not dec.kv.req_to_hashes, "an aborted reservation left its block hashes behind"


def test_abort_running_request_reports_and_frees(engines):
    eng, _ = engines
    eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request("b", list(range(3, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    st = eng.stats()
    assert (st.num_waiting, st.num_running, st.num_used_blocks, st.num_queued_tokens) == (2, 0, 0, 3 + 37)
    eng.step()
    st = eng.stats()
    assert (st.num_waiting, st.num_running, st.num_used_blocks, st.num_queued_tokens) == (0, 2, 1 + 3, 2)
    eng.abort("b")
    eng.step()
    eng.abort("a")
    outs = eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort")]
    assert not eng.has_unfinished_requests()
    assert eng.stats().num_used_blocks == 0
    assert all(r == 0 for r in eng.kv.pool.ref_cnt)


def test_n_children_share_the_prompt_and_finish_separately(engines):
    eng, _ = engines
    eng.add_request("n", [5, 6, 7, 8], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True))
    seen = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            seen.setdefault(o.index, []).extend(o.new_token_ids)
    assert sorted(seen) == [0, 1, 2] and all(len(v) == 5 for v in seen.values())
    assert len({tuple(v) for v in seen.values()}) > 1, "children with their own seeds should differ"


def test_validation_names_the_field(engines):
    eng, _ = engines
    with pytest.raises(ValueError, match="prompt: must not be empty"):
        eng.add_request("e", [], SamplingParams())
    with pytest.raises(ValueError, match="max_tokens=600"):
        eng.add_request("e", [1, 2], SamplingParams(max_tokens=600))
    with pytest.raises(ValueError, match="prompt_token_ids: token id"):
        eng.add_request("e", [10**6], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len=512"):
        eng.add_request("e", list(range(3, 600)), SamplingParams())


def _decode_cases(vocab: int, special: list[int]) -> list[list[int]]:
    import random

    rng = random.Random(0)
    cases = [[], special, [0xE2, 0x82], [0xE2, 0x82, 0xAC], [0xF0, 0x9F, 0x98, 0x80, 32, 0xC3]]
    for n in (1, 2, 5, 40):
        for _ in range(20):
            cases.append([rng.choice(special) if rng.random() < 0.1 else rng.randrange(vocab) for _ in range(n)])
    return cases


def test_fast_decoder_equals_tokenizer_decode(smollm2_dir):
    """The engine's detokenizer skips transformers' per-call wrapper: same text for every id list, specials and
    incomplete UTF-8 included, skip_special_tokens either way (synthetic byte-level and SmolLM2's BPE)."""
    from transformers import AutoTokenizer

    from engine.llm_engine import fast_decoder
    from engine.tokenizer import synthetic_tokenizer

    for tok in (synthetic_tokenizer(512), AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)):
        decode = fast_decoder(tok)
        assert decode.__code__.co_names == ()  # the fast path (not tokenizer.decode) was taken
        special = tok.all_special_ids
        for ids in _decode_cases(len(tok), special):
            for skip in (False, True):
                assert decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip), (ids, skip)


def test_fast_decoder_keeps_a_tokenizers_own_decode():
    """A tokenizer that cleans up spaces, or overrides decode, is decoded by its own decode."""
    from transformers import PreTrainedTokenizerFast

    from engine.llm_engine import fast_decoder
    from engine.tokenizer import synthetic_tokenizer

    tok = synthetic_tokenizer(512)
    tok.clean_up_tokenization_spaces = True
    ids = tok("a , b .", add_special_tokens=False).input_ids
    decode = fast_decoder(tok)
    assert decode.__code__.co_names == ("decode",)  # through tokenizer.decode, whatever clean-up it does
    assert decode(ids, False) == tok.decode(ids)

    class Custom(PreTrainedTokenizerFast):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return "custom"

    custom = Custom(tokenizer_object=synthetic_tokenizer(512)._tokenizer)
    assert fast_decoder(custom)(ids, False) == "custom"


def test_gc_frozen_leaves_the_heap_out_and_gives_it_back():
    import gc

    from engine.llm_engine import gc_frozen

    assert gc.get_freeze_count() == 0
    before = [[]]  # a container alive on entry
    with gc_frozen(collect=True):
        frozen = gc.get_freeze_count()
        assert frozen > 0 and not any(o is before for o in gc.get_objects())
        # Already frozen: leaves it as it is (nothing frozen again; the count may only fall, as frozen objects that
        # lose their last reference are freed, e.g. by a thread of an earlier test winding down: CI saw 2 go).
        with gc_frozen():
            assert 0 < gc.get_freeze_count() <= frozen
        assert 0 < gc.get_freeze_count() <= frozen
    assert gc.get_freeze_count() == 0
    assert any(o is before for o in gc.get_objects(generation=2))
