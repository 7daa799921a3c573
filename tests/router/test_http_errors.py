"""The HTTP front's answers that need no worker: request validation, errors in OpenAI's JSON, /health, /metrics,
/v1/models. The app runs over a real RouterCore (random:tiny's tokenizer) whose prefill and decode addresses have
nobody listening, so it is up but not ready. Generation is tested end to end in tests/e2e/test_http_e2e.py."""
import socket

import httpx
import pytest

from router.core import RouterConfig, RouterCore
from router.http import create_app


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: nobody listens there


@pytest.fixture(scope="module")
async def client(anyio_backend):
    addr = f"127.0.0.1:{_closed_port()}"
    core = await RouterCore.create(RouterConfig(prefill_addrs=[addr], decode_addrs=[addr], model="random:tiny",
                                                max_model_len=64))
    transport = httpx.ASGITransport(app=create_app(core))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
        yield c
    await core.close()


def _assert_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return err


BAD = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x" * 64}, "prompt"),  # 64 tokens: the whole context, nothing left to generate
    ({"prompt": "hello", "max_tokens": 60}, "max_tokens"),  # 5 + 60 > max_model_len=64
    ({"prompt": "hello", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hello", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "hello", "temperature": -0.1}, "temperature"),
    ({"prompt": "hello", "top_p": 0}, "top_p"),
    ({"prompt": "hello", "top_p": 1.01}, "top_p"),
    ({"prompt": "hello", "n": 0}, "n"),
    ({"prompt": "hello", "logprobs": 21}, "logprobs"),
    ({"prompt": "hello", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": [1, 2, 100000]}, "prompt_token_ids"),  # outside the vocabulary
    ({"max_tokens": 3}, "prompt"),
]


@pytest.mark.anyio
@pytest.mark.parametrize("body,param", BAD, ids=[f"{p}:{list(b.items())[-1]}"[:60] for b, p in BAD])
async def test_completions_bad_input_is_400_naming_the_field(client, body, param):
    _assert_error(await client.post("/v1/completions", json={"model": "random:tiny", **body}), 400, param)


@pytest.mark.anyio
@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 40}]}, "prompt_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
     "response_format"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "a("}, "guided_regex"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("/generate", {"prompt": ""}, "prompt"),
    ("/generate", {"prompt": "hi", "top_p": 2}, "top_p"),
])
async def test_other_endpoints_bad_input_is_400_naming_the_field(client, path, body, param):
    _assert_error(await client.post(path, json=body), 400, param)


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
async def test_malformed_json_is_400(client, path):
    for raw in (b'{"prompt": "hi",', b"[1, 2]", b"\xff\xfe"):
        err = _assert_error(await client.post(path, content=raw, headers={"content-type": "application/json"}),
                            400, None)
        assert "JSON" in err["message"]


@pytest.mark.anyio
@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "hi"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                       ("/generate", {"prompt": "hi"})])
async def test_unknown_model_is_404(client, path, body):
    err = _assert_error(await client.post(path, json={**body, "model": "gpt-4"}), 404, "model")
    assert err["code"] == "model_not_found" and "gpt-4" in err["message"]


@pytest.mark.anyio
async def test_valid_request_without_workers_is_503_and_the_router_stays_up(client):
    err = _assert_error(await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 503, None)
    assert err["code"] == "unavailable"
    assert (await client.get("/v1/models")).status_code == 200


@pytest.mark.anyio
async def test_health_is_503_until_prefill_and_decode_are_up(client):
    r = await client.get("/health")
    assert r.status_code == 503


@pytest.mark.anyio
async def test_models_lists_the_served_model(client):
    r = await client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [("random:tiny", "model", 64)]


@pytest.mark.anyio
async def test_metrics_are_prometheus_text_with_tandem_names(client):
    await client.post("/v1/completions", json={"prompt": ""})
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'tandem:http_requests_total{path="/v1/completions",status="400"}' in r.text
    assert "tandem:time_to_first_token_seconds" in r.text


@pytest.mark.anyio
async def test_tokenize_and_detokenize_need_no_worker(client):
    from engine.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model("random:tiny"))
    r = await client.post("/tokenize", json={"prompt": "Hello, my name is"})
    assert r.status_code == 200, r.text
    want = tok("Hello, my name is").input_ids
    assert r.json() == {"count": len(want), "max_model_len": 64, "tokens": want}
    plain = (await client.post("/tokenize", json={"prompt": "Hello", "add_special_tokens": False})).json()["tokens"]
    assert plain == tok("Hello", add_special_tokens=False).input_ids
    chat = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})).json()
    assert chat["count"] == len(chat["tokens"]) > 1 and "hi" in tok.decode(chat["tokens"])  # (equal to the chat
    # endpoint's prompt: tests/e2e/test_http_e2e.py)
    r = await client.post("/detokenize", json={"tokens": want})
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(want)}
    assert (await client.get("/version")).json()["version"]


@pytest.mark.anyio
@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/detokenize", {"tokens": [1, 512]}, "tokens"),  # random:tiny's vocabulary is [0, 512)
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
async def test_tokenize_bad_input_is_400_naming_the_field(client, path, body, param):
    err = _assert_error(await client.post(path, json=body), 400, param)
    if path == "/detokenize" and body.get("tokens"):
        assert "[0, 512)" in err["message"]
    assert (await client.post(path, json={**body, "model": "gpt-4"})).status_code in (400, 404)


