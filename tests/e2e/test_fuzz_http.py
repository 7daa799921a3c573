"""The OpenAI HTTP API fuzzed end to end (issue 13, "trust no peer and no request"): `tandem up` runs a real router
over one prefill and one decode worker (random:tiny, a 64-token context so that the largest request the fuzzer can
make is cheap), and thousands of generated bodies go to every endpoint over loopback:

- schemathesis generates bodies from the router's own /openapi.json (the pydantic models), valid ones and ones
  that break the schema, for every POST and GET;
- hypothesis mutates valid bodies outside the schema: wrong types, 64-bit-and-beyond integers in n, seed, top_k,
  max_tokens..., NaN and infinities, lone UTF-16 surrogates, deep nesting, unknown fields, bodies that are not
  objects, truncated JSON, bytes that are not UTF-8.

No body may get a 5xx; every refusal is OpenAI's error JSON; a stream ends with [DONE]. Afterwards every process of
the stack is alive, the router runs no request and each worker holds no KV block or request. The same stack then
serves the SSE disconnect test (200 clients that go away mid-stream or before the answer starts: nothing stays
counted or held) and the event-loop test (/health answers within a second while a 10 MB prompt and a 12,800-way
fan-out are refused).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import os
import re
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from stack import Stack, alive

schemathesis = pytest.importorskip("schemathesis")

from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,  # noqa: E402
                                               status_code_conformance)

pytestmark = pytest.mark.slow

MODEL = "random:tiny"
MAX_MODEL_LEN = 64
# The same bodies every run (a failure can be sent again); TANDEM_FUZZ_SEED=<n> fuzzes others, and
# TANDEM_FUZZ_SCALE=<x> x times as many.
SEED = int(os.environ.get("TANDEM_FUZZ_SEED", "13"))
SCALE = float(os.environ.get("TANDEM_FUZZ_SCALE", "1"))
SCHEMA_EXAMPLES = int(120 * SCALE)  # per POST operation and generation mode: 5 x 2 x 120 = 1,200 bodies
MUTATED_EXAMPLES = int(1000 * SCALE)
CLIENTS = 8  # requests in flight at once
POSTS = ("/v1/completions", "/v1/chat/completions", "/generate", "/tokenize", "/detokenize")
SENT: dict[str, int] = {}  # bodies sent, by test


# ------------------------------------------------------------------------------------------------ the stack
@pytest.fixture(scope="module")
def stack():
    s = Stack("--model", MODEL, "--max-model-len", str(MAX_MODEL_LEN), prefill=1, decode=1).wait_ready()
    yield s
    s.stop()


def router_running(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    m = re.search(r'^tandem:num_requests_running\{[^}]*role="router"[^}]*\} (\S+)$', text, re.M)
    assert m is not None, "the router exports no tandem:num_requests_running"
    return float(m.group(1))


def worker_loads(stack) -> dict[str, tuple]:
    """Each worker's live (blocks in use, KV usage, requests running, requests tracked), by tandem.v1 GetLoad. (Its
    tandem:kv_cache_usage_perc gauge is the last engine step's: a prefill worker frees a request's blocks after
    that, when decode has them, so the gauge can stay at one request's blocks while the worker is idle.)"""
    import grpc

    from protos.tandem.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

    out = {}
    for name, port in stack.worker_ports.items():
        stub = prefill_pb2_grpc.PrefillStub if name.startswith("prefill") else decode_pb2_grpc.DecodeStub
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            load = stub(ch).GetLoad(common_pb2.GetLoadRequest(), timeout=10)
        out[name] = (load.num_used_blocks, load.kv_cache_usage, load.num_requests_running, load.num_tracked_requests)
    return out


@pytest.fixture(scope="module")
def baseline(stack):
    """What each worker of the idle stack holds before any test."""
    return worker_loads(stack)


def settled(stack, baseline, timeout: float = 60.0) -> dict:
    """Polls until the router runs no request and every worker is back at its baseline; what was seen last."""
    deadline = time.monotonic() + timeout
    while True:
        seen = {"router running": router_running(stack.http), "loads": worker_loads(stack)}
        if (seen["router running"] == 0 and seen["loads"] == baseline) or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


