"""Tool calling against a live stack with the official openai SDK: a tiny random Qwen2 whose tokenizer carries
Qwen2.5's real chat template (tests/router/chat_templates), `--tool-call-parser hermes --enable-auto-tool-choice`.

Random weights do not decide to call a tool, so what can be checked honestly is checked: the template renders the
tools and the tool turns (the prompt grows by them), `tool_choice: none` leaves the text alone, `auto` parses
whatever the model wrote the same way streamed and gathered. The full loop (call, result, answer) runs with a named
choice, which the structured-outputs grammar enforces: it needs engine.sampling_params.StructuredOutputsParams."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from stack import Stack

pytestmark = pytest.mark.slow

TEMPLATES = Path(__file__).resolve().parents[1] / "router" / "chat_templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    # (a closed set of cities: the model's weights are random, and a free string need not end within max_tokens;
    # the grammar makes any output a valid call only once it ends)
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

try:
    from engine.sampling_params import StructuredOutputsParams  # noqa: F401
    HAVE_GRAMMAR = True
except ImportError:
    HAVE_GRAMMAR = False


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2_dir, tmp_path_factory) -> Path:
    from engine.tokenizer import load_synthetic

    out = tmp_path_factory.mktemp("tiny-qwen2-tools") / "model"
    shutil.copytree(tiny_qwen2_dir, out)
    tok = load_synthetic(out)
    tok.chat_template = (TEMPLATES / "qwen2_5.jinja").read_text()
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def stack(model_dir):
    s = Stack("--model", str(model_dir), "--served-model-name", "qwen", "--tool-call-parser", "hermes",
              "--enable-auto-tool-choice", prefill=1, decode=1).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.http + "/v1", api_key="unused", timeout=120, max_retries=0)


def assembled(chunks):
    """The chunks through the openai SDK's own assembler (its snapshot: a reply cut by max_tokens is kept, where
    `get_final_completion` would refuse it)."""
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.current_completion_snapshot


def test_tools_and_tool_turns_are_rendered(client):
    plain = client.chat.completions.create(model="qwen", messages=ASK, max_tokens=1)
    with_tools = client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], tool_choice="none",
                                                max_tokens=1)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + len(json.dumps(WEATHER)) // 2
    loop = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    after = client.chat.completions.create(model="qwen", messages=loop, tools=[WEATHER], tool_choice="none",
                                           max_tokens=1)
    assert after.usage.prompt_tokens > with_tools.usage.prompt_tokens


def test_tool_choice_none_is_plain_content(client):
    r = client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], tool_choice="none",
                                       max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.tool_calls in (None, []) and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content


@pytest.mark.parametrize("seed", [0, 1])
def test_auto_parses_the_same_streamed_and_gathered(client, seed):
    kw = dict(model="qwen", messages=ASK, tools=[WEATHER], max_tokens=24, temperature=1.0, seed=seed)
    whole = client.chat.completions.create(**kw).choices[0]
    streamed = assembled(client.chat.completions.create(**kw, stream=True)).choices[0]
    assert streamed.message.content == whole.message.content
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert streamed.finish_reason == whole.finish_reason


@pytest.mark.skipif(not HAVE_GRAMMAR, reason="needs engine.sampling_params.StructuredOutputsParams (the "
                                             "structured-outputs work) to enforce a named tool_choice")
@pytest.mark.parametrize("stream", [False, True])
def test_a_full_tool_loop_with_a_named_choice(client, stream):
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model="qwen", messages=ASK, tools=[WEATHER], tool_choice=named, max_tokens=48, temperature=0)
    if stream:
        choice = assembled(client.chat.completions.create(**kw, stream=True)).choices[0]
    else:
        choice = client.chat.completions.create(**kw).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert isinstance(args.get("city"), str)
    assert choice.finish_reason == "tool_calls"
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model="qwen", messages=messages, tools=[WEATHER], tool_choice="none",
                                            max_tokens=8, extra_body={"ignore_eos": True})
    assert answer.choices[0].message.content and answer.choices[0].finish_reason == "length"
