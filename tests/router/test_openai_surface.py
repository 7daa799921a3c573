"""The OpenAI surface beyond generation over a scripted backend: model retrieval, errors in OpenAI's shape for
unknown routes and methods, /ping, stop_reason, cached tokens, return_token_ids, chat echo and
continue_final_message's checks. (Real services and the openai SDK: tests/e2e/test_openai_surface_e2e.py.)"""
import asyncio

import httpx
import pytest

from router.backend import GenerateDelta
from router.core import RouterCore
from router.http import create_app
from scripted_backend import Scripted


class Stopping(Scripted):
    """Writes "ab" and stops on stop string "!" after 5 of 7 prompt tokens came from the prefix cache."""

    async def serve_one(self, rid, index, prompt, params, queue) -> None:
        queue.put_nowait(GenerateDelta(index, [97], "a", None, None, len(prompt), 1, None, 5))
        await asyncio.sleep(0)
        queue.put_nowait(GenerateDelta(index, [98], "b", None, "stop", len(prompt), 2, "!", 5))


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
async def client(anyio_backend):
    transport = httpx.ASGITransport(app=create_app(RouterCore(Stopping())), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
        yield c


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.anyio
async def test_models_retrieve_and_unknown_ids(client):
    r = await client.get("/v1/models/tiny")
    assert r.status_code == 200 and r.json()["id"] == "tiny" and r.json()["object"] == "model"
    err = error(await client.get("/v1/models/gpt-4"), 404)
    assert err["code"] == "model_not_found" and "gpt-4" in err["message"] and "tiny" in err["message"]


@pytest.mark.anyio
async def test_unknown_routes_and_methods_answer_in_openais_shape(client):
    err = error(await client.get("/v1/nope"), 404)
    assert err["code"] == "not_found" and "/v1/nope" in err["message"]
    r = await client.get("/v1/chat/completions")
    err = error(r, 405)
    assert err["code"] == "method_not_allowed" and "POST" in err["message"] and r.headers["allow"] == "POST"


@pytest.mark.anyio
async def test_ping_answers_get_and_post_as_health(client):
    for method in ("GET", "POST"):
        r = await client.request(method, "/ping")
        assert r.status_code == 200 and r.json() == {"status": "ok"}


@pytest.mark.anyio
async def test_stop_reason_cached_tokens_and_token_ids(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "return_token_ids": True}
    r = (await client.post("/v1/chat/completions", json=body)).json()
    (choice,) = r["choices"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "!" and choice["token_ids"] == [97, 98]
    assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
    assert r["prompt_token_ids"] == (await client.post("/tokenize", json={"messages": body["messages"]})).json()[
        "tokens"]
    c = (await client.post("/v1/completions", json={"prompt": "hi", "return_token_ids": True})).json()
    assert c["choices"][0]["stop_reason"] == "!" and c["choices"][0]["token_ids"] == [97, 98]
    assert c["choices"][0]["prompt_token_ids"] == (await client.post("/tokenize", json={"prompt": "hi"})).json()[
        "tokens"]
    plain = (await client.post("/v1/completions", json={"prompt": "hi"})).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


@pytest.mark.anyio
async def test_stream_carries_token_ids_and_stop_reason(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "return_token_ids": True, "stream": True}
    r = await client.post("/v1/chat/completions", json=body)
    chunks = [httpx.Response(200, content=line[6:]).json() for line in r.text.split("\n\n")
              if line.startswith("data: {")]
    assert "prompt_token_ids" in chunks[0] and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [t for ch in chunks[1:] for t in ch["choices"][0]["token_ids"]] == [97, 98]
    assert chunks[-1]["choices"][0]["stop_reason"] == "!"


@pytest.mark.anyio
async def test_chat_echo_puts_the_last_message_in_front(client):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    r = await client.post("/v1/chat/completions", json={"messages": msgs, "echo": True,
                                                        "add_generation_prompt": False,
                                                        "continue_final_message": True})
    assert r.json()["choices"][0]["message"]["content"] == "The answer isab"
    r = await client.post("/v1/chat/completions", json={"messages": msgs[:1], "echo": True})
    assert r.json()["choices"][0]["message"]["content"] == "ab"  # the last message is not the reply's role


@pytest.mark.anyio
@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),  # with add_generation_prompt (its default)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True,
                              "add_generation_prompt": False}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
])
async def test_option_misuse_is_400_naming_it(client, path, body, param):
    assert error(await client.post(path, json=body), 400)["param"] == param
