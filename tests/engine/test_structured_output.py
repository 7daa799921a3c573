"""engine/structured_output.py and StructuredOutputsParams: checking constraints, compiling them once, the matcher
walk a sampler takes (random allowed tokens until the grammar ends) for each kind, and the bitmask against its
plain-torch reference. No model: the synthetic byte-level tokenizer stands in for random:tiny's."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from engine.sampling_params import MAX_STRUCTURED_OUTPUT_BYTES, SamplingParams, StructuredOutputsParams
from engine.structured_output import GrammarManager, TokenMasks, fill_bitmask
from engine.tokenizer import synthetic_tokenizer

VOCAB = 512
S = StructuredOutputsParams


@pytest.fixture(scope="module")
def tokenizer():
    return synthetic_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def manager(tokenizer):
    m = GrammarManager(tokenizer, VOCAB, [tokenizer.eos_token_id])
    yield m
    m.close()


def walk(manager: GrammarManager, tokenizer, so: S, seed: int, max_tokens: int = 200) -> tuple[str, bool]:
    """Samples uniformly among the allowed tokens, as a sampler would under the mask; returns (text, ended)."""
    g = manager.grammar_for(SamplingParams(structured_outputs=so))
    assert g.activate([]) is None
    rng = random.Random(seed)
    out: list[int] = []
    for _ in range(max_tokens):
        mask = fill_bitmask([g], VOCAB)
        allowed = [t for t in range(VOCAB) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
        assert allowed, "the grammar left no token"
        # Prefer ending once allowed half the time, so that walks are short and do end.
        if tokenizer.eos_token_id in allowed and rng.random() < 0.5:
            token = tokenizer.eos_token_id
        else:
            token = rng.choice(allowed)
        out.append(token)
        assert g.advance(out) is None
        if g.terminated:
            return tokenizer.decode(out, skip_special_tokens=True), True
    return tokenizer.decode(out, skip_special_tokens=True), False


def test_regex_and_choice_walks_match(manager, tokenizer):
    for seed in range(8):
        text, ended = walk(manager, tokenizer, S(regex=r"[a-c]{2,4}-\d{1,3}"), seed)
        assert ended and re.fullmatch(r"[a-c]{2,4}-\d{1,3}", text), text
        text, ended = walk(manager, tokenizer, S(choice=["yes", "no", "a \"quoted\" one"]), seed)
        assert ended and text in ("yes", "no", 'a "quoted" one'), text


def test_json_schema_walks_validate(manager, tokenizer):
    # (A string with maxLength lets xgrammar 0.2.9 take raw control characters, invalid JSON: a pattern does not.)
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z ]{0,5}$"},
                                               "ok": {"type": "boolean"},
                                               "kind": {"enum": ["a", "b"]}},
              "required": ["name", "ok", "kind"], "additionalProperties": False}
    for seed in range(5):
        text, ended = walk(manager, tokenizer, S(json=schema, disable_any_whitespace=True), seed)
        assert ended, text
        jsonschema.validate(json.loads(text), schema)
        value = json.loads(text)
        assert text == json.dumps(value), text  # fixed separators, the schema's property order
        assert list(value) == ["name", "ok", "kind"]
    text, ended = walk(manager, tokenizer, S(json_object=True, disable_any_whitespace=True), 0, max_tokens=400)
    if ended:
        assert isinstance(json.loads(text), dict)


def test_ebnf_grammar_walks_belong(manager, tokenizer):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    for seed in range(5):
        text, ended = walk(manager, tokenizer, S(grammar=grammar), seed)
        assert ended and re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text), text


def test_disable_additional_properties(manager, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"]}
    for seed in range(3):
        text, ended = walk(manager, tokenizer, S(json=schema, disable_any_whitespace=True,
                                                 disable_additional_properties=True), seed)
        assert ended and set(json.loads(text)) == {"a"}, text


def test_exactly_one_kind_and_limits():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar.*got regex, choice"):
        S(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="got none"):
        S()
    with pytest.raises(ValueError, match=f"structured_outputs.regex: {MAX_STRUCTURED_OUTPUT_BYTES + 1} bytes, "
                                         f"must be at most {MAX_STRUCTURED_OUTPUT_BYTES}"):
        S(regex="a" * (MAX_STRUCTURED_OUTPUT_BYTES + 1))
    with pytest.raises(ValueError, match="structured_outputs.json: .* bytes, must be at most"):
        S(json={"enum": ["x" * MAX_STRUCTURED_OUTPUT_BYTES]})
    with pytest.raises(ValueError, match="structured_outputs.choice: must be a non-empty list"):
        S(choice=[])
    with pytest.raises(ValueError, match="structured_outputs.whitespace_pattern: not supported"):
        S(json={"type": "object"}, whitespace_pattern=r"\s*")
    with pytest.raises(ValueError, match="structured_outputs: unknown field.*jsn"):
        SamplingParams(structured_outputs={"jsn": {}})


def test_invalid_constraints_name_the_field():
    with pytest.raises(ValueError, match=r"structured_outputs.regex: invalid \(Regex parsing error"):
        S(regex="a(")
    with pytest.raises(ValueError, match=r"structured_outputs.json: invalid \(.*foo"):
        S(json={"type": "foo"})
    with pytest.raises(ValueError, match="structured_outputs.json: not valid JSON"):
        S(json="{nope")
    with pytest.raises(ValueError, match=r"structured_outputs.grammar: invalid \(.*undefined_rule"):
        S(grammar="root ::= undefined_rule")


def test_one_compile_per_canonical_constraint(tokenizer):
    m = GrammarManager(tokenizer, VOCAB, [tokenizer.eos_token_id], max_cached=2)
    try:
        a = SamplingParams(structured_outputs=S(json='{"type": "object", "required": ["x"]}'))
        b = SamplingParams(structured_outputs=S(json={"type": "object", "required": ["x"]}))  # same, other spacing
        ga, gb = m.grammar_for(a), m.grammar_for(b)
        assert m.num_compiles == 1 and ga.future is gb.future
        assert ga.activate([]) is None and gb.activate([]) is None
        m.grammar_for(SamplingParams(structured_outputs=S(regex="x")))
        m.grammar_for(SamplingParams(structured_outputs=S(regex="y")))  # evicts the JSON one (bound 2)
        assert len(m._cache) == 2
        m.grammar_for(a)
        assert m.num_compiles == 4
        assert m.grammar_for(SamplingParams()) is None
    finally:
        m.close()


def test_padding_rows_of_the_model_vocab_are_never_allowed(tokenizer):
    m = GrammarManager(tokenizer, VOCAB + 100, [tokenizer.eos_token_id])  # 100 embedding rows past the tokenizer
    try:
        g = m.grammar_for(SamplingParams(structured_outputs=S(regex=r"[^x]*")))
        assert g.activate([]) is None
        logits = torch.zeros(1, VOCAB + 100)
        TokenMasks(VOCAB + 100).apply(logits, [g], [0])
        assert torch.isinf(logits[0, VOCAB:]).all()
        allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
        assert set(range(ord(" "), ord("x"))) <= set(allowed) and ord("x") not in allowed
    finally:
        m.close()


def test_prior_tokens_the_grammar_refuses(manager, tokenizer):
    g = manager.grammar_for(SamplingParams(structured_outputs=S(choice=["yes", "no"])))
    err = g.activate(tokenizer("maybe").input_ids)
    assert err is not None and "output token 0" in err


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_token_masks_mask_the_constrained_rows_as_xgrammar_does(manager, tokenizer, device):
    """TokenMasks (packed constrained rows, xgrammar's batch fill, kernels.apply_token_bitmask) against xgrammar's own
    fill and apply over the whole batch, step after step with the buffers reused (and grown). On CUDA: pinned
    buffers, the copies on their own stream, the Triton kernel."""
    import xgrammar

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    constraints = [S(regex=r"[a-c]{3}-\d{2}"), S(json=schema, disable_any_whitespace=True), S(choice=["red", "green"])]
    grammars = [manager.grammar_for(SamplingParams(structured_outputs=c)) for c in constraints * 4]
    for g in grammars:
        assert g.activate([]) is None
    masks, rng = TokenMasks(VOCAB), random.Random(0)
    for step, batch in enumerate([3, 6, 12, 12]):
        rows = sorted(rng.sample(range(batch + 2), batch))  # (some rows of the batch unconstrained)
        live = grammars[:batch]
        logits = torch.randn(batch + 2, VOCAB)
        got = logits.to(device)
        masks.apply(got, live, rows)
        got = got.cpu()
        whole = xgrammar.allocate_token_bitmask(batch + 2, VOCAB)
        for g, row in zip(live, rows):
            g.matcher.fill_next_token_bitmask(whole, row)
        want = logits.clone()
        xgrammar.apply_token_bitmask_inplace(want, whole, indices=rows)
        assert torch.equal(got, want), step
        assert torch.equal(fill_bitmask(live, VOCAB, batch_matcher=xgrammar.BatchGrammarMatcher(2)),
                           fill_bitmask(live, VOCAB))
        for g, row in zip(live, rows):  # each takes an allowed token
            token = int(torch.isfinite(got[row]).nonzero()[0])
            if not g.terminated:
                g.matcher.accept_token(token)


def test_structural_tag_both_forms(manager, tokenizer):
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi there"}}
    text, ended = walk(manager, tokenizer, S(structural_tag=json.dumps(tag)), 0)
    assert ended and text == "hi there"
    legacy = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]}
    S(structural_tag=json.dumps(legacy))  # vLLM's older form parses too
    with pytest.raises(ValueError, match="structured_outputs.structural_tag: invalid"):
        S(structural_tag='{"structures": 3}')


@pytest.mark.parametrize("threads", [1, 4])
def test_batch_accept_over_threads_equals_one_at_a_time(manager, tokenizer, monkeypatch, threads):
    """GrammarManager.accept (xgrammar's batch accept, the rows split over threads) leaves every matcher where
    advance() one token at a time does; a refused token is not counted and leaves its matcher as it was."""
    import engine.structured_output as so

    monkeypatch.setattr(so, "fill_threads", lambda: threads)
    local = GrammarManager(tokenizer, VOCAB, [tokenizer.eos_token_id])
    params = SamplingParams(structured_outputs=S(regex=r"[a-c]{6}-\d{6}"))
    n = 4 * so.MIN_ACCEPT_ROWS_PER_THREAD + 3  # (uneven chunks)
    batch, single = ([local.grammar_for(params) for _ in range(n)] for _ in range(2))
    for g in batch + single:
        assert g.activate([]) is None
    rng, outs = random.Random(1), [[] for _ in range(n)]
    for step in range(8):
        mask = fill_bitmask(single, VOCAB)
        tokens = []
        for i in range(n):
            allowed = [t for t in range(VOCAB) if (int(mask[i, t // 32]) >> (t % 32)) & 1]
            # Row 5 gets a token its grammar refuses at step 3.
            tokens.append(tokenizer.convert_tokens_to_ids("z") if (i, step) == (5, 3) else rng.choice(allowed))
        local.accept(batch, tokens)
        for i, (g, t) in enumerate(zip(single, tokens)):
            err = g.advance(outs[i] + [t])
            if err is None:
                outs[i].append(t)
            else:
                assert (i, step) == (5, 3), err
        assert [g.num_accepted for g in batch] == [g.num_accepted for g in single]
        assert torch.equal(fill_bitmask(batch, VOCAB), fill_bitmask(single, VOCAB)), step
    assert batch[5].num_accepted == 7
    local.close()
