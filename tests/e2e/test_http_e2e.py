"""The OpenAI HTTP API end to end: `tandem up` starts a real router, one prefill and two decode workers on loopback,
and the tests speak HTTP to the router. Greedy outputs are compared with the offline engine (engine.LLM) on the
same model: random:tiny for the whole API, SmolLM2 for a real tokenizer and chat template."""
from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import pytest

from engine import LLM, SamplingParams
from stack import ROOT, Stack, alive


def worker_load(name: str, port: int):
    """A worker's live load (tandem.v1 GetLoad): blocks in use and requests it still tracks."""
    import grpc

    from protos.tandem.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

    stub = prefill_pb2_grpc.PrefillStub if name.startswith("prefill") else decode_pb2_grpc.DecodeStub
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return stub(ch).GetLoad(common_pb2.GetLoadRequest(), timeout=5)


def sse_events(r: httpx.Response):
    """(arrival time, parsed data or "[DONE]") for each SSE event of a streaming response."""
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield time.perf_counter(), data if data == "[DONE]" else json.loads(data)


# "Once upon a time" makes random:tiny write whole UTF-8; the others make it emit stray bytes, where streamed text
# holds back incomplete UTF-8 (as vLLM's incremental detokenizer does) and the offline text has U+FFFD. So tokens are
# compared always (as ids, through logprobs with return_tokens_as_token_ids) and text where it is whole.
WHOLE = "Once upon a time"
PROMPTS = [WHOLE, "Hello, my name is", "The capital of France is", "1, 2, 3, 4,"]
MAX_TOKENS = 12
IDS = {"logprobs": 0, "return_tokens_as_token_ids": True}


# ------------------------------------------------------------------------------------------------ random:tiny
@pytest.fixture(scope="module")
def tiny():
    stack = Stack("--model", "random:tiny").wait_ready()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM("random:tiny", device="cpu", kv_cache_memory=0.05)


@pytest.fixture(scope="module")
def client(tiny):
    with httpx.Client(base_url=tiny.http, timeout=120) as c:
        yield c


def greedy(**kw) -> dict:
    return {"model": "random:tiny", "temperature": 0, "max_tokens": MAX_TOKENS, **kw}


