"""router/tool_calls.py: the tool choice a request settles to, the grammar of `required` and named choices, and the
chat endpoint's tool calls, streamed and gathered, as the openai SDK assembles them (over a scripted backend)."""
import asyncio
import json

import httpx
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from engine.sampling_params import SamplingParams
from router.backend import GenerateDelta
from router.core import RouterCore
from router.http import create_app
from router.tool_calls import CallStream, ToolChoice, ToolChoiceError, ToolConfig, constrained, tool_choice_constraint
from scripted_backend import Scripted

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"$ref": "#/$defs/city"}}, "required": ["city"],
    "$defs": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
AUTO = ToolConfig("hermes", True)


def test_required_is_an_array_of_calls_any_of_the_tools():
    schema = tool_choice_constraint([WEATHER, TIME], "required")
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert schema["$defs"] == {"city": {"type": "string"}}
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert all(item["required"] == ["name", "parameters"] for item in schema["items"]["anyOf"])
    assert tool_choice_constraint([WEATHER], "required", parallel=False)["maxItems"] == 1


def test_named_is_the_functions_parameters():
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_choice_constraint([WEATHER, TIME], named) == WEATHER["function"]["parameters"]
    assert tool_choice_constraint([TIME], {"type": "function", "function": {"name": "get_time"}}) == {
        "type": "object", "properties": {}}
    with pytest.raises(ToolChoiceError, match="'nope' is not one of the tools"):
        tool_choice_constraint([WEATHER], {"type": "function", "function": {"name": "nope"}})
    assert tool_choice_constraint([WEATHER], "auto") is None and tool_choice_constraint([WEATHER], "none") is None


def test_conflicting_defs_are_refused():
    other = {"type": "function", "function": {"name": "g", "parameters": {"$defs": {"city": {"type": "integer"}}}}}
    with pytest.raises(ToolChoiceError, match=r"\$defs.city"):
        tool_choice_constraint([WEATHER, other], "required")


def test_the_choice_a_request_settles_to():
    assert ToolChoice.of([WEATHER], None, True, AUTO).mode == "auto"  # OpenAI's default with tools
    assert ToolChoice.of([WEATHER], "none", True, ToolConfig()).mode == "none"
    assert ToolChoice.of(None, None, True, ToolConfig()).mode == "none"
    with pytest.raises(ToolChoiceError, match="--enable-auto-tool-choice and --tool-call-parser"):
        ToolChoice.of([WEATHER], None, True, ToolConfig())
    with pytest.raises(ToolChoiceError, match="needs tools"):
        ToolChoice.of(None, "required", True, AUTO)
    with pytest.raises(ToolChoiceError, match="'get_time' is given twice"):
        ToolChoice.of([WEATHER, TIME, TIME], "none", True, AUTO)
    with pytest.raises(ToolChoiceError, match=r"\$defs must be an object"):
        tool_choice_constraint([{"type": "function", "function": {"name": "f", "parameters": {"$defs": []}}}],
                               "required")
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ToolConfig(None, True)


def test_a_tool_choice_constraint_is_a_json_schema_grammar():
    params = SamplingParams(max_tokens=4)
    assert json.loads(constrained(params, {"type": "object"}, "required").structured_outputs.json) == {"type": "object"}


# ---------------------------------------------------------------------------------------------------- endpoint
class Texts(Scripted):
    """Every choice writes TEXT, one piece per delta, and stops (on the end of sequence)."""
    pieces: list[str] = []

    async def serve_one(self, rid, index, prompt, params, queue) -> None:
        for k, piece in enumerate(self.pieces):
            last = k == len(self.pieces) - 1
            queue.put_nowait(GenerateDelta(index, [97 + k], piece, None, "stop" if last else None, len(prompt), k + 1))
            await asyncio.sleep(0)


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def chat(pieces: list[str], body: dict, tools: ToolConfig = AUTO):
    backend = Texts()
    backend.pieces = pieces
    app = create_app(RouterCore(backend), tools=tools)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
        whole = await c.post("/v1/chat/completions", json=body)
        streamed = await c.post("/v1/chat/completions", json={**body, "stream": True})
    return whole, streamed


