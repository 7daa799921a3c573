"""Structured outputs through the engine with random:tiny: random weights, so only the grammar makes the outputs
valid. Every constraint holds for many seeded samples (batched as n completions), and the tokens do not depend on
how the engine gets there: async scheduling, preemption, chunked prefill, a resumed request."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine import EngineArgs, LLMEngine, SamplingParams
from engine.sampling_params import StructuredOutputsParams as S

REGEX = r"[a-c]{3}-\d{2}"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "ok", "kind"], "additionalProperties": False}


def make_engine(**kw) -> LLMEngine:
    args = dict(model="random:tiny", device="cpu", kv_cache_memory=0.05, max_model_len=512, async_scheduling=False)
    args.update(kw)
    return LLMEngine.from_engine_args(EngineArgs(**args))


def run(engine: LLMEngine, requests) -> dict:
    """Adds (id, prompt, params[, prior]) requests, steps to the end; {(id, index): (token ids, text, finish)}."""
    for rid, prompt, params, *prior in requests:
        engine.add_request(rid, prompt, params, prior_output_token_ids=prior[0] if prior else None)
    got: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            toks, text, _ = got.get((out.request_id, out.index), ([], "", None))
            got[(out.request_id, out.index)] = (toks + out.new_token_ids, text + out.new_text, out.finish_reason)
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks, "a block leaked"
    assert not engine.requests and not engine._grammar_waiting
    return got


def prompt(i: int, n: int = 5) -> list[int]:
    return [(7 * i + 13 * j) % 250 + 1 for j in range(n)]


@pytest.fixture(scope="module")
def engines():
    return make_engine(), make_engine(async_scheduling=True)


def test_regex_holds_for_100_seeded_samples_sync_and_async(engines):
    params = SamplingParams(n=100, temperature=1.0, seed=7, max_tokens=12, structured_outputs=S(regex=REGEX))
    results = [run(e, [("r", prompt(0), params)]) for e in engines]
    texts = [results[0][("r", i)][1] for i in range(100)]
    assert all(re.fullmatch(REGEX, t) for t in texts), [t for t in texts if not re.fullmatch(REGEX, t)]
    assert all(results[0][("r", i)][2] == "stop" for i in range(100))
    assert len(set(texts)) > 50  # seeded draws differ between completions
    assert results[0] == results[1]  # async scheduling changes when tokens are read, not which


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_async_matches_sync_and_holds():
    """The same on a GPU (pinned mask buffers, the copies on their own stream, the Triton kernel, CUDA graphs): a
    JSON schema and a regex hold for seeded samples, and async scheduling gives the synchronous engine's tokens."""
    reqs = [("j", prompt(2), SamplingParams(n=16, temperature=1.0, seed=2, max_tokens=80,
                                            structured_outputs=S(json=SCHEMA, disable_any_whitespace=True))),
            ("r", prompt(0), SamplingParams(n=48, temperature=1.0, seed=7, max_tokens=12,
                                            structured_outputs=S(regex=REGEX))),
            ("free", prompt(4), SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))]
    got = [run(make_engine(device="cuda", async_scheduling=a, kv_cache_memory=0.2), reqs) for a in (False, True)]
    for i in range(48):
        assert re.fullmatch(REGEX, got[0][("r", i)][1]) and got[0][("r", i)][2] == "stop"
    for i in range(16):
        if got[0][("j", i)][2] == "stop":
            jsonschema.validate(json.loads(got[0][("j", i)][1]), SCHEMA)
    assert got[0] == got[1]


@pytest.mark.slow
def test_choice_and_json_schema_hold(engines):
    sync, asyn = engines
    reqs = [("c", prompt(1), SamplingParams(n=30, temperature=1.0, seed=1, max_tokens=8, min_tokens=8,
                                            structured_outputs=S(choice=["red", "green", "blue"]))),
            ("j", prompt(2), SamplingParams(n=6, temperature=1.0, seed=2, max_tokens=80,
                                            structured_outputs=S(json=SCHEMA, disable_any_whitespace=True))),
            ("g", prompt(3), SamplingParams(temperature=0.0, max_tokens=80,
                                            structured_outputs=S(json=SCHEMA, disable_any_whitespace=True))),
            ("free", prompt(4), SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))]
    got = run(sync, reqs)
    for i in range(30):
        # min_tokens does not hold a grammar's end back (it would leave no token to draw)
        assert got[("c", i)][1] in ("red", "green", "blue") and got[("c", i)][2] == "stop"
    for key in [("j", i) for i in range(6)] + [("g", 0)]:
        text, finish = got[key][1], got[key][2]
        assert finish == "stop", (key, text)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(got[("free", 0)][0]) == 8  # an unconstrained request in the same batches is untouched
    assert run(asyn, reqs) == got


@pytest.mark.slow
def test_preemption_and_chunked_prefill_keep_the_tokens(engines):
    sync, _ = engines
    long_prompt = prompt(5, 300)
    reqs = [(f"p{i}", prompt(10 + i, 40), SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=40,
                                                          structured_outputs=S(json=SCHEMA,
                                                                               disable_any_whitespace=True)))
            for i in range(3)] + [("long", long_prompt, SamplingParams(temperature=1.0, seed=9, max_tokens=12,
                                                                       structured_outputs=S(regex=REGEX)))]
    base = run(sync, reqs)
    # 24 blocks of 16 tokens hold the long request (20 blocks) but not every request at once (no admission
    # watermark: admitted requests outgrow the pool and preempt each other); 32-token chunks.
    small = make_engine(num_gpu_blocks_override=24, max_model_len=384, max_num_batched_tokens=32, max_num_seqs=8,
                        new_token_ratio=0.0, async_scheduling=True)
    got = run(small, reqs)
    assert small.scheduler.num_preemptions > 0
    assert got == base
    for key, (_, text, finish) in got.items():
        if key[0] == "long":
            assert re.fullmatch(REGEX, text) and finish == "stop"
        elif finish == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)


