"""Zero lost streams (issue 14), end to end: `tandem up` starts real processes on loopback, a worker gets SIGKILL
mid-stream, and every stream still completes, identical to the same request on an undisturbed stack (tokens, text,
usage), over the OpenAI HTTP API (SSE) and the public gRPC API alike; the router counts the moves; no surviving
worker keeps a block; a restarted worker takes traffic at the router's first health poll after it answers.

Three stacks (random:tiny on the CPU, one intra-op thread per process):
- 1 prefill + 2 decode: 16 live streams (8 SSE, 8 gRPC; greedy and seeded; 320 tokens) and the decode worker with
  the most of them killed; its restart rejoining; constrained streams (a JSON schema, a regex) moved off a killed
  decode with their grammar; then a load of 200 streams and decode-1 killed (bench/migration.py's measurement);
- 2 prefill + 1 decode, workers not restarted: a prefill killed while long prompts are in flight; then the only
  decode killed for good: the streams end with an error that names --migration-timeout;
- 1 prefill + 1 decode: the decode killed and restarted by `tandem up`: the streams pause, then complete.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import grpc
import httpx
import jsonschema
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.migration import run_load
from protos.tandem.v1 import common_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc, prefill_pb2_grpc
from stack import Stack

ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # torch's thread per core, times four processes on a shared CPU, crawls
MODEL = "random:tiny"
MAX_TOKENS = 320


def prompt_of(i: int, n: int = 40) -> list[int]:
    return [260 + (i * 31 + j * 7) % 250 for j in range(n)]


def params_of(i: int, max_tokens: int = MAX_TOKENS) -> dict:
    """Greedy for even i, seeded sampling (with a penalty) for odd i."""
    if i % 2 == 0:
        return {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
    return {"temperature": 0.8, "top_k": 40, "seed": 100 + i, "repetition_penalty": 1.1, "max_tokens": max_tokens,
            "ignore_eos": True}


class Result:
    """One stream as its client saw it."""

    def __init__(self):
        self.rid, self.tokens, self.text, self.finish, self.usage, self.error = "", [], "", None, None, None
        self.counts: list[int] = []  # gRPC: each response's usage.completion_tokens

    def key(self) -> tuple:
        return tuple(self.tokens), self.text, self.finish, self.usage


async def sse(http: httpx.AsyncClient, i: int, prompt: list[int], params: dict, seen) -> Result:
    r = Result()
    body = {"model": MODEL, "prompt": prompt, "stream": True, "stream_options": {"include_usage": True},
            "logprobs": 0, "return_tokens_as_token_ids": True, **params}
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                r.error = event["error"]["message"]
                continue
            r.rid = event["id"]
            if event.get("usage"):
                r.usage = event["usage"]["completion_tokens"]
            for c in event["choices"]:
                r.text += c["text"]
                r.finish = c["finish_reason"] or r.finish
                if c.get("logprobs"):
                    r.tokens += [int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]]
            seen(i, len(r.tokens))
    return r


async def grpc_stream(address: str, i: int, prompt: list[int], params: dict, seen) -> Result:
    r = Result()
    async with grpc.aio.insecure_channel(address) as ch:
        call = generate_pb2_grpc.GenerateStub(ch).Generate(generate_pb2.GenerateRequest(
            model=MODEL, prompt_token_ids=prompt, params=common_pb2.SamplingParams(**params)), timeout=300)
        try:
            async for resp in call:
                r.rid = resp.request_id
                r.tokens += resp.delta.token_ids
                r.text += resp.delta.text
                r.finish = resp.delta.finish_reason or r.finish
                r.counts.append(resp.usage.completion_tokens)
                seen(i, len(r.tokens))
        except grpc.aio.AioRpcError as e:
            r.error = f"{e.code().name}: {e.details()}"
    r.finish = {common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_STOP: "stop"}.get(r.finish)
    r.usage = r.counts[-1] if r.counts else None
    return r


async def streams(stack: Stack, specs: list[tuple[str, list[int], dict]], when_started=None, at: int = 10):
    """Runs the streams (transport, prompt, params) at once; `when_started()` runs once each has `at` tokens."""
    counts = [0] * len(specs)
    started = asyncio.Event()

    def seen(i: int, n: int) -> None:
        counts[i] = n
        if min(counts) >= at:
            started.set()

    async with httpx.AsyncClient(base_url=stack.http, timeout=300) as http:
        tasks = [asyncio.create_task(sse(http, i, p, kw, seen) if how == "sse" else
                                     grpc_stream(stack.grpc, i, p, kw, seen))
                 for i, (how, p, kw) in enumerate(specs)]
        if when_started is not None:
            waiter = asyncio.create_task(started.wait())
            await asyncio.wait([waiter, asyncio.gather(*tasks)], return_when=asyncio.FIRST_COMPLETED)
            assert started.is_set(), f"the streams ended before each had {at} tokens: {counts}"
            await when_started()
        return await asyncio.gather(*tasks)


def metric(stack: Stack, name: str) -> dict[str, float]:
    """The router's `name` samples by their reason label."""
    text = httpx.get(f"{stack.http}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf'^{name}\{{[^}}]*reason="(\w+)"[^}}]*\}} (\S+)$',
                                                               text, re.M)}