SURROGATE = [  # (raw body, the field named): JSON lets a body carry lone UTF-16 surrogates, as escapes or as bytes
    ('{"prompt": "hi", "stop": "\\ud800"}', "stop"),  # (once a 500: protobuf cannot encode it for the workers)
    ('{"prompt": "hi", "stop": ["x", "\\udfff"]}', "stop"),
    ('{"prompt": "hi", "model": "\\ud800"}', "model"),  # (once a 500 without a body: the 404 could not render)
    ('{"prompt": "hi", "unknown": {"deep": ["\\ud800"]}}', "unknown"),
    ('{"prompt": "hi", "\\ud800": 1}', None),
    ('{"prompt": "ok \\ud83d\\ude00", "stop": "\\ud800\\ud800"}', "stop"),  # (a pair is fine, two highs are not)
]


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate", "/tokenize"])
@pytest.mark.parametrize("raw,param", SURROGATE)
async def test_lone_surrogates_anywhere_are_400_naming_the_field(client, path, raw, param):
    if path in ("/v1/chat/completions", "/tokenize"):
        raw = raw.replace('"prompt": "hi"', '"messages": [{"role": "user", "content": "hi"}]')
    err = _assert_error(await client.post(path, content=raw.encode(), headers={"content-type": "application/json"}),
                        400, param)
    assert "lone UTF-16 surrogate" in err["message"], err


@pytest.mark.anyio
async def test_a_surrogate_in_utf8_bytes_or_a_chat_role_is_400(client):
    err = _assert_error(await client.post("/v1/completions", content=b'{"prompt": "hi", "stop": "\xed\xa0\x80"}',
                                          headers={"content-type": "application/json"}), 400, "stop")
    assert err["message"].startswith("stop: not valid text")
    err = _assert_error(await client.post("/v1/chat/completions", content=b'{"messages": [{"role": "\\ud800"}]}',
                                          headers={"content-type": "application/json"}), 400, "messages")
    assert err["message"].startswith("messages.0.role: not valid text")


def test_an_error_quoting_any_text_renders():
    from router.http import _error_response
    from router.openai_serving import APIError

    r = _error_response(APIError(404, "The model `\ud800` does not exist", "model", "model_not_found"))
    assert r.status_code == 404 and b"\\ud800" in r.body


@pytest.mark.anyio
async def test_top_logprobs_out_of_range_names_top_logprobs(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2 ** 63}
    err = _assert_error(await client.post("/v1/chat/completions", json=body), 400, "top_logprobs")
    assert err["message"].startswith("top_logprobs=9223372036854775808: must be an int in [0, 20]"), err


@pytest.mark.anyio
async def test_an_error_quotes_a_huge_value_cut_short(client):
    err = _assert_error(await client.post("/v1/completions", json={"prompt": "hi", "n": "9" * 1_000_000}), 400, "n")
    assert len(err["message"]) < 500 and "1000002 characters" in err["message"], err["message"][:300]
    err = _assert_error(await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"x": "y" * 1_000_000}}), 400, "tool_choice")
    assert len(err["message"]) < 500


@pytest.mark.anyio
@pytest.mark.parametrize("field,value", [
    ("stop", [f"s{i}" for i in range(65)]),  # (200,000 of them with n=128: a 500 after 38 s, the decode worker swamped)
    ("stop", "x" * 1025),
    ("stop", ["ok", "x" * 1025]),
    ("stop_token_ids", [7] * 1025),
])
async def test_stop_conditions_past_their_bounds_are_400(client, field, value):
    body = {"prompt": "hi", "n": 128, field: value}
    for path in ("/v1/completions", "/generate"):
        err = _assert_error(await client.post(path, json=body), 400, field)
        assert "at most" in err["message"], err


@pytest.mark.anyio
async def test_token_ids_too_many_for_the_context_are_refused_before_they_are_read(client):
    # Refused for their number (64 here), not for the out-of-vocabulary id at the end: the list is not scanned.
    err = _assert_error(await client.post("/v1/completions", json={"prompt": [7] * 100_000 + [10**9], "echo": True}),
                        400, "prompt_token_ids")
    assert err["message"] == "prompt_token_ids: 100001 tokens, must be fewer than max_model_len=64"
    err = _assert_error(await client.post("/detokenize", json={"tokens": [7] * 65}), 400, "tokens")
    assert err["message"].startswith("tokens: 65 ids, more than max_model_len=64")
    assert (await client.post("/detokenize", json={"tokens": [7] * 64})).status_code == 200


@pytest.mark.anyio
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "use_beam_search": True},
     "use_beam_search"),
    ("/generate", {"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "hi"}], "continue_final_message": True},
     "continue_final_message"),  # (with add_generation_prompt's default, true)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
])
async def test_vllm_extensions_not_honoured_are_400_naming_the_field(client, path, body, param):
    """Beam search does not exist here: use_beam_search true is refused, not answered by sampling; the chat
    template's options that cannot work together are refused naming the field (router/chat_template.py)."""
    err = _assert_error(await client.post(path, json=body), 400, param)
    assert err["message"].startswith(param), err


@pytest.mark.anyio
async def test_use_beam_search_false_is_an_ordinary_request(client):
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "use_beam_search": False})
    assert r.status_code == 503  # accepted, and then no worker is up (see above)