def assert_settled(stack, baseline) -> None:
    seen = settled(stack, baseline)
    assert seen["router running"] == 0, seen
    assert seen["loads"] == baseline, f"held (blocks, KV usage, running, tracked): {seen} vs {baseline}"
    pids = stack.child_pids()
    assert len(pids) == 3 and all(alive(pid) for pid in pids.values()), pids
    assert stack.proc.poll() is None


# ------------------------------------------------------------------------------------------------ checking
def error_shape(status: int, content: bytes) -> str | None:
    """What is wrong with an error answer (OpenAI's JSON: {"error": {message, type, param, code}}), else None."""
    try:
        err = json.loads(content)["error"]
    except (ValueError, KeyError, TypeError) as e:
        return f"not OpenAI's error JSON ({e}): {content[:200]!r}"
    if set(err) != {"message", "type", "param", "code"} or not isinstance(err["message"], str) or not err["message"]:
        return f"error fields: {err}"
    if err["type"] != ("invalid_request_error" if status < 500 else "server_error"):
        return f"error type {err['type']!r} for {status}"
    if err["param"] is not None and not isinstance(err["param"], str):
        return f"param {err['param']!r}"
    return None


def expected_choices(path: str, body: dict) -> int:
    """How many choices a served body asks for: its prompts (a completion's batch) times n."""
    n = body.get("n") or 1
    prompt = body.get("prompt")
    batch = path == "/v1/completions" and isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
    return n * (len(prompt) if batch else 1)


def answer_problem(path: str, body: dict, content: bytes, whole: bool) -> str | None:
    """What is wrong with a 200 answer, else None: every choice asked for is there (streamed: each one finished),
    a stream has no error event and ends with [DONE]; /generate's stream is NUL-ended objects."""
    want = expected_choices(path, body)
    if path == "/generate":
        parts = content.split(b"\0")
        if streams(body) and parts[-1] != b"":
            return f"/generate stream not NUL-ended: {content[-200:]!r}"
        texts = [json.loads(p)["text"] for p in parts[:-1]] if streams(body) else [json.loads(content)["text"]]
        if any(len(t) != want for t in texts):
            return f"/generate: {[len(t) for t in texts]} texts, asked for {want}"
        return None
    if not streams(body):
        indices = sorted(c["index"] for c in json.loads(content)["choices"])
        return None if indices == list(range(want)) else f"choices {indices}, asked for {want}"
    events = [e[len("data: "):] for e in content.decode().split("\n\n") if e.startswith("data: ")]
    if whole and events[-1:] != ["[DONE]"]:
        return f"SSE without [DONE] at the end: {content[-200:]!r}"
    finished = set()
    for raw in events:
        if raw == "[DONE]":
            continue
        event = json.loads(raw)
        if "error" in event:
            return f"error event in a 200 stream: {event}"
        finished |= {c["index"] for c in event["choices"] if c.get("finish_reason")}
    if whole and finished != set(range(want)):
        return f"finished choices {sorted(finished)}, asked for {want}"
    return None


def streams(body) -> bool:
    return isinstance(body, dict) and body.get("stream") is True


def problems_of(path: str, body, status: int, content: bytes, whole: bool = True) -> list[str]:
    """What is wrong with an answer; `whole`: the client read all of it (schemathesis stops reading a long event
    stream, and disconnects)."""
    out = []
    if status >= 500:
        out.append(f"{status}")
    if status >= 400 and (p := error_shape(status, content)) is not None:
        out.append(p)
    if status == 200 and path in POSTS[:3] and (p := answer_problem(path, body, content, whole)) is not None:
        out.append(p)
    return out


def report(failures: list) -> str:
    return f"TANDEM_FUZZ_SEED={SEED}\n" + "\n".join(
        f"{path} {status} {problems}\n    body: {str(body)[:300]}\n    answer: {content[:300]!r}"
        for path, body, status, problems, content in failures[:20])


