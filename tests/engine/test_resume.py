"""A request resumed with the outputs it generated elsewhere (issue 14: a migrated stream is re-issued as prompt +
the tokens so far) continues an undisturbed run: the same tokens, the same text deltas, the same finish, for greedy
and seeded sampling, penalties, min_tokens and stop strings, in one engine or across a prefill -> decode hand-off."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from engine import EngineArgs, LLMEngine, SamplingParams

ARGS = dict(model="random:tiny", device="cpu", kv_cache_memory=0.05, max_model_len=512)
PROMPT = [(i * 37) % 500 + 3 for i in range(40)]
N = 20


@pytest.fixture(scope="module")
def engines():
    """The original runs on a synchronous engine, the resumed requests on another, asynchronous one (the seeded
    draw's position must be right with a token in flight too)."""
    return (LLMEngine.from_engine_args(EngineArgs(**ARGS)),
            LLMEngine.from_engine_args(EngineArgs(**ARGS, async_scheduling=True)))


@dataclass
class Run:
    tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # per token: the text delta that came with it
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, out) -> None:
        assert len(out.new_token_ids) == 1, out
        self.tokens += out.new_token_ids
        self.texts.append(out.new_text)
        self.logprobs += out.new_logprobs or []
        self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        self.num_output_tokens, self.num_cached_tokens = out.num_output_tokens, out.num_cached_tokens


def run(engine: LLMEngine, requests: dict[str, tuple[SamplingParams, list[int]]]) -> dict[str, Run]:
    """Runs {request id: (params, prior outputs)} (prompt PROMPT) together to the end."""
    for rid, (params, prior) in requests.items():
        engine.add_request(rid, PROMPT, params, prior_output_token_ids=prior)
    runs = {rid: Run() for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            runs[out.request_id].add(out)
    assert all(c == 0 for c in engine.kv.pool.ref_cnt), "a block leaked"
    return runs


def stop_case(engine: LLMEngine) -> tuple[SamplingParams, int]:
    """Seeded sampling with min_tokens (masking a stop token id the unconstrained run draws early) and a stop string
    that spans two tokens after min_tokens; returns the params and the index of the token that completes it."""
    base = dict(temperature=0.9, top_k=50, seed=11, max_tokens=N)
    free = run(engine, {"free": (SamplingParams(**base), [])})["free"]
    base.update(min_tokens=6, stop_token_ids=[free.tokens[2]])
    masked = run(engine, {"masked": (SamplingParams(**base), [])})["masked"]
    assert free.tokens[2] not in masked.tokens[:6]
    # The last two characters of the text up to token j and the first two of token j + 1's, found first there.
    for j in range(8, len(masked.texts) - 1):
        before, after = "".join(masked.texts[:j + 1]), masked.texts[j + 1]
        stop = before[-2:] + after[:2]
        if masked.texts[j] and len(after) >= 2 and stop not in before and "\ufffd" not in stop:
            return SamplingParams(**base, stop=stop), j + 1
    pytest.fail(f"no stop string spanning two tokens in {masked.texts}")


def check_continues(whole: Run, resumed: Run, k: int) -> None:
    assert resumed.tokens == whole.tokens[k:], k
    assert resumed.texts == whole.texts[k:], k
    assert "".join(whole.texts[:k]) + "".join(resumed.texts) == "".join(whole.texts)
    assert (resumed.finish_reason, resumed.stop_reason) == (whole.finish_reason, whole.stop_reason), k
    assert resumed.num_output_tokens == whole.num_output_tokens == len(whole.tokens), k
    assert len(resumed.logprobs) == len(whole.logprobs[k:]), k  # only the new tokens have entries
    for got, want in zip(resumed.logprobs, whole.logprobs[k:]):
        assert got.keys() == want.keys() and all(abs(got[t] - want[t]) < 1e-4 for t in got), k


def test_resumed_requests_continue_an_undisturbed_run(engines):
    orig, other = engines
    cases = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True),
        "greedy_penalties": SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, presence_penalty=1.0,
                                           frequency_penalty=0.5, repetition_penalty=1.2),
        "seeded": SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=3, max_tokens=N, ignore_eos=True),
        "seeded_penalties": SamplingParams(temperature=0.8, seed=5, max_tokens=N, ignore_eos=True,
                                           repetition_penalty=1.3, frequency_penalty=0.4, logprobs=2),
    }
    cuts = {name: [1, 5, 11, N - 1] for name in cases}
    cases["stop"], stop_at = stop_case(orig)
    cuts["stop"] = [2, stop_at - 1, stop_at]  # inside min_tokens; the stop string ending in the next token, or across
    whole = run(orig, {name: (p, []) for name, p in cases.items()})
    assert whole["stop"].finish_reason == "stop" and len(whole["stop"].tokens) == stop_at + 1
    assert whole["greedy"].tokens != whole["greedy_penalties"].tokens, "the penalties changed nothing"
    resumed = run(other, {f"{name}@{k}": (cases[name], whole[name].tokens[:k]) for name in cases for k in cuts[name]})
    for name in cases:
        for k in cuts[name]:
            check_continues(whole[name], resumed[f"{name}@{k}"], k)


