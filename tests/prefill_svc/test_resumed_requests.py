"""A request resumed with the output tokens it already sent (issue 14: the router moves a stream off a failed
instance) through the real services in this process: a prefill instance computes prompt + prior tokens and sends
their KV to a decode instance, or the decode instance prefills it locally. Either way the tokens, the text deltas,
the logprobs and the finish continue an undisturbed run exactly, and no block stays held."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import pytest

from engine import LLM, SamplingParams
from protos.tandem.v1 import common_pb2, decode_pb2, prefill_pb2
from svc_pair import ARGS, run_pair

PROMPT = list(range(20, 120))  # 100 tokens: 4 chunks of 32, 7 blocks
N = 24


@dataclass
class Stream:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish: int = 0
    num_output_tokens: int = 0
    released: list[str] = field(default_factory=lambda: [""])  # the client's text after each token

    def add(self, d: common_pb2.TokenDelta) -> None:
        self.tokens += d.token_ids
        self.text += d.text
        if d.token_ids:  # (the decode instance streams one token a step)
            self.released += [self.released[-1]] * (len(d.token_ids) - 1) + [self.text]
        else:
            self.released[-1] = self.text
        self.logprobs += [{c.token_id: c.logprob for c in p.candidates} for p in d.logprobs]
        self.finish = d.finish_reason or self.finish
        self.num_output_tokens = d.num_output_tokens


async def through_pair(pstub, dstub, daddr, rid: str, params: common_pb2.SamplingParams, prior=()) -> Stream:
    """The router's path: a reservation on decode, the prompt (and prior tokens) to prefill naming it."""
    s = Stream()
    dcall = dstub.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=PROMPT, params=params,
                                                  prior_output_token_ids=prior, kv_transfer_timeout_ms=10_000))
    try:
        assert (await dcall.read()).HasField("reserved")
        async for r in pstub.Prefill(prefill_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=PROMPT, params=params, decode_address=daddr,
                prior_output_token_ids=prior)):
            if r.HasField("first_token"):
                s.add(r.first_token.delta)
                if s.finish:
                    return s
        while (r := await dcall.read()) is not grpc.aio.EOF:
            s.add(r.delta)
        return s
    finally:
        dcall.cancel()


async def locally(dstub, rid: str, params: common_pb2.SamplingParams, prior=()) -> Stream:
    """The router's fallback without a prefill instance: the decode instance prefills itself."""
    s = Stream()
    async for r in dstub.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=PROMPT, params=params,
                                                         prior_output_token_ids=prior, prefill_locally=True)):
        assert r.HasField("delta")
        s.add(r.delta)
    return s


async def idle(*stubs):
    for _ in range(100):
        loads = [await s.GetLoad(common_pb2.GetLoadRequest()) for s in stubs]
        if all(x.num_used_blocks == 0 and x.num_tracked_requests == 0 for x in loads):
            break
        await asyncio.sleep(0.05)
    return loads


def check_continues(whole: Stream, resumed: Stream, k: int) -> None:
    assert resumed.tokens == whole.tokens[k:], k
    assert (resumed.finish, resumed.num_output_tokens) == (whole.finish, whole.num_output_tokens), k
    assert len(resumed.logprobs) == len(whole.logprobs) - k if whole.logprobs else not resumed.logprobs, k
    for got, want in zip(resumed.logprobs, whole.logprobs[k:]):
        assert got.keys() == want.keys() and all(abs(got[t] - want[t]) < 1e-4 for t in got), k


def stop_string(texts: list[str]) -> tuple[str, int]:
    """The last two characters of the text up to token j and the first (one or two) of token j + 1's text, found
    first there; and j + 1."""
    for j in range(5, len(texts) - 1):
        before, after = "".join(texts[:j + 1]), texts[j + 1]
        stop = before[-2:] + after[:2]
        if texts[j] and after and stop not in before and "\ufffd" not in stop:
            return stop, j + 1
    pytest.fail(f"no stop string spanning two tokens in {texts}")


CASES = {
    "greedy": dict(temperature=0.0, max_tokens=N, ignore_eos=True),
    "seeded": dict(temperature=0.9, top_k=40, seed=7, max_tokens=N, ignore_eos=True, repetition_penalty=1.2,
                   frequency_penalty=0.3, logprobs=2),
}


@pytest.fixture(scope="module")
def offline():
    """Each case's undisturbed offline run (engine.LLM)."""
    llm = LLM(**ARGS)
    return {name: llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(**kw))[0].outputs[0]
            for name, kw in CASES.items()}