def assembled(r: httpx.Response):
    """The SSE body through the openai SDK's own stream assembler."""
    state = ChatCompletionStreamState()
    for line in r.text.split("\n\n"):
        if line.startswith("data: ") and line != "data: [DONE]":
            state.handle_chunk(ChatCompletionChunk.model_validate_json(line[len("data: "):]))
    return state.get_final_completion()


BODY = {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER, TIME]}
REPLY = ['Sure', '. <tool', '_call>\n{"name": "get_w', 'eather", "arguments": {"ci', 'ty": "Paris"}}\n</tool_call>',
         '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>']


@pytest.mark.anyio
async def test_streamed_calls_assemble_to_the_gathered_ones():
    whole, streamed = await chat(REPLY, BODY)
    (choice,) = whole.json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure. \n"
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]]
    assert got == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in choice["message"]["tool_calls"])
    final = assembled(streamed).choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "Sure. \n"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    # Each call's first entry carries its index, id, type and name.
    chunks = [[tc for c in json.loads(line[6:])["choices"] for tc in c["delta"].get("tool_calls", [])]
              for line in streamed.text.split("\n\n") if line.startswith("data: {")]
    firsts = [tc for chunk in chunks for tc in chunk]
    assert [(tc["index"], tc["type"], tc["function"]["name"], tc["function"]["arguments"]) for tc in firsts
            if "id" in tc] == [(0, "function", "get_weather", ""), (1, "function", "get_time", "")]
    # ... then its arguments as the model wrote them, in the chunks after: one index per chunk
    assert [tc["function"]["arguments"] for tc in firsts if tc["index"] == 0 and "id" not in tc] == [
        '{"ci', 'ty": "Paris"}']
    assert all(len({tc["index"] for tc in chunk}) == len(chunk) for chunk in chunks)