def ids_of(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def assert_same_text(got: str, expected: str) -> None:
    if "\ufffd" not in expected:
        assert got == expected


def test_health_and_models(client):
    assert client.get("/health").status_code == 200
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["random:tiny"]


def test_completions_greedy_equals_offline_engine(client, tiny_llm):
    expected = tiny_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert "\ufffd" not in expected[0].outputs[0].text  # at least one text is compared
    for prompt, exp in zip(PROMPTS, expected):
        r = client.post("/v1/completions", json=greedy(prompt=prompt, **IDS))
        assert r.status_code == 200, r.text
        body = r.json()
        (choice,) = body["choices"]
        assert ids_of(choice["logprobs"]["tokens"]) == exp.outputs[0].token_ids, prompt
        assert_same_text(choice["text"], exp.outputs[0].text)
        assert choice["finish_reason"] == exp.outputs[0].finish_reason
        assert body["usage"].pop("prompt_tokens_details")["cached_tokens"] >= 0  # (tests/e2e/test_openai_surface_e2e.py)
        assert body["usage"] == {"prompt_tokens": len(exp.prompt_token_ids),
                                 "completion_tokens": len(exp.outputs[0].token_ids),
                                 "total_tokens": len(exp.prompt_token_ids) + len(exp.outputs[0].token_ids)}
    # A batch of prompts in one request: one choice per prompt, in order.
    r = client.post("/v1/completions", json=greedy(prompt=PROMPTS, **IDS))
    assert [c["index"] for c in r.json()["choices"]] == list(range(len(PROMPTS)))
    assert [ids_of(c["logprobs"]["tokens"]) for c in r.json()["choices"]] == [e.outputs[0].token_ids for e in expected]
    # Token ids as the prompt.
    r = client.post("/v1/completions", json=greedy(prompt=expected[0].prompt_token_ids))
    assert r.json()["choices"][0]["text"] == expected[0].outputs[0].text


def test_streamed_tokens_equal_offline_engine_and_usage_comes_last(client, tiny_llm):
    for prompt, exp in zip(PROMPTS[:2], tiny_llm.generate(PROMPTS[:2], SamplingParams(temperature=0,
                                                                                      max_tokens=MAX_TOKENS))):
        with client.stream("POST", "/v1/completions", json=greedy(prompt=prompt, stream=True, **IDS,
                                                                   stream_options={"include_usage": True})) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = [e for _, e in sse_events(r)]
        assert events[-1] == "[DONE]"
        usage = events[-2]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(exp.outputs[0].token_ids)
        chunks = events[:-2]
        assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
        assert ids_of([t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]) == exp.outputs[0].token_ids
        assert_same_text("".join(c["choices"][0]["text"] for c in chunks), exp.outputs[0].text)
        assert chunks[-1]["choices"][0]["finish_reason"] == exp.outputs[0].finish_reason


def test_chat_greedy_equals_offline_engine(client, tiny_llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    (exp,) = tiny_llm.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    r = client.post("/v1/chat/completions", json=greedy(messages=messages, logprobs=True,
                                                        return_tokens_as_token_ids=True))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert ids_of([t["token"] for t in body["choices"][0]["logprobs"]["content"]]) == exp.outputs[0].token_ids
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert_same_text(body["choices"][0]["message"]["content"], exp.outputs[0].text)
    assert body["usage"]["prompt_tokens"] == len(exp.prompt_token_ids)
    with client.stream("POST", "/v1/chat/completions", json=greedy(messages=messages, stream=True)) as r:
        events = [e for _, e in sse_events(r)]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1]) == \
        body["choices"][0]["message"]["content"]
    assert events[-1] == "[DONE]"


