"""The OpenAI surface against a live stack (one prefill, one decode worker) with the official openai SDK: model
retrieval and errors as the SDK parses them, cached tokens from the prefill worker's prefix cache, stop_reason,
return_token_ids against the tokenizer, chat echo and continue_final_message; stop_reason and cached tokens on the
gRPC API too."""
from __future__ import annotations

import re

import grpc
import httpx
import openai
import pytest

from engine.loader import load_tokenizer, resolve_model
from protos.tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from stack import Stack

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time there was a tiny model that liked to repeat itself"


@pytest.fixture(scope="module")
def stack():
    s = Stack("--model", "random:tiny", prefill=1, decode=1).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.http + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("random:tiny"))


def test_models_retrieve_and_not_found_as_the_sdk_reads_them(client):
    assert client.models.retrieve("random:tiny").id == "random:tiny"
    with pytest.raises(openai.NotFoundError, match="The model `gpt-4` does not exist"):
        client.models.retrieve("gpt-4")
    with pytest.raises(openai.NotFoundError, match="no such route"):
        client.get("/nope", cast_to=object)
    with pytest.raises(openai.BadRequestError, match="stream_options: only with stream=true"):
        client.completions.create(model="random:tiny", prompt="hi", max_tokens=2,
                                  stream_options={"include_usage": True})
    with pytest.raises(openai.APIStatusError, match="method not allowed") as e:
        client.get("/chat/completions", cast_to=object)
    assert e.value.status_code == 405 and e.value.body["code"] == "method_not_allowed"
    with pytest.raises(openai.BadRequestError) as e:  # (FastAPI's 422 for a wrong type, in OpenAI's shape)
        client.completions.create(model="random:tiny", prompt="hi", max_tokens=2, temperature="hot")
    assert e.value.body["param"] == "temperature" and e.value.body["type"] == "invalid_request_error"


def test_ping_answers_as_health(stack):
    for method in ("GET", "POST"):
        r = httpx.request(method, stack.http + "/ping", timeout=30)
        assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_add_generation_prompt_false_leaves_the_assistant_header_out(client, tokenizer):
    messages = [{"role": "user", "content": "Say something."}]
    for add in (True, False):
        r = client.chat.completions.create(model="random:tiny", messages=messages, max_tokens=1,
                                           extra_body={"return_token_ids": True, "add_generation_prompt": add})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert r.model_extra["prompt_token_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"], add


def test_a_repeated_prompt_is_served_from_the_prefix_cache(client):
    first = client.completions.create(model="random:tiny", prompt=PROMPT, max_tokens=2, temperature=0)
    again = client.completions.create(model="random:tiny", prompt=PROMPT, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the full blocks of the same prompt
    assert again.choices[0].text == first.choices[0].text


def test_stop_reason_names_the_stop_token_and_the_stop_string(client, tokenizer):
    base = client.completions.create(model="random:tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = base.choices[0].model_extra["token_ids"]
    assert len(ids) == 6 and base.choices[0].model_extra["stop_reason"] is None  # max_tokens: no stop reason
    r = client.completions.create(model="random:tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                  extra_body={"stop_token_ids": [ids[2]], "ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == ids[2]
    text = base.choices[0].text
    stop = text[len(text) // 2:][:2] or text
    r = client.completions.create(model="random:tiny", prompt=PROMPT, max_tokens=6, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop


def test_return_token_ids_are_the_tokenizers(client, tokenizer):
    messages = [{"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model="random:tiny", messages=messages, max_tokens=4, temperature=0,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    prompt_ids = r.model_extra["prompt_token_ids"]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(r.choices[0].model_extra["token_ids"]) == r.usage.completion_tokens == 4
    streamed = client.chat.completions.create(model="random:tiny", messages=messages, max_tokens=4, temperature=0,
                                              stream=True, extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = [t for chunk in streamed for c in chunk.choices for t in (c.model_extra.get("token_ids") or [])]
    assert ids == r.choices[0].model_extra["token_ids"]


def test_echo_and_continue_final_message(client):
    messages = [{"role": "user", "content": "Tell a story."}, {"role": "assistant", "content": "Once upon"}]
    r = client.chat.completions.create(model="random:tiny", messages=messages, max_tokens=4, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                   "echo": True, "ignore_eos": True})
    content = r.choices[0].message.content
    assert content.startswith("Once upon") and len(content) > len("Once upon")  # a continuation, not an empty turn
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(model="random:tiny", messages=messages, max_tokens=4,
                                       extra_body={"continue_final_message": True})


def test_grpc_generate_reports_stop_reason_and_cached_tokens(stack):
    with grpc.insecure_channel(stack.grpc) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        req = generate_pb2.GenerateRequest(model="random:tiny", prompt=PROMPT, params=common_pb2.SamplingParams(
            temperature=0, max_tokens=6, ignore_eos=True))
        first = list(stub.Generate(req, timeout=120))
        ids = [t for r in first for t in r.delta.token_ids]
        req.params.stop_token_ids.append(ids[1])
        last = list(stub.Generate(req, timeout=120))[-1]
    assert last.delta.stop_reason == str(ids[1]) and last.usage.cached_prompt_tokens > 0


def test_grpc_structured_outputs_and_continue_final_message(stack, tokenizer):
    regex = r"[a-c]{3}-\d{2}"
    with grpc.insecure_channel(stack.grpc) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        req = generate_pb2.GenerateRequest(model="random:tiny", prompt="id:", params=common_pb2.SamplingParams(
            n=20, seed=7, temperature=1.0, max_tokens=12,
            structured_outputs=common_pb2.StructuredOutputs(regex=regex)))
        texts: dict[int, str] = {}
        for r in stub.Generate(req, timeout=120):
            texts[r.index] = texts.get(r.index, "") + r.delta.text
        assert len(texts) == 20 and all(re.fullmatch(regex, t) for t in texts.values()), texts
        messages = [generate_pb2.ChatMessage(role="user", content="Tell a story."),
                    generate_pb2.ChatMessage(role="assistant", content="Once upon")]
        chat = generate_pb2.ChatRequest(model="random:tiny", messages=messages, continue_final_message=True,
                                        params=common_pb2.SamplingParams(temperature=0, max_tokens=3,
                                                                         ignore_eos=True))
        ids = [t for r in stub.Chat(chat, timeout=120) for t in r.delta.token_ids]
    http = httpx.post(stack.http + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": m.role, "content": m.content} for m in messages], "continue_final_message": True,
        "add_generation_prompt": False, "temperature": 0, "max_tokens": 3, "ignore_eos": True,
        "return_token_ids": True}).json()
    assert ids == http["choices"][0]["token_ids"] and len(ids) == 3  # the open turn, continued
    assert tokenizer.decode(http["prompt_token_ids"]).rstrip().endswith("Once upon")