# ------------------------------------------------------------------------------------------------ schemathesis
def served_model(case, choice: str) -> None:
    """A generated "model" is almost never the served one (404 before anything else is looked at): keep it, use
    the served name, or leave it out."""
    if isinstance(case.body, dict) and "model" in case.body:
        if choice == "served":
            case.body["model"] = MODEL
        elif choice == "drop":
            del case.body["model"]


def generated_cases(op, mode: GenerationMode, examples: int) -> list:
    cases = []
    strategy = st.tuples(op.as_strategy(generation_mode=mode), st.sampled_from(["keep", "served", "drop"]))

    @seed(SEED)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case_and_model):
        case, choice = case_and_model
        if mode == GenerationMode.POSITIVE:
            served_model(case, choice)
        cases.append(case)

    collect()
    return cases


def test_schemathesis_bodies_get_no_server_error(stack, baseline):
    schema = schemathesis.openapi.from_url(f"{stack.http}/openapi.json")
    cases = []
    for result in schema.get_all_operations():
        op = result.ok()
        if op.method.upper() == "POST":
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                cases += generated_cases(op, mode, SCHEMA_EXAMPLES)
        else:  # (no parameters: one case says it all)
            cases += generated_cases(op, GenerationMode.POSITIVE, 1)
    covered = {(c.operation.method.upper(), c.operation.path) for c in cases}
    assert covered >= {("POST", p) for p in POSTS} | {("GET", p) for p in ("/health", "/v1/models", "/metrics")}

    local = threading.local()

    def send(case):
        import requests

        session = getattr(local, "session", None) or requests.Session()
        local.session = session
        response = case.call(base_url=stack.http, session=session, timeout=120)
        checks = [not_a_server_error, status_code_conformance, content_type_conformance]
        if not streams(case.body):  # (a stream is its events, not one body of the documented schema)
            checks.append(response_schema_conformance)
        try:
            case.validate_response(response, checks=checks)
            problems = []
        except (AssertionError, FailureGroup) as e:
            problems = [str(e)[:800]]
        problems += problems_of(case.operation.path, case.body, response.status_code, response.content,
                                whole=not response.stream_cut_short)
        return case.operation.path, case.body, response.status_code, problems, response.content

    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(send, cases))
    SENT["schemathesis"] = sum(1 for c in cases if c.operation.method.upper() == "POST")
    failures = [r for r in results if r[3]]
    assert not failures, f"{len(failures)} of {len(results)} failed:\n{report(failures)}"
    statuses = {}
    for path, _, status, _, _ in results:
        statuses.setdefault(path, set()).add(status)
    # The fuzzer reached past validation: every generating endpoint served some bodies and refused others.
    for path in POSTS:
        assert {200, 400} <= statuses[path], (path, statuses[path])
    assert SENT["schemathesis"] >= SCHEMA_EXAMPLES * 10 * 0.9  # (hypothesis stops early on a space it exhausted)
    assert_settled(stack, baseline)


# ------------------------------------------------------------------------------------------------ mutations
VALID = {
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 4},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/generate": {"prompt": "hi", "max_tokens": 4},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [104, 105]},
}
FIELDS = {  # the fields each body may be mutated in (its model's, and some no model has)
    "/v1/completions": ["prompt", "n", "max_tokens", "seed", "top_k", "top_p", "temperature", "min_p", "logprobs",
                        "stop", "stop_token_ids", "min_tokens", "echo", "stream", "stream_options", "best_of",
                        "suffix", "presence_penalty", "repetition_penalty", "model", "logit_bias", "user"],
    "/v1/chat/completions": ["messages", "n", "max_tokens", "max_completion_tokens", "seed", "top_k",
                             "logprobs", "top_logprobs", "stop", "stream", "stream_options", "tools", "tool_choice",
                             "response_format", "add_generation_prompt", "model", "frequency_penalty",
                             "ignore_eos", "skip_special_tokens", "functions"],
    "/generate": ["prompt", "n", "max_tokens", "seed", "top_k", "stop", "stream", "temperature", "model",
                  "min_tokens"],
    "/tokenize": ["prompt", "messages", "add_special_tokens", "add_generation_prompt", "model"],
    "/detokenize": ["tokens", "model"],
}
HUGE = [2**31, 2**31 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64, 10**100, -(10**100)]
ODD_TEXT = ["", "\ud800", "a\udfffb", "\ud83d\ude00", "\x00", "\u202e\u0000", "🙂" * 50, "x" * 5000, "<|endoftext|>",
            "\\ud800"]