def test_async_constrained_steps_launch_before_the_previous_is_read(engines):
    """Under async scheduling a constrained step does not wait for the previous step's tokens before its launch:
    the forward pass is queued first, and the previous step is read (its tokens accepted into the matchers, on the
    grammar thread, then the mask filled there) before the mask is applied, so the matchers stand after every
    output token when it is."""
    _, asyn = engines
    events, filled = [], []
    runner, masks = asyn.runner, asyn.runner.sampler.token_masks
    orig_forward, orig_read, orig_fill, orig_launch = runner.forward, asyn._read_step, masks.fill, masks.launch

    def forward(*a, **kw):
        events.append("forward")
        return orig_forward(*a, **kw)

    def read_step(*a, **kw):
        events.append("read")
        return orig_read(*a, **kw)

    def fill(grammars, rows, pin):
        events.append("mask")
        filled.append(grammars)
        return orig_fill(grammars, rows, pin)

    def launch(logits):
        by_grammar = {id(r.grammar): r for r in asyn.requests.values() if r.grammar is not None}
        for g in filled.pop():
            assert g.num_accepted == len(by_grammar[id(g)].output_token_ids)
        return orig_launch(logits)

    runner.forward, asyn._read_step, masks.fill, masks.launch = forward, read_step, fill, launch
    try:
        params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=40,
                                structured_outputs=S(json=SCHEMA, disable_any_whitespace=True))
        got = run(asyn, [("o", prompt(9), params)])
    finally:
        del runner.forward, asyn._read_step, masks.fill, masks.launch
    for i in range(4):
        if got[("o", i)][2] == "stop":
            jsonschema.validate(json.loads(got[("o", i)][1]), SCHEMA)
    steps = "".join({"forward": "F", "read": "R", "mask": "M"}[e] for e in events)
    # The prefill step (launch, mask), then every step: launch, read the previous, mask (none once every row has
    # finished); the last call reads the last step. Reading before a launch would show as "RF".
    assert re.fullmatch(r"FM(FRM?)+R", steps) and "FRM" * 5 in steps, steps


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failing_matcher_ends_the_constrained_requests_only(monkeypatch, async_scheduling):
    """xgrammar raising on the grammar thread aborts that step's constrained requests (never samples them
    unmasked); the unconstrained request in the same batches finishes as it would alone, and no block leaks."""
    from engine.structured_output import GrammarManager

    engine = make_engine(async_scheduling=async_scheduling)
    free = ("free", prompt(4), SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True))
    alone = run(engine, [free])
    calls = []
    orig = GrammarManager.accept

    def accept(self, grammars, tokens):
        calls.append(len(grammars))
        if len(calls) == 3:
            raise RuntimeError("matcher broke")
        return orig(self, grammars, tokens)

    monkeypatch.setattr(GrammarManager, "accept", accept)
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=40,
                            structured_outputs=S(json=SCHEMA, disable_any_whitespace=True))
    got = run(engine, [("j", prompt(2), params), free])
    assert [got[("j", i)][2] for i in range(3)] == ["abort"] * 3, got
    assert got[("free", 0)] == alone[("free", 0)]
    assert run(engine, [("k", prompt(3), params)])[("k", 0)][2] in ("stop", "length")  # the engine goes on
    engine.close()


def test_resumed_request_continues_the_grammar(engines):
    sync, _ = engines
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=80,
                            structured_outputs=S(json=SCHEMA, disable_any_whitespace=True))
    tokens, text, _ = run(sync, [("a", prompt(6), params)])[("a", 0)]
    k = 7
    rest = run(sync, [("b", prompt(6), params, tokens[:k])])[("b", 0)]
    assert rest[0] == tokens[k:]
    with pytest.raises(ValueError, match="prior_output_token_ids: output token 0 .* not allowed"):
        sync.add_request("bad", prompt(6), params, prior_output_token_ids=sync.tokenize("nope"))
    assert "bad" not in sync.children


def test_one_compile_per_constraint_across_requests(engines):
    sync, _ = engines
    before = sync.grammars.num_compiles
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, structured_outputs=S(regex=r"x[0-9]{2}z"))
    run(sync, [("a", prompt(7), params), ("b", prompt(8), params)])
    assert sync.grammars.num_compiles == before + 1


def test_a_tokenizer_smaller_than_the_logits_keeps_json_valid(tmp_path):
    """--tokenizer: 300 tokens against random:tiny's 512 logits; the grammar never allows the padding rows."""
    from engine.tokenizer import synthetic_tokenizer

    synthetic_tokenizer(300).save_pretrained(tmp_path)
    engine = make_engine(tokenizer=str(tmp_path))
    try:
        assert len(engine.tokenizer) == 300
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=200, n=4,
                                structured_outputs=S(json=SCHEMA, disable_any_whitespace=True))
        outs = run(engine, [("r", prompt(0), params)])
    finally:
        engine.close()
    for ids, text, finish in outs.values():
        assert finish == "stop" and max(ids) < 300
        jsonschema.validate(json.loads(text), SCHEMA)