def moves(lines: list[str]) -> list[str]:
    """The request id of each move the router logged, in order."""
    return [m.group(1) for line in lines if (m := re.search(r"request (\S+): .*: moving it \(", line))]


def logged_at(line: str) -> float:
    """The time a process's log line was written (logging's asctime: every process writes the same format)."""
    stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ", line)
    assert stamp, line
    return time.mktime(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")) + int(stamp.group(2)) / 1000


def load(stack: Stack, name: str) -> common_pb2.InstanceLoad:
    stub = prefill_pb2_grpc.PrefillStub if name.startswith("prefill") else decode_pb2_grpc.DecodeStub
    with grpc.insecure_channel(f"127.0.0.1:{stack.worker_ports[name]}") as ch:
        return stub(ch).GetLoad(common_pb2.GetLoadRequest(), timeout=5)


def idle(stack: Stack, names: list[str], timeout: float = 20) -> list[common_pb2.InstanceLoad]:
    """The workers' loads once none holds a block or tracks a request (or at the deadline, for the assert)."""
    deadline = time.monotonic() + timeout
    while True:
        loads = [load(stack, n) for n in names]
        if all(x.num_used_blocks == 0 and x.num_tracked_requests == 0 for x in loads) or time.monotonic() > deadline:
            return loads
        time.sleep(0.1)


def busiest(stack: Stack, names: list[str]) -> str:
    """The worker of `names` that tracks the most requests now: the one to kill. (Which worker the router gave a
    burst to is its choice at that moment, a health poll that came late included: the test kills one that has
    streams, whichever it is.)"""
    loads = {n: load(stack, n).num_tracked_requests for n in names}
    return max(loads, key=loads.get)


def serving(stack: Stack, name: str) -> bool:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{stack.worker_ports[name]}") as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            return r.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


# ------------------------------------------------------------------------------ 1 prefill + 2 decode
@pytest.fixture(scope="module")
def stack12():
    s = Stack("--model", MODEL, prefill=1, decode=2, env=ONE_THREAD).wait_ready()
    yield s
    s.stop()


DECODES = ["decode-0", "decode-1"]
SIXTEEN = [("sse" if i < 8 else "grpc", prompt_of(i), params_of(i)) for i in range(16)]


def test_sixteen_streams_survive_a_killed_decode_token_exact(stack12):
    undisturbed = asyncio.run(streams(stack12, SIXTEEN))
    assert all(r.error is None and len(r.tokens) == MAX_TOKENS for r in undisturbed)
    before = metric(stack12, "tandem:request_migrations_total")
    lines = len(stack12.lines)

    async def kill():
        stack12.killed = await asyncio.to_thread(busiest, stack12, DECODES)
        os.kill(stack12.child_pids()[stack12.killed], signal.SIGKILL)

    t0 = time.monotonic()
    got = asyncio.run(streams(stack12, SIXTEEN, kill))
    took = time.monotonic() - t0
    for i, (r, ref) in enumerate(zip(got, undisturbed)):
        assert r.error is None, (i, r.error)
        assert r.key() == ref.key(), i  # tokens, text, finish and usage
        assert r.usage == MAX_TOKENS
        if r.counts:  # gRPC: the completion count goes up by each response's tokens, never back
            assert r.counts == sorted(r.counts) and r.counts[-1] == MAX_TOKENS
    logged = moves(stack12.lines[lines:])
    moved = set(logged)
    after = metric(stack12, "tandem:request_migrations_total")
    assert moved and moved <= {r.rid for r in got}, moved
    assert sum(after.values()) - sum(before.values()) == len(logged)
    assert after["decode_unavailable"] > before["decode_unavailable"]
    loads = idle(stack12, ["prefill-0", *(n for n in DECODES if n != stack12.killed)])
    assert all(x.num_used_blocks == 0 and x.num_tracked_requests == 0 for x in loads), loads
    print(f"\n16 streams, {len(moved)} moved off the killed {stack12.killed}, all done {took:.1f} s after the start")


def test_the_restarted_decode_takes_traffic_within_two_health_polls(stack12):
    """`tandem up` restarted the decode worker killed above; the router's health poll (1 s) sees it at the first
    poll after its port answers, and the next requests go there again."""
    name = stack12.killed
    address = f"127.0.0.1:{stack12.worker_ports[name]}"
    answers, up = f"decode serving {MODEL} on {address}", f"decode {address} is up"

    def times() -> tuple[list[float], list[float]]:
        lines = list(stack12.lines)
        return ([logged_at(x) for x in lines if answers in x], [logged_at(x) for x in lines if up in x])

    deadline = time.monotonic() + 120
    while True:  # the restarted worker has logged that it serves, and the router that it took it back
        served, taken = times()
        if len(served) >= 2 and any(t >= served[-1] for t in taken):
            break
        assert time.monotonic() < deadline, f"{name} not back in the rotation: {served}, {taken}"
        time.sleep(0.1)
    rejoin = min(t for t in taken if t >= served[-1]) - served[-1]
    assert rejoin <= 2.0, f"{rejoin:.2f} s from answering to taking traffic (two poll intervals: 2 s)"
    assert serving(stack12, name)
    metrics_port = stack12.metrics_ports[list(stack12.worker_ports).index(name)]  # (the same order)
    for k in range(4):  # round robin: every other one goes to the restarted worker
        httpx.post(f"{stack12.http}/v1/completions", json={"model": MODEL, "prompt": prompt_of(100 + k),
                                                           "max_tokens": 4}, timeout=60).raise_for_status()
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    tokens = re.search(r'^tandem:generation_tokens_total\{[^}]*role="decode"[^}]*\} (\S+)$', text, re.M)
    assert tokens and float(tokens.group(1)) > 0, f"the restarted {name} generated nothing"
    print(f"\n{name} answered, and was back in the router's rotation {rejoin:.2f} s later")


# Long constrained outputs (random weights: only the grammar shapes them; a byte-level tokenizer: a token a
# character): a fixed-length array of enums, and a regex of 80 pairs.
PETS = {"type": "object", "properties": {"pets": {"type": "array", "items": {"enum": ["cat", "dog", "emu"]},
                                                  "minItems": 40, "maxItems": 40}},
        "required": ["pets"], "additionalProperties": False}
PAIRS = r"(ab|cd|ef){80}"


def constrained_spec(i: int) -> tuple[str, list[int], dict]:
    """Streams 0-3: SSE with the JSON schema (vLLM's structured_outputs); 4-5: gRPC with the regex (the proto's).
    params_of(i) without ignore_eos: the grammar ends the output."""
    params = {k: v for k, v in params_of(i, 400).items() if k != "ignore_eos"}
    if i < 4:
        return "sse", prompt_of(500 + i), {**params, "structured_outputs": {"json": PETS,
                                                                            "disable_any_whitespace": True}}
    return "grpc", prompt_of(500 + i), {**params, "structured_outputs": common_pb2.StructuredOutputs(regex=PAIRS)}


def satisfies(i: int, text: str) -> bool:
    if i >= 4:
        return re.fullmatch(PAIRS, text) is not None
    jsonschema.validate(json.loads(text), PETS)
    return True


def back_in_rotation(stack: Stack, names: list[str], timeout: float = 120) -> None:
    """Waits until the workers answer health checks and the router counts every worker healthy again (its poll,
    not a fixed wait: on a loaded machine the poll after a restarted worker answers can come seconds later)."""
    deadline = time.monotonic() + timeout
    while not all(serving(stack, n) for n in names) or stack.in_rotation() != stack.expected:
        assert time.monotonic() < deadline, (f"{names} not serving, or not all in the router's rotation "
                                             f"{stack.in_rotation()} (want {stack.expected}), after {timeout:g} s")
        time.sleep(0.2)


def test_constrained_streams_moved_off_a_killed_decode_keep_their_grammar(stack12):
    """Six constrained streams (4 SSE with a JSON schema, 2 gRPC with a regex; greedy and seeded) run on both
    decode workers; once each has 10 tokens, decode-0 is killed. The moved streams continue on decode-1, whose
    matcher is rebuilt from the tokens already sent (the engine replays them, as on the prefill that draws the
    first token after them): every output still satisfies its constraint and is token for token the undisturbed
    run's (seeded draws depend on the seed and the position only)."""
    back_in_rotation(stack12, DECODES)  # (an earlier test's kill restarted a decode worker)
    specs = [constrained_spec(i) for i in range(6)]
    undisturbed = asyncio.run(streams(stack12, specs))
    for i, r in enumerate(undisturbed):
        assert r.error is None and r.finish == "stop" and satisfies(i, r.text), (i, r.error, r.finish, r.text)
        assert len(r.tokens) > 100, (i, len(r.tokens))  # long enough to be mid-stream at the kill
    lines = len(stack12.lines)

    async def kill():
        os.kill(stack12.child_pids()[await asyncio.to_thread(busiest, stack12, DECODES)], signal.SIGKILL)

    got = asyncio.run(streams(stack12, specs, kill, at=10))
    for i, (r, ref) in enumerate(zip(got, undisturbed)):
        assert r.error is None, (i, r.error)
        assert r.key() == ref.key(), i  # tokens, text, finish and usage
        assert satisfies(i, r.text), (i, r.text)
    moved = set(moves(stack12.lines[lines:]))
    assert moved and moved <= {r.rid for r in got}, moved
    back_in_rotation(stack12, DECODES)  # (the restarted one, for the tests after this one)
    print(f"\n{len(moved)} of 6 constrained streams moved off the killed decode, each still valid and exact")


def test_a_load_of_200_streams_loses_none_when_a_decode_dies(stack12):
    """bench/migration.py's measurement (its numbers for the record: bench/RESULTS.md)."""
    victim = stack12.child_pids()["decode-1"]  # (200 streams: both decode workers have some)
    result = asyncio.run(run_load(stack12.http, lambda: os.kill(victim, signal.SIGKILL), lambda: stack12.lines,
                                  num_prompts=200, input_len=32, output_len=192, model=MODEL))
    assert result["failed"] == 0, result["failures"]
    assert result["moved"] > 0 and result["kill_to_first_migrated_token_s"] is not None, result
    k = result["kill_to_first_migrated_token_s"]
    print(f"\n200 streams, {result['moved']} moved: kill -> first migrated token p50 {k['p50'] * 1000:.0f} ms, "
          f"max {k['max'] * 1000:.0f} ms")


# ------------------------------------------------------------------------------ 2 prefill + 1 decode
@pytest.fixture(scope="module")
def stack21():
    s = Stack("--model", MODEL, "--on-worker-exit", "continue", "--migration-timeout", "5", prefill=2, decode=1,
              env=ONE_THREAD).wait_ready()
    yield s
    s.stop()


def test_a_killed_prefill_fails_no_request(stack21):
    """Long prompts (1500 tokens: their KV streams to decode while they are prefilled) are in flight on both prefill
    workers when one is killed: its requests start again on the other one (or, with none left, locally on the
    decode worker); every request completes with the tokens the same requests give undisturbed afterwards."""
    specs = [("sse" if i % 2 else "grpc", prompt_of(200 + i, 1500), params_of(i, 24)) for i in range(8)]
    lines = len(stack21.lines)
    victim = {}

    async def run():
        tasks = asyncio.create_task(streams(stack21, specs))
        deadline = time.monotonic() + 60
        while not victim and time.monotonic() < deadline:  # a prefill worker busy with some of them
            for name in ("prefill-0", "prefill-1"):
                if (await asyncio.to_thread(load, stack21, name)).num_tracked_requests:
                    os.kill(stack21.child_pids()[name], signal.SIGKILL)
                    victim[name] = time.monotonic()
                    break
            await asyncio.sleep(0.005)
        return await tasks

    got = asyncio.run(run())
    assert victim, "no prefill worker was seen busy"
    expected = asyncio.run(streams(stack21, specs))  # the same requests again, on the surviving prefill
    for i, (r, ref) in enumerate(zip(got, expected)):
        assert r.error is None, (i, r.error)
        assert r.key() == ref.key(), i
    (name,) = victim
    survivor = "prefill-1" if name == "prefill-0" else "prefill-0"
    loads = idle(stack21, [survivor, "decode-0"])
    assert all(x.num_used_blocks == 0 and x.num_tracked_requests == 0 for x in loads), loads
    moved = set(moves(stack21.lines[lines:]))
    assert moved, "the killed prefill's requests did not move"
    print(f"\n{name} killed with requests in flight: {len(moved)} moved, none failed")


def test_the_only_decode_gone_for_good_ends_the_streams_with_a_clear_error(stack21):
    """--on-worker-exit continue: the killed decode worker is not restarted; after --migration-timeout (5 s) the
    streams end: an SSE error event, a gRPC UNAVAILABLE, both saying why."""
    specs = [("sse", prompt_of(300), params_of(0)), ("grpc", prompt_of(301), params_of(1))]

    async def kill():
        os.kill(stack21.child_pids()["decode-0"], signal.SIGKILL)

    t0 = time.monotonic()
    got = asyncio.run(streams(stack21, specs, kill))
    took = time.monotonic() - t0
    for r in got:
        assert r.error is not None and "--migration-timeout" in r.error, r.error
        assert 0 < len(r.tokens) < MAX_TOKENS
    assert got[1].error.startswith("UNAVAILABLE")
    assert 5 <= took < 60


# ------------------------------------------------------------------------------ 1 prefill + 1 decode, restarted
def test_streams_pause_while_the_only_decode_restarts_then_complete():
    stack = Stack("--model", MODEL, prefill=1, decode=1, env=ONE_THREAD).wait_ready()
    try:
        specs = [("sse", prompt_of(400 + i), params_of(i)) for i in range(2)] + \
                [("grpc", prompt_of(410 + i), params_of(i)) for i in range(2)]
        undisturbed = asyncio.run(streams(stack, specs))
        pause = {}

        async def kill():
            os.kill(stack.child_pids()["decode-0"], signal.SIGKILL)
            pause["killed"] = time.monotonic()

        got = asyncio.run(streams(stack, specs, kill))
        for i, (r, ref) in enumerate(zip(got, undisturbed)):
            assert r.error is None, (i, r.error)
            assert r.key() == ref.key(), i
        assert "decode-0 exited with status -9; restarting it" in "".join(stack.lines)
        loads = idle(stack, ["prefill-0", "decode-0"])
        assert all(x.num_used_blocks == 0 and x.num_tracked_requests == 0 for x in loads), loads
        print(f"\nthe streams were done {time.monotonic() - pause['killed']:.1f} s after the kill")
    finally:
        stack.stop()