SCALARS = st.one_of(
    st.sampled_from(HUGE + ODD_TEXT + [True, False, None, 0, -1, 1, 0.5, -0.0, 1e308, 5e-324, math.inf, -math.inf,
                                       math.nan, [], {}, [None], [[]], {"": None}, {"type": "text"}]),
    st.integers(min_value=-(2**70), max_value=2**70), st.floats(), st.text(max_size=40),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=12)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant"]),
                                                               VALUES)},
                                          optional={"content": st.one_of(VALUES, st.lists(st.fixed_dictionaries(
                                              {"type": st.one_of(st.just("text"), VALUES),
                                               "text": VALUES})))}), max_size=3)
TOKEN_IDS = st.lists(st.integers(0, 511), min_size=1, max_size=12)
PROMPTS = st.one_of(st.text(min_size=1, max_size=20), TOKEN_IDS, st.lists(st.text(min_size=1, max_size=8), min_size=1,
                                                                          max_size=3),
                    st.lists(TOKEN_IDS, min_size=1, max_size=3))
IN_RANGE = {  # sampling fields at values the server accepts (mostly): the paths past validation, combined
    "n": st.integers(1, 6), "max_tokens": st.integers(1, 8), "min_tokens": st.integers(0, 8),
    "temperature": st.sampled_from([0, 0.5, 1, 2, 1e-6]), "top_p": st.sampled_from([1e-9, 0.1, 0.9, 1]),
    "top_k": st.integers(-1, 600), "min_p": st.sampled_from([0, 0.5, 1]), "seed": st.integers(-(2**63), 2**63 - 8),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.sampled_from([0.01, 1, 2, 1e9]),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 600), max_size=3), "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(), "stream": st.booleans(),
    "return_tokens_as_token_ids": st.booleans(),
}
IN_RANGE_OF = {"/v1/completions": {"prompt": PROMPTS, "logprobs": st.integers(0, 20), "echo": st.booleans()},
               "/v1/chat/completions": {"logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
                                        "max_completion_tokens": st.integers(1, 8)},
               "/generate": {"prompt": st.text(min_size=1, max_size=20)}}
BIG = {  # lists a body may make long, with an element of each: every sub-request carries them, or they are scanned
    "/v1/completions": {"stop": "ab", "stop_token_ids": 7, "prompt": 7},
    "/v1/chat/completions": {"stop": "ab", "stop_token_ids": 7, "messages": {"role": "user", "content": "x"}},
    "/generate": {"stop": "ab", "stop_token_ids": 7},
    "/tokenize": {"messages": {"role": "user", "content": "x"}},
    "/detokenize": {"tokens": 7},
}


def nested(value, depth: int) -> str:
    """`value` as JSON inside `depth` lists (or objects): up to about where json.loads refuses to go on."""
    inner = json.dumps(value)
    return ("[" * depth + inner + "]" * depth) if depth % 2 else ('{"a":' * depth + inner + "}" * depth)


