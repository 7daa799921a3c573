"""router/openai_serving.py and router/core.py over a scripted Backend (router/backend.py): the one streaming path
and the one gathering path of the OpenAI endpoints, and the core's fan-out. (Real services: tests/e2e.)"""
import json

import httpx
import pytest

from router.core import RouterCore
from router.http import create_app
from scripted_backend import Scripted


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
async def app(anyio_backend):
    backend = Scripted()
    transport = httpx.ASGITransport(app=create_app(RouterCore(backend)), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
        yield c, backend


def events(r: httpx.Response) -> list:
    """The SSE body's events, parsed ("[DONE]" as it is); each is one `data: ...` and a blank line."""
    assert r.text.startswith("data: ") and r.text.endswith("\n\n"), r.text
    raw = r.text[len("data: "):-2].split("\n\ndata: ")
    return [e if e == "[DONE]" else json.loads(e) for e in raw]


@pytest.mark.anyio
async def test_core_fans_n_out_into_seeded_sub_requests(app):
    client, backend = app
    r = await client.post("/v1/completions", json={"prompt": "hi", "n": 3, "seed": 7})
    assert [c["text"] for c in r.json()["choices"]] == ["abc"] * 3
    assert sorted(backend.served) == [(f"{r.json()['id']}-{i}", i, 7 + i) for i in range(3)]


@pytest.mark.anyio
async def test_stream_sends_one_chunk_per_delta_then_usage_then_done(app):
    client, _ = app
    r = await client.post("/v1/completions", json={"prompt": ["hi", "yo"], "n": 2, "stream": True,
                                                   "stream_options": {"include_usage": True}})
    ev = events(r)
    assert ev[-1] == "[DONE]" and ev[-2]["choices"] == [] and ev[-2]["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 12, "total_tokens": 16, "prompt_tokens_details": {"cached_tokens": 0}}
    by_choice: dict[int, str] = {}
    for e in ev[:-2]:
        (c,) = e["choices"]
        by_choice[c["index"]] = by_choice.get(c["index"], "") + c["text"]
    assert by_choice == {0: "abc", 1: "abc", 2: "abc", 3: "abc"}  # prompt index * n + choice


@pytest.mark.anyio
async def test_gather_and_stream_agree_for_chat(app):
    client, _ = app
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 3}
    whole = (await client.post("/v1/chat/completions", json=body)).json()
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in whole["choices"]] == [
        (0, "abc", "length"), (1, "abc", "length")]
    ev = events(await client.post("/v1/chat/completions", json={**body, "stream": True}))
    assert [e["choices"][0]["delta"] for e in ev[:2]] == [{"role": "assistant", "content": ""}] * 2
    texts = ["", ""]
    for e in ev[2:-1]:
        texts[e["choices"][0]["index"]] += e["choices"][0]["delta"]["content"]
    assert texts == ["abc", "abc"] and ev[-1] == "[DONE]"


@pytest.mark.anyio
async def test_a_failure_mid_stream_is_an_error_event_before_done(app):
    client, _ = app
    ev = events(await client.post("/v1/completions", json={"prompt": "fail", "stream": True}))
    assert ev[0]["choices"][0]["text"] == "a" and ev[-1] == "[DONE]"
    assert ev[-2] == {"error": {"message": "decode x: gone", "type": "server_error", "param": None,
                                "code": "unavailable"}}
    r = await client.post("/v1/completions", json={"prompt": "fail"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"


@pytest.mark.anyio
async def test_generate_streams_whole_texts_and_breaks_off_on_a_failure(app):
    client, _ = app
    r = await client.post("/generate", json={"prompt": "hi", "stream": True})
    assert r.text.split("\0") == ['{"text": ["hia"]}', '{"text": ["hiab"]}', '{"text": ["hiabc"]}', ""]
    assert (await client.post("/generate", json={"prompt": "hi", "n": 2})).json() == {"text": ["hiabc"] * 2}
    r = await client.post("/generate", json={"prompt": "fail", "stream": True})
    assert r.text == '{"text": ["faila"]}\0'  # no error event, no end: the stream stops