def test_resumed_requests_continue_exactly_through_prefill_and_locally(engines, offline):
    whole_offline = offline
    cuts = [0, 1, 7, 16, N - 1]  # 0: an ordinary request; 7 + 100 = 107 tokens: a block and a bit of prior KV

    async def scenario(pcore, pstub, dstub, daddr):
        got = {}
        for name, kw in CASES.items():
            p = common_pb2.SamplingParams(**kw)
            whole = got[name, "pair", 0] = await through_pair(pstub, dstub, daddr, f"{name}-w", p)
            for k in cuts[1:]:
                got[name, "pair", k] = await through_pair(pstub, dstub, daddr, f"{name}-p{k}", p, whole.tokens[:k])
            for k in cuts:
                got[name, "local", k] = await locally(dstub, f"{name}-l{k}", p, whole.tokens[:k])
        return got, await idle(pstub, dstub)

    got, loads = run_pair(engines, scenario, default_kv_timeout_s=5)
    assert all(x.num_used_blocks == 0 and x.num_tracked_requests == 0 for x in loads), loads
    for name in CASES:
        whole = got[name, "pair", 0]
        assert whole.tokens == whole_offline[name].token_ids, name
        # The streamed text is the offline run's (the first token's text is cut as a running request cuts it).
        assert whole.text == whole_offline[name].text, name
        for (case, how, k), resumed in got.items():
            if case == name:
                check_continues(whole, resumed, k)
                assert whole.released[k] + resumed.text == whole.text, (name, how, k)


def test_stop_string_and_min_tokens_count_the_prior_tokens(engines, offline):
    """min_tokens reaching past the cut masks a stop token id there as in the undisturbed run; a stop string that
    spans the token before the cut and the one after it, or ends in a later one, stops the resumed request where it
    stopped the undisturbed one."""
    whole_offline = offline
    kw = dict(CASES["greedy"], min_tokens=4, stop_token_ids=[whole_offline["greedy"].token_ids[2]])

    async def scenario(pcore, pstub, dstub, daddr):
        masked = await through_pair(pstub, dstub, daddr, "stop-m", common_pb2.SamplingParams(**kw))
        texts = [b[len(a):] for a, b in zip(masked.released, masked.released[1:])]
        stop, stop_at = stop_string(texts)
        p = common_pb2.SamplingParams(**kw, stop=[stop])
        whole = await through_pair(pstub, dstub, daddr, "stop-w", p)
        resumed = {k: await through_pair(pstub, dstub, daddr, f"stop-p{k}", p, whole.tokens[:k])
                   for k in (2, stop_at - 1, stop_at)}
        local = {k: await locally(dstub, f"stop-l{k}", p, whole.tokens[:k]) for k in (2, stop_at)}
        return masked, stop_at, whole, resumed, local, await idle(pstub, dstub)

    masked, stop_at, whole, resumed, local, loads = run_pair(engines, scenario, default_kv_timeout_s=5)
    assert kw["stop_token_ids"][0] not in masked.tokens[:4]
    assert whole.finish == common_pb2.FINISH_REASON_STOP and whole.tokens == masked.tokens[:stop_at + 1]
    for k, r in [*resumed.items(), *local.items()]:
        check_continues(whole, r, k)
        assert whole.released[k] + r.text == whole.text, k
    assert all(x.num_used_blocks == 0 for x in loads)


@pytest.mark.parametrize("prior,message", [
    ([5, 512], "prior_output_token_ids: token id 512 is outside the vocabulary [0, 512)"),
    ([-1], "prior_output_token_ids: token id -1 is outside"),
    ([5] * 6, "prior_output_token_ids: 6 tokens, must be fewer than max_tokens=6"),
])
def test_bad_prior_tokens_are_refused_naming_the_field(engines, prior, message):
    p = common_pb2.SamplingParams(temperature=0.0, max_tokens=6)

    async def scenario(pcore, pstub, dstub, daddr):
        codes = []
        calls = [dstub.Decode(decode_pb2.DecodeRequest(request_id="v1", prompt_token_ids=PROMPT, params=p,
                                                       prior_output_token_ids=prior)),
                 dstub.Decode(decode_pb2.DecodeRequest(request_id="v2", prompt_token_ids=PROMPT, params=p,
                                                       prior_output_token_ids=prior, prefill_locally=True)),
                 pstub.Prefill(prefill_pb2.PrefillRequest(request_id="v3", prompt_token_ids=PROMPT, params=p,
                                                          decode_address=daddr, prior_output_token_ids=prior))]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await call.read()
            codes.append((ei.value.code(), ei.value.details()))
        return codes, await idle(pstub, dstub)

    codes, loads = run_pair(engines, scenario, default_kv_timeout_s=5)
    for code, details in codes:
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(message), (code, details)
    assert all(x.num_used_blocks == 0 and x.num_tracked_requests == 0 for x in loads)


def test_a_transfer_for_a_locally_prefilled_request_is_refused(engines):
    """Nothing was reserved for it: a prefill naming this decode for that id fails NOT_FOUND, the local request
    runs on."""
    p = common_pb2.SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def scenario(pcore, pstub, dstub, daddr):
        call = dstub.Decode(decode_pb2.DecodeRequest(request_id="loc", prompt_token_ids=PROMPT, params=p,
                                                     prefill_locally=True))
        assert (await call.read()).delta.token_ids
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in pstub.Prefill(prefill_pb2.PrefillRequest(request_id="loc", prompt_token_ids=PROMPT,
                                                                    params=p, decode_address=daddr)):
                pass
        n = 1
        while (r := await call.read()) is not grpc.aio.EOF:
            n += len(r.delta.token_ids)
        return ei.value, n, await idle(pstub, dstub)

    err, n, loads = run_pair(engines, scenario, default_kv_timeout_s=5)
    assert err.code() == grpc.StatusCode.NOT_FOUND and "no reservation" in err.details()
    assert n == 200
    assert all(x.num_used_blocks == 0 and x.num_tracked_requests == 0 for x in loads)