@st.composite
def mutated(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(POSTS))
    body = json.loads(json.dumps(VALID[path]))
    kind = draw(st.sampled_from(["field", "field", "field", "fields", "messages", "nested", "drop", "not an object",
                                 "raw", "in range", "in range", "big"]))
    if kind == "big":
        name, element = draw(st.sampled_from(sorted(BIG[path].items())))
        body[name] = [element] * draw(st.sampled_from([65, 1025, 5000, 50_000]))
        if path in IN_RANGE_OF:
            body["n"] = draw(st.sampled_from([1, 128]))
    elif kind == "in range" and path in IN_RANGE_OF:
        fields = {**IN_RANGE, **IN_RANGE_OF[path]}
        for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=8, unique=True)):
            body[name] = draw(fields[name])
    elif kind in ("field", "fields"):
        for _ in range(1 if kind == "field" else draw(st.integers(2, 4))):
            body[draw(st.sampled_from(FIELDS[path] + ["\ud800", "", "__proto__"]))] = draw(VALUES)
    elif kind == "messages":
        body.pop("prompt", None)
        body["messages"] = draw(MESSAGES)
    elif kind == "drop":
        body.pop(draw(st.sampled_from(sorted(body))), None)
    elif kind == "not an object":
        return path, json.dumps(draw(st.one_of(SCALARS, st.lists(SCALARS)))).encode()
    elif kind == "nested":
        name = draw(st.sampled_from(FIELDS[path]))
        depth = draw(st.sampled_from([2, 10, 100, 500, 900, 990, 1100, 5000]))
        text = json.dumps(body)[:-1] + f', "{name}": {nested(draw(SCALARS), depth)}' + "}"
        return path, text.encode("utf-8", "surrogatepass")
    if kind == "raw":
        raw = json.dumps(body).encode()
        how = draw(st.sampled_from(["cut", "bad utf-8", "bom", "nan"]))
        if how == "cut":
            return path, raw[:draw(st.integers(0, len(raw) - 1))]
        if how == "bad utf-8":
            at = draw(st.integers(0, len(raw)))
            return path, raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"])) + \
                raw[at:]
        if how == "bom":
            return path, b"\xef\xbb\xbf" + raw
        return path, raw[:-1] + b', "temperature": NaN, "top_p": -Infinity}'
    if body.get("stream") is True and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    return path, json.dumps(body).encode("utf-8", "surrogatepass")


def test_mutated_bodies_get_no_server_error(stack, baseline):
    bodies: list[tuple[str, bytes]] = []

    @seed(SEED)
    @settings(max_examples=MUTATED_EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(mutated())
    def collect(path_and_raw):
        bodies.append(path_and_raw)

    collect()
    local = threading.local()

    def send(path_and_raw):
        path, raw = path_and_raw
        client = getattr(local, "client", None) or httpx.Client(base_url=stack.http, timeout=120)
        local.client = client
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None
        return path, raw, r.status_code, problems_of(path, body, r.status_code, r.content), r.content

    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(send, bodies))
    SENT["mutations"] = len(results)
    failures = [r for r in results if r[3]]
    assert not failures, f"{len(failures)} of {len(results)} failed:\n{report(failures)}"
    statuses = {status for *_, status, _, _ in results}
    assert {200, 400} <= statuses and statuses <= {200, 400, 404, 413}, statuses
    assert SENT["mutations"] >= MUTATED_EXAMPLES * 0.9
    assert_settled(stack, baseline)


def test_at_least_2000_bodies_were_sent(stack):
    if set(SENT) != {"schemathesis", "mutations"}:
        pytest.skip(f"only {sorted(SENT)} of the fuzz tests ran")
    assert sum(SENT.values()) >= 2000, SENT