def test_vllm_generate_returns_prompt_plus_completion(client, tiny_llm):
    (exp,) = tiny_llm.generate([WHOLE], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    r = client.post("/generate", json={"prompt": WHOLE, "temperature": 0, "max_tokens": MAX_TOKENS})
    assert r.json() == {"text": [WHOLE + exp.outputs[0].text]}
    with client.stream("POST", "/generate", json={"prompt": WHOLE, "temperature": 0, "max_tokens": MAX_TOKENS,
                                                  "stream": True}) as r:
        parts = [json.loads(p) for p in r.read().decode().split("\0") if p]
    assert parts[-1] == {"text": [WHOLE + exp.outputs[0].text]}
    assert len(parts) > 1


def test_sse_chunks_arrive_before_the_end(client):
    body = greedy(prompt=PROMPTS[0], max_tokens=64, ignore_eos=True, stream=True)
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = list(sse_events(r))
    t_done = events[-1][0]
    content = [(t, e) for t, e in events[:-1] if e["choices"][0]["text"]]
    assert events[-1][1] == "[DONE]" and len(content) >= 8
    # Chunks are not buffered to the end: they reach the client spread over the generation (a buffered response
    # lands in one read), and the first one well before [DONE]. (Not a ratio against TTFT: under load the time to
    # the first token can dominate the whole request.)
    assert t_done - content[0][0] > 0.01, (content[0][0] - t0, t_done - t0)
    assert len({round(t, 4) for t, _ in content}) > len(content) // 4


def test_n2_usage_and_seed(client):
    body = {"model": "random:tiny", "prompt": PROMPTS[2], "n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 8,
            "ignore_eos": True}
    a = client.post("/v1/completions", json=body).json()
    assert sorted(c["index"] for c in a["choices"]) == [0, 1]
    assert all(c["finish_reason"] == "length" for c in a["choices"])
    prompt_tokens = a["usage"]["prompt_tokens"]
    assert a["usage"].pop("prompt_tokens_details")["cached_tokens"] >= 0
    assert a["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 16, "total_tokens": prompt_tokens + 16}
    assert client.post("/v1/completions", json=body).json()["choices"] == a["choices"]  # the same seed, the same text
    with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as r:
        events = [e for _, e in sse_events(r)]
    texts = {0: "", 1: ""}
    for e in events[:-2]:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == {c["index"]: c["text"] for c in a["choices"]}
    events[-2]["usage"].pop("prompt_tokens_details")
    assert events[-2]["usage"] == a["usage"]


def test_stop_string(client, tiny_llm):
    (exp,) = tiny_llm.generate([WHOLE], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    full = exp.outputs[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    r = client.post("/v1/completions", json=greedy(prompt=WHOLE, stop=[stop], ignore_eos=True)).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["text"] == full[:full.index(stop)]


def test_logprobs(client):
    r = client.post("/v1/completions", json=greedy(prompt=PROMPTS[1], logprobs=2, max_tokens=5, ignore_eos=True))
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert all(x <= 0 for x in lp["token_logprobs"])
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"])  # top 2 plus the sampled token
    assert r.json()["usage"]["completion_tokens"] == 5
    r = client.post("/v1/chat/completions", json=greedy(messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                                        logprobs=True, top_logprobs=3, ignore_eos=True))
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(c["top_logprobs"]) == 3 for c in content)


def test_32_concurrent_streams_complete(client):
    import concurrent.futures

    def one(i: int) -> tuple:
        with httpx.Client(base_url=client.base_url, timeout=120) as c:
            with c.stream("POST", "/v1/completions", json=greedy(
                    prompt=f"request {i}", max_tokens=8, ignore_eos=True, stream=True,
                    stream_options={"include_usage": True})) as r:
                events = [e for _, e in sse_events(r)]
        assert events[-1] == "[DONE]"
        return events[-3]["choices"][0]["finish_reason"], events[-2]["usage"]["completion_tokens"]

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        assert list(pool.map(one, range(32))) == [("length", 8)] * 32


def test_client_disconnect_cancels_the_request_on_both_services(client, tiny):
    body = greedy(prompt=PROMPTS[0], max_tokens=1500, ignore_eos=True, stream=True)
    with client.stream("POST", "/v1/completions", json=body) as r:
        for k, _ in enumerate(sse_events(r)):
            if k == 5:
                break  # leaving the block closes the connection
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        held = {name: (load.num_used_blocks, load.num_requests_running, load.num_tracked_requests)
                for name, port in tiny.worker_ports.items() if (load := worker_load(name, port))}
        if all(v == (0, 0, 0) for v in held.values()):
            break
        time.sleep(0.2)
    assert all(v == (0, 0, 0) for v in held.values()), f"still held (blocks, running, tracked): {held}"
    assert client.get("/health").status_code == 200


def test_bad_input_is_400_and_the_stack_stays_up(client):
    for body, param in [({"prompt": ""}, "prompt"), ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "x", "temperature": -1}, "temperature"), ({"prompt": "x", "top_p": 0}, "top_p"),
                        ({"prompt": "x" * 3000}, "prompt")]:
        r = client.post("/v1/completions", json={"model": "random:tiny", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert client.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
    assert client.post("/v1/completions", content=b"{", headers={"content-type": "application/json"}).status_code == 400
    assert client.post("/v1/completions", json=greedy(prompt="still up")).status_code == 200


def test_metrics_expose_tandem_series(client):
    text = client.get("/metrics").text
    assert re.search(r'^tandem:time_to_first_token_seconds_count\{[^}]*role="router"[^}]*\} [1-9]', text, re.M)
    assert re.search(r'^tandem:http_requests_total\{path="/v1/completions",status="200"\} [1-9]', text, re.M)


def test_tokenize_counts_the_prompt_tokens_the_completions_run(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, my name is"}]
    for path, body, key in (("/v1/completions", {"prompt": PROMPTS[1]}, {"prompt": PROMPTS[1]}),
                            ("/v1/chat/completions", {"messages": messages}, {"messages": messages})):
        usage = client.post(path, json=greedy(max_tokens=2, **body)).json()["usage"]
        tokens = client.post("/tokenize", json={"model": "random:tiny", **key}).json()
        assert tokens["count"] == usage["prompt_tokens"] == len(tokens["tokens"]), (path, tokens, usage)
    ids = client.post("/tokenize", json={"prompt": WHOLE, "add_special_tokens": False}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": WHOLE}


def test_every_dashboard_query_finds_its_series_on_the_live_stack(tiny, client):
    """docs/monitoring's Grafana dashboard: each metric a panel queries, with the role it selects, is exported by
    this running stack (router /metrics and each worker's --metrics-port); a latency panel's histogram has
    observations under that role once a request went through (every role exports every family, at 0 where it records
    nothing: a panel reading the wrong role would show a flat line)."""
    assert client.post("/v1/completions", json=greedy(prompt=PROMPTS[1], max_tokens=4)).status_code == 200
    text = client.get("/metrics").text + "".join(
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text for port in tiny.metrics_ports)
    series = [(m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")), float(m.group(3)))
              for m in re.finditer(r"^(tandem:\w+)(?:\{([^}]*)\})? (\S+)$", text, re.M)]
    dashboard = json.loads((ROOT / "docs/monitoring/grafana/dashboards/tandem.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(queries) >= 15
    missing = []
    for expr in queries:
        for name, selector in re.findall(r"(tandem:\w+)\{([^}]*)\}", expr):
            role = re.search(r'role=(~?)"([^"]*)"', selector)
            want = re.compile(role.group(2) if role else ".*")
            observed = name.removesuffix("_bucket") + "_count" if name.endswith("_bucket") else name
            if not any(n == observed and want.fullmatch(labels.get("role", "")) and (value > 0 or observed == name)
                       for n, labels, value in series):
                missing.append(f"{name}{{{selector}}}")
    assert not missing, missing


def test_ctrl_c_stops_every_process(tiny):
    pids = tiny.child_pids()
    assert sorted(pids) == ["decode-0", "decode-1", "prefill-0", "router"]
    assert tiny.stop(signal.SIGINT) == 0
    assert [name for name, pid in pids.items() if alive(pid)] == []
    assert "tandem up: stopped" in "".join(tiny.lines)


def test_cache_aware_policy_sends_a_shared_prefix_to_the_prefill_that_has_it(tiny_llm):
    """Two prefill workers under --policy cache_aware: prompts that share a 64-token prefix all go to the worker
    that computed it first, whose prefix cache then serves those 64 tokens of each (round_robin would alternate and
    leave half of them uncached). The decode worker reuses its own copy of those 64 tokens' blocks for the 2nd to
    4th prompt (it skips their incoming KV) and still generates what the offline engine does."""
    stack = Stack("--model", "random:tiny", "--policy", "cache_aware", prefill=2, decode=1).wait_ready()
    try:
        shared = list(range(300, 364))
        prompts = [shared + [10 + k, 20 + k] for k in range(4)]
        got = []
        with httpx.Client(base_url=stack.http, timeout=120) as c:
            for prompt in prompts:
                r = c.post("/v1/completions", json=greedy(prompt=prompt, max_tokens=6, ignore_eos=True, **IDS))
                assert r.status_code == 200, r.text
                got.append(ids_of(r.json()["choices"][0]["logprobs"]["tokens"]))
        want = tiny_llm.generate([{"prompt_token_ids": p} for p in prompts],
                                 SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        assert got == [w.outputs[0].token_ids for w in want]

        def series(port: int, name: str, role: str) -> float:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            m = re.search(rf'^tandem:{name}\{{[^}}]*role="{role}"[^}}]*\}} (\S+)$', text, re.M)
            return float(m.group(1))

        ports = stack.metrics_ports[:2]  # prefill-0, prefill-1
        prompt_tokens = [series(p, "prompt_tokens_total", "prefill") for p in ports]
        hits = [series(p, "prefix_cache_hits_total", "prefill") for p in ports]
        assert sorted(prompt_tokens) == [0.0, 4 * 66.0], prompt_tokens  # every prompt on one worker
        assert max(hits) == 3 * 64.0, hits  # the 2nd to 4th found the 64 shared tokens cached
        assert series(stack.metrics_ports[2], "prefix_cache_hits_total", "decode") == 3 * 64.0
    finally:
        assert stack.stop() == 0


def test_a_stopping_decode_worker_finishes_its_streams_first():
    """SIGTERM to the only decode worker while a long stream runs (a rolling restart): its health turns
    NOT_SERVING at once (the router's /health goes 503, at its next health poll: no decode capacity for new
    requests), the stream still runs to its last token, well past the old 2 s cut-off, and then the worker exits."""
    stack = Stack("--model", "random:tiny", prefill=1, decode=1).wait_ready()
    try:
        decode_pid = stack.child_pids()["decode-0"]
        # health: the router's /health from its first 503 on (before it, the router's poll has not yet seen the
        # NOT_SERVING: when that poll comes depends on how busy the machine is, so the test waits for it)
        tokens, health, t_term, finish, asked = 0, [], None, None, 0.0
        with httpx.Client(base_url=stack.http, timeout=120) as c:
            body = greedy(prompt=WHOLE, max_tokens=1900, ignore_eos=True, stream=True)
            with c.stream("POST", "/v1/completions", json=body) as r:
                for _, event in sse_events(r):
                    if event == "[DONE]":
                        break
                    assert "error" not in event, event
                    choice = event["choices"][0]
                    tokens += 1 if choice["text"] or choice["finish_reason"] is None else 0
                    finish = choice["finish_reason"] or finish
                    if t_term is None and tokens == 20:
                        os.kill(decode_pid, signal.SIGTERM)
                        t_term = time.monotonic()
                    elif t_term is not None and len(health) < 3 and time.monotonic() - asked > 0.2:
                        asked = time.monotonic()
                        status = c.get("/health").status_code
                        if health or status != 200:
                            health.append(status)
            t_done = time.monotonic()
        assert finish == "length", finish
        if t_done - t_term < 2.5:
            pytest.skip(f"the stream ended {t_done - t_term:.1f} s after SIGTERM: too fast to tell a drain from "
                        "the old 2 s grace on this machine")
        assert health, f"the router's /health was never 503 in the {t_done - t_term:.1f} s the stream ran on"
        assert set(health) == {503}, health  # NOT_SERVING while draining (and it stays so)
        deadline = time.monotonic() + 15
        while alive(decode_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(decode_pid)
    finally:
        stack.stop()


# ------------------------------------------------------------------------------------------------ SmolLM2
def test_smollm2_greedy_completions_and_chat_equal_offline_engine():
    stack = Stack("--model", "smollm2", "--max-model-len", "2048", decode=1)
    llm = LLM("smollm2", device="cpu", max_model_len=2048, kv_cache_memory=0.2)  # loads while the stack starts
    try:
        stack.wait_ready()
        params = SamplingParams(temperature=0, max_tokens=8)
        prompt = "The capital of France is"
        with httpx.Client(base_url=stack.http, timeout=300) as c:
            name = c.get("/v1/models").json()["data"][0]["id"]
            (exp,) = llm.generate([prompt], params)
            r = c.post("/v1/completions", json={"model": name, "prompt": prompt, "temperature": 0, "max_tokens": 8})
            assert r.json()["choices"][0]["text"] == exp.outputs[0].text
            messages = [{"role": "user", "content": "What is 2+2?"}]
            (exp,) = llm.chat(messages, params)
            r = c.post("/v1/chat/completions", json={"model": name, "messages": messages, "temperature": 0,
                                                     "max_tokens": 8})
            assert r.json()["choices"][0]["message"]["content"] == exp.outputs[0].text
            assert r.json()["usage"]["prompt_tokens"] == len(exp.prompt_token_ids)
    finally:
        assert stack.stop(signal.SIGTERM) == 0