def test_a_resumed_prompt_hits_the_prefix_cache(engines):
    """On the engine that ran the original, the prompt and the prior outputs' full blocks are cached."""
    orig, _ = engines
    params = SamplingParams(temperature=0.9, seed=8, max_tokens=N, ignore_eos=True)
    whole = run(orig, {"w": (params, [])})["w"]
    resumed = run(orig, {"r": (params, whole.tokens[:9])})["r"]
    check_continues(whole, resumed, 9)
    assert resumed.num_cached_tokens == (len(PROMPT) + 9 - 1) // 16 * 16


def test_a_resumed_request_through_the_prefill_decode_hand_off(engines):
    """The migrated request re-prefilled on one engine (its first new token drawn there) and decoded on another."""
    pre, dec = engines
    params, stop_at = stop_case(pre)
    whole = run(pre, {"w": (params, [])})["w"]
    for k in (3, stop_at - 1):
        rid, prior = f"h{k}", whole.tokens[:k]
        # As the prefill service's max_tokens=1, min_tokens=min(min_tokens, 1), counting the prior outputs.
        first_params = SamplingParams(**{**params.__dict__, "max_tokens": k + 1,
                                         "min_tokens": min(params.min_tokens, k + 1)})
        pre.add_request(rid, PROMPT, first_params, kv_hold=True, prior_output_token_ids=prior)
        first = None
        while pre.has_unfinished_requests():
            for out in pre.step():
                if out.request_id == rid and out.new_token_ids:
                    first = out.new_token_ids[0]
        src = pre.get_block_ids(rid)
        dst = dec.reserve_prefilled(rid, PROMPT, params, prior_output_token_ids=prior)
        assert dst is not None and len(dst) == len(src)
        dec.kv_cache[dst] = pre.kv_cache[src]
        pre.release_kv(rid)
        got = Run()
        got.add(dec.commit_prefilled(rid, first))
        while dec.has_unfinished_requests():
            for out in dec.step():
                got.add(out)
        check_continues(whole, got, k)
    assert all(r == 0 for r in pre.kv.pool.ref_cnt) and all(r == 0 for r in dec.kv.pool.ref_cnt)


def test_prior_outputs_are_validated(engines):
    eng, _ = engines
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match=r"prior_output_token_ids: token id 512 is outside"):
        eng.add_request("v", PROMPT, p, prior_output_token_ids=[5, 512])
    with pytest.raises(ValueError, match=r"prior_output_token_ids: 4 tokens, must be fewer than max_tokens=4"):
        eng.add_request("v", PROMPT, p, prior_output_token_ids=[5] * 4)
    room = ARGS["max_model_len"] - len(PROMPT)
    with pytest.raises(ValueError, match=rf"prior_output_token_ids: {room} tokens.*max_model_len=512"):
        eng.add_request("v", PROMPT, SamplingParams(max_tokens=None), prior_output_token_ids=[5] * room)
    with pytest.raises(ValueError, match=r"n=2: prior_output_token_ids"):
        eng.add_request("v", PROMPT, SamplingParams(n=2), prior_output_token_ids=[5])
    with pytest.raises(ValueError, match=r"prior_output_token_ids: the request already finished \(stop, 7\)"):
        eng.add_request("v", PROMPT, SamplingParams(stop_token_ids=[7]), prior_output_token_ids=[5, 7, 5])
    with pytest.raises(ValueError, match=r"prior_output_token_ids: the request already finished \(stop, 'ab'\)"):
        eng.add_request("v", PROMPT, SamplingParams(stop="ab"), prior_output_token_ids=[97, 98])
    with pytest.raises(ValueError, match=r"prior_output_token_ids: token id -1"):
        eng.reserve_prefilled("v", PROMPT, p, prior_output_token_ids=[-1])
    # Within min_tokens a stop token is no stop: that request is still running.
    eng.add_request("v", PROMPT, SamplingParams(min_tokens=3, stop_token_ids=[7], max_tokens=4),
                    prior_output_token_ids=[5, 7])
    eng.abort("v")
    assert [(o.request_id, o.finish_reason) for o in eng.step()] == [("v", "abort")]
    assert not eng.has_unfinished_requests() and eng.kv.pool.num_free_blocks == eng.kv.num_blocks