# ------------------------------------------------------------------------------------------------ disconnects
async def client_that_leaves(port: int, path: str, body: dict, when: str, reset: bool) -> bytes | None:
    """Sends `body` to `path` over its own connection, and goes away (a reset, or a FIN): mid-body (half of it
    sent), before the answer (the whole request sent, nothing read), or mid-stream (after the first event). What it
    had read by then, or None when it read nothing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    raw = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(raw)}\r\n\r\n").encode()
    writer.write(head + (raw[:len(raw) // 2] if when == "mid-body" else raw))
    await writer.drain()
    seen = None
    if when == "mid-stream":
        seen = b""
        while not re.search(rb"data: .*?\n\n", seen, re.S):  # (the first event, whole)
            chunk = await asyncio.wait_for(reader.read(65536), 60)
            assert chunk, f"the router closed the stream: {seen[-300:]!r}"
            seen += chunk
        assert seen.startswith(b"HTTP/1.1 200"), seen[:300]
    if reset:
        writer.transport.abort()
    else:
        writer.close()
    return seen


def test_clients_that_leave_mid_stream_leave_nothing_behind(stack, baseline):
    """200 streams whose client goes away after the first event (completions and chat, n up to 4), and 40 clients
    that go away before the answer starts or mid-body: afterwards the router counts no request running
    (tandem:num_requests_running once leaked one per stream disconnected mid-stream) and no worker holds a block."""
    port = int(stack.http.rsplit(":", 1)[1])
    chat = [{"role": "user", "content": "tell me"}]
    clients = []
    for i in range(200):
        n = (1, 2, 4)[i % 3]
        if i % 2:
            clients.append(("/v1/chat/completions", {"messages": chat, "max_tokens": 32, "n": n, "ignore_eos": True,
                                                     "stream": True}, "mid-stream"))
        else:
            clients.append(("/v1/completions", {"prompt": f"story {i}", "max_tokens": 40, "n": n, "ignore_eos": True,
                                                "stream": True, "stream_options": {"include_usage": True}},
                            "mid-stream"))
    for i in range(40):
        path, body, _ = clients[i]
        clients.append((path, body, "before the answer" if i % 2 else "mid-body"))

    async def main():
        limit = asyncio.Semaphore(16)

        async def one(i, path, body, when):
            async with limit:
                return await client_that_leaves(port, path, body, when, reset=i % 4 < 2)

        return await asyncio.gather(*(one(i, *c) for i, c in enumerate(clients)))

    seen = asyncio.run(main())
    mid_stream = [s for s in seen if s is not None]
    assert len(mid_stream) == 200
    # They left mid-stream: most had not read the stream's end (each runs 32-40 tokens after its first).
    ended = sum(b"data: [DONE]" in s for s in mid_stream)
    assert ended <= 100, ended  # (0 or 1 in practice)
    assert_settled(stack, baseline)


# ------------------------------------------------------------------------------------------------ the event loop
def test_health_answers_within_a_second_while_huge_requests_are_refused(stack, baseline):
    """A 10 MB prompt (over --max-prompt-bytes: 400 naming prompt), a 20 MB body (over --max-request-bytes: 413)
    and 100 prompts x n=128 (over --max-sub-requests: 400 naming n), three of each at once: meanwhile /health,
    asked every 20 ms, answers 200 each time within a second (nothing blocks the router's event loop)."""
    refused = [(json.dumps({"model": MODEL, "prompt": "x" * (10 << 20)}).encode(), 400, "prompt"),
               (json.dumps({"model": MODEL, "prompt": "x" * (20 << 20)}).encode(), 413, None),
               (json.dumps({"model": MODEL, "prompt": ["hi"] * 100, "n": 128}).encode(), 400, "n")] * 3
    stop = threading.Event()
    polls: list[tuple[float, float, int]] = []  # (start, seconds, status)

    def poll():
        with httpx.Client(base_url=stack.http, timeout=30) as c:
            while not stop.is_set():
                t = time.monotonic()
                status = c.get("/health").status_code
                polls.append((t, time.monotonic() - t, status))
                time.sleep(0.02)

    def refuse(item):
        raw, status, param = item
        with httpx.Client(base_url=stack.http, timeout=120) as c:
            try:
                r = c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            except httpx.HTTPError:  # (a 413 may answer before the body is all sent, and close)
                return "closed", (status, param)
        err = r.json()["error"]
        return (r.status_code, err["param"]), (status, param)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        time.sleep(0.1)
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(len(refused)) as pool:
            answers = list(pool.map(refuse, refused))
        t1 = time.monotonic()
        time.sleep(0.1)
    finally:
        stop.set()
        poller.join()
    for got, want in answers:
        assert got == want or (got == "closed" and want[0] == 413), (got, want)
    during = [(seconds, status) for start, seconds, status in polls if t0 <= start <= t1]
    assert len(during) >= 3, (len(polls), t1 - t0)  # (the polls did overlap the refusals)
    assert all(status == 200 for _, _, status in polls)
    assert max(seconds for _, seconds, _ in polls) < 1.0, sorted(s for _, s, _ in polls)[-5:]
    assert_settled(stack, baseline)