@pytest.mark.anyio
async def test_parallel_tool_calls_false_keeps_the_first():
    whole, streamed = await chat(REPLY, {**BODY, "parallel_tool_calls": False})
    assert [c["function"]["name"] for c in whole.json()["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
    assert [c.function.name for c in assembled(streamed).choices[0].message.tool_calls] == ["get_weather"]


@pytest.mark.anyio
async def test_tool_choice_none_leaves_the_text_alone():
    whole, streamed = await chat(REPLY, {**BODY, "tool_choice": "none"}, ToolConfig())
    (choice,) = whole.json()["choices"]
    assert choice["message"]["content"] == "".join(REPLY) and choice["message"]["tool_calls"] == []
    assert choice["finish_reason"] == "stop"
    assert assembled(streamed).choices[0].message.content == "".join(REPLY)


@pytest.mark.anyio
async def test_a_reply_without_calls_is_content_and_stops():
    whole, streamed = await chat(["no ", "<tool", " calls here"], BODY)
    (choice,) = whole.json()["choices"]
    assert choice["message"] == {"role": "assistant", "content": "no <tool calls here", "tool_calls": []}
    assert choice["finish_reason"] == "stop"
    assert assembled(streamed).choices[0].message.content == "no <tool calls here"


@pytest.mark.anyio
@pytest.mark.parametrize("body,param", [
    ({**BODY}, "tool_choice"),  # auto without the flags
    ({**BODY, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"messages": BODY["messages"], "tool_choice": "required"}, "tool_choice"),
    ({**BODY, "tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "none"}, "tools"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
])
async def test_bad_tool_requests_are_400_naming_the_field(body, param):
    whole, _ = await chat(["x"], body, ToolConfig())
    assert whole.status_code == 400, whole.text
    assert whole.json()["error"]["param"] == param, whole.json()


def feed_all(stream, pieces: list[str]) -> tuple[str, list[dict]]:
    content, entries = "", []
    for k, piece in enumerate(pieces):
        c, e = stream.feed(piece, final=k == len(pieces) - 1)
        content, entries = content + c, entries + e
    return content, entries


def test_a_named_choice_streams_its_arguments_as_generated():
    stream = ToolChoice("named", name="get_weather").stream()
    content, entries = feed_all(stream, ['{"ci', 'ty": ', '"Paris"}'])
    assert content == "" and entries[0]["id"].startswith("call_") and entries[0]["function"]["name"] == "get_weather"
    assert [e["function"]["arguments"] for e in entries] == ["", '{"ci', 'ty": ', '"Paris"}']
    assert all(e["index"] == 0 for e in entries) and all("id" not in e for e in entries[1:])
    assert [(c.name, c.arguments) for c in stream.calls] == [("get_weather", '{"city": "Paris"}')]
    assert stream.finish_reason("stop") == "tool_calls" and stream.finish_reason("length") == "length"


def assembled_entries(entries: list[dict]) -> list[tuple[str, str]]:
    """(name, arguments) per index, the entries put together as the openai SDK does (strings appended)."""
    calls: dict[int, list[str]] = {}
    for e in entries:
        if "id" in e:
            assert e["index"] not in calls and e["type"] == "function", e
            calls[e["index"]] = [e["function"]["name"], e["function"]["arguments"]]
        else:
            assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}, e
            calls[e["index"]][1] += e["function"]["arguments"]
    return [tuple(calls[i]) for i in sorted(calls)]


def test_required_reads_the_array_of_calls_split_anywhere():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    for cut in range(len(text) + 1):
        stream = ToolChoice("required").stream()
        content, entries = feed_all(stream, [text[:cut], text[cut:]])
        assert content == "" and assembled_entries(entries) == [("get_weather", '{"city": "Paris"}'),
                                                                ("get_time", "{}")]
        assert [(c.name, c.arguments) for c in stream.calls] == assembled_entries(entries)
    cut_short = ToolChoice("required").stream()
    assert feed_all(cut_short, ['[{"name": "get_weather", "para']) == ('[{"name": "get_weather", "para', [])


def test_required_streams_each_calls_arguments_as_they_come():
    text = '[{"name":"get_weather","parameters":{"city":"Paris","days":3}},{"name":"get_time","parameters":{}}]'
    stream = ToolChoice("required").stream()
    per_token = [stream.feed(ch, final=k == len(text) - 1) for k, ch in enumerate(text)]
    entries = [e for _, es in per_token for e in es]
    firsts = [e for e in entries if "id" in e]
    assert [(e["index"], e["function"]["name"], e["function"]["arguments"]) for e in firsts] == [
        (0, "get_weather", ""), (1, "get_time", "")]
    assert len([e for e in entries if e["index"] == 0 and "id" not in e]) == len('{"city":"Paris","days":3}')
    assert assembled_entries(entries) == [("get_weather", '{"city":"Paris","days":3}'), ("get_time", "{}")]
    # cut short in the second call's arguments (max_tokens): what was streamed is the call
    two = text.replace('"parameters":{}', '"parameters":{"zone":"CET"}')
    cut = ToolChoice("required").stream()
    _, entries = feed_all(cut, [two[:70], two[70:two.index("CET")]])
    assert assembled_entries(entries) == [(c.name, c.arguments) for c in cut.calls] == [
        ("get_weather", '{"city":"Paris","days":3}'), ("get_time", '{"zone":"')]


def test_parallel_tool_calls_false_drops_the_later_calls_arguments_too():
    text = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{"zone":"CET"}}]'
    stream = CallStream(ToolChoice("required").stream().parser, parallel=False)
    content, entries = feed_all(stream, list(text))
    assert content == "" and assembled_entries(entries) == [("get_weather", '{"city":"Paris"}')]
    assert stream.dropped and [(c.name, c.arguments) for c in stream.calls] == [("get_weather", '{"city":"Paris"}')]
