"""router/grpc_chat.py: the gRPC Chat request read as the HTTP chat endpoint reads its body. Whatever the HTTP endpoint
refuses, Chat refuses INVALID_ARGUMENT, naming the field as the proto spells it (tools.0.name,
messages.1.tool_calls.0.arguments, tool_choice.function) and the limit where one was passed; a valid request gives
the HTTP endpoint's dicts. First the conversion as functions, then both APIs over a scripted backend: real gRPC on
loopback (router/grpc_server.py) beside HTTP through the ASGI app (router/http.py)."""
import asyncio
import json
import socket
from pathlib import Path

import grpc
import httpx
import pytest

from protos.tandem.v1 import common_pb2, generate_pb2 as pb, generate_pb2_grpc
from router.chat_template import template_messages
from router.core import RequestError, RouterCore
from router.grpc_chat import ChatTools, messages_from_proto, tool_choice_from_proto, tools_from_proto
from router.grpc_server import start_grpc_server
from router.http import create_app
from router.openai_protocol import MAX_TOOLS, ChatMessage, ChatTool, NamedToolChoice
from router.tool_calls import ToolConfig
from scripted_backend import Scripted

PATTERN = "String should match pattern '^[a-zA-Z0-9_.-]{1,64}$'"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": SCHEMA, "strict": True}}
WEATHER_PB = pb.Tool(name="get_weather", description="The weather in a city", parameters_json=json.dumps(SCHEMA),
                     strict=True)
USER = {"role": "user", "content": "Weather in Paris?"}
USER_PB = pb.ChatMessage(role="user", content="Weather in Paris?")


def refused(fn, *args) -> str:
    """The message of the INVALID_ARGUMENT RequestError fn(*args) raises."""
    with pytest.raises(RequestError) as e:
        fn(*args)
    assert e.value.code == "invalid_argument", e.value.message
    return e.value.message


def calls(*tool_calls: pb.ToolCall) -> list[pb.ChatMessage]:
    """A user turn, then an assistant turn that made `tool_calls`."""
    return [USER_PB, pb.ChatMessage(role="assistant", tool_calls=tool_calls)]


# ---------------------------------------------------------------------------------------------------- functions
@pytest.mark.parametrize("tools,message", [
    ([pb.Tool(name="")], f"tools.0.name: {PATTERN}"),
    ([WEATHER_PB, pb.Tool(name="bad name!")], f"tools.1.name: {PATTERN}"),
    ([pb.Tool(name="f" * 65)], f"tools.0.name: {PATTERN}"),
    ([WEATHER_PB, pb.Tool(name="f", parameters_json="{not json")], "tools.1.parameters_json: not JSON (Expecting"),
    ([pb.Tool(name="f", parameters_json='["city"]')],
     "tools.0.parameters_json: must be a JSON object (the parameters' JSON schema)"),
    ([pb.Tool(name="f", parameters_json="null")], "tools.0.parameters_json: must be a JSON object"),
    ([pb.Tool(name=f"f{i}") for i in range(MAX_TOOLS + 1)], f"tools: 129 tools, more than the {MAX_TOOLS} a request"),
])
def test_bad_tools_are_refused_naming_the_proto_field(tools, message):
    assert refused(tools_from_proto, tools).startswith(message)


@pytest.mark.parametrize("messages,message", [
    (calls(pb.ToolCall(id="c", arguments="{}")), f"messages.1.tool_calls.0.name: {PATTERN}"),
    (calls(pb.ToolCall(id="c", name="get_weather"), pb.ToolCall(name="get weather")),
     f"messages.1.tool_calls.1.name: {PATTERN}"),
    (calls(pb.ToolCall(id="c", name="get_weather", arguments="{city")),
     "messages.1.tool_calls.0.arguments: not JSON (Expecting"),
    (calls(pb.ToolCall(name="f"), pb.ToolCall(name="f", arguments='["Paris"]')),
     "messages.1.tool_calls.1.arguments: must be a JSON object (the call's arguments)"),
    (calls(*[pb.ToolCall(name="f")] * (MAX_TOOLS + 1)), f"messages.1.tool_calls: 129 calls, more than {MAX_TOOLS}"),
])
def test_bad_tool_calls_are_refused_naming_the_proto_field(messages, message):
    assert refused(messages_from_proto, messages).startswith(message)


def test_the_limits_themselves_are_taken():
    assert len(tools_from_proto([pb.Tool(name=f"f{i}") for i in range(MAX_TOOLS)])) == MAX_TOOLS
    assert len(messages_from_proto(calls(*[pb.ToolCall(name="f")] * MAX_TOOLS))[1].tool_calls) == MAX_TOOLS


@pytest.mark.parametrize("choice,message", [
    (pb.ToolChoice(mode="sometimes"), "tool_choice.mode: 'sometimes': one of none, auto, required"),
    (pb.ToolChoice(mode=""), "tool_choice.mode: '': one of none, auto, required"),
    (pb.ToolChoice(), "tool_choice.mode: '': one of"),  # (set, with neither mode nor function)
    (pb.ToolChoice(function="nope"), "tool_choice.function: 'nope': not one of the tools (get_weather)"),
    (pb.ToolChoice(function=""), "tool_choice.function: '': not one of the tools"),
])
def test_bad_tool_choices_are_refused_naming_the_proto_field(choice, message):
    request = pb.ChatRequest(messages=[USER_PB], tools=[WEATHER_PB])
    request.tool_choice.CopyFrom(choice)
    assert refused(tool_choice_from_proto, request).startswith(message)


@pytest.mark.parametrize("request_,field,message", [
    (pb.ChatRequest(tool_choice=pb.ToolChoice(mode="required")), "tool_choice", "tool_choice=required: needs tools"),
    (pb.ChatRequest(tool_choice=pb.ToolChoice(function="get_weather")), "tool_choice", "needs tools"),
    (pb.ChatRequest(tools=[WEATHER_PB]), "tool_choice", '"auto" tool choice requires --enable-auto-tool-choice'),
    (pb.ChatRequest(tools=[WEATHER_PB, WEATHER_PB], tool_choice=pb.ToolChoice(mode="none")), "tools",
     "tools: function 'get_weather' is given twice"),
    (pb.ChatRequest(tools=[pb.Tool(name="f", parameters_json='{"$defs": []}')],
                    tool_choice=pb.ToolChoice(mode="required")),
     "tools", "tools: f.parameters.$defs must be an object"),
])
def test_the_choice_a_request_cannot_have_is_refused(request_, field, message):
    with pytest.raises(RequestError) as e:
        ChatTools.of(request_, ToolConfig())
    assert (e.value.code, e.value.field) == ("invalid_argument", field) and message in e.value.message


def test_tools_are_the_http_bodys_dumps():
    bare = {"type": "function", "function": {"name": "get_time"}}
    assert tools_from_proto([WEATHER_PB, pb.Tool(name="get_time")]) == [
        ChatTool.model_validate(t).model_dump(exclude_none=True) for t in (WEATHER, bare)]
    assert tools_from_proto([]) is None


def test_messages_are_the_http_bodys_for_the_template():
    loop = [USER, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"type": "function", "function": {"name": "get_time"}}]},  # (no id, no arguments: "{}")
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
            {"role": "tool", "content": "noon"}]  # (no tool_call_id: the HTTP endpoint takes it too)
    proto = [USER_PB, pb.ChatMessage(role="assistant", tool_calls=[
                 pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}'),
                 pb.ToolCall(name="get_time")]),
             pb.ChatMessage(role="tool", tool_call_id="call_1", name="get_weather", content="sunny"),
             pb.ChatMessage(role="tool", content="noon")]
    assert template_messages(messages_from_proto(proto)) == template_messages(
        [ChatMessage.model_validate(m) for m in loop])


def test_tool_choices_are_the_http_bodys():
    request = pb.ChatRequest(tools=[WEATHER_PB])
    assert tool_choice_from_proto(request) is None
    for mode in ("none", "auto", "required"):
        request.tool_choice.mode = mode
        assert tool_choice_from_proto(request) == mode
    request.tool_choice.function = "get_weather"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_choice_from_proto(request) == NamedToolChoice.model_validate(named).model_dump() == named


# ---------------------------------------------------------------------------------------------------- both APIs
def qwen_backend() -> Scripted:
    """The scripted backend with Qwen2.5's chat template, which renders tools, calls and results (its system prompt
    takes ~1000 tokens of the synthetic tokenizer)."""
    backend = Scripted()
    backend.max_model_len = 4096
    backend.tokenizer.chat_template = (Path(__file__).resolve().parent / "chat_templates/qwen2_5.jinja").read_text()
    return backend


async def both(body: dict, request: pb.ChatRequest, backend=None):
    """(the HTTP chat endpoint's response to body, the gRPC Chat's responses to request or its AioRpcError)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    core = RouterCore(backend or Scripted())
    server = await start_grpc_server(core, address)
    try:
        transport = httpx.ASGITransport(app=create_app(core))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c, \
                grpc.aio.insecure_channel(address) as ch:
            r = await c.post("/v1/chat/completions", json={**body, "max_tokens": 3})
            request.params.CopyFrom(common_pb2.SamplingParams(max_tokens=3))
            try:
                return r, [x async for x in generate_pb2_grpc.GenerateStub(ch).Chat(request, timeout=30)]
            except grpc.aio.AioRpcError as e:
                return r, e
    finally:
        await server.stop(0)


NONE, NONE_PB = {"tool_choice": "none"}, {"tool_choice": pb.ToolChoice(mode="none")}
ASSISTANT = {"role": "assistant", "content": ""}


def _call(**function) -> dict:
    return {"id": "c", "type": "function", "function": function}


# (HTTP body, the same request over gRPC, the start of gRPC's details)
REFUSED = {
    "tool-name-empty": ({"tools": [{"type": "function", "function": {"name": ""}}], **NONE},
                        pb.ChatRequest(tools=[pb.Tool(name="")], **NONE_PB), f"tools.0.name: {PATTERN}"),
    "tool-name-pattern": ({"tools": [WEATHER, {"type": "function", "function": {"name": "bad name!"}}], **NONE},
                          pb.ChatRequest(tools=[WEATHER_PB, pb.Tool(name="bad name!")], **NONE_PB),
                          f"tools.1.name: {PATTERN}"),
    "parameters-not-json": ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": "{x"}}],
                             **NONE},
                            pb.ChatRequest(tools=[WEATHER_PB, pb.Tool(name="f", parameters_json="{x")], **NONE_PB),
                            "tools.1.parameters_json: not JSON"),
    "parameters-not-object": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}], **NONE},
                              pb.ChatRequest(tools=[pb.Tool(name="f", parameters_json="[1]")], **NONE_PB),
                              "tools.0.parameters_json: must be a JSON object"),
    "too-many-tools": ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)],
                        **NONE},
                       pb.ChatRequest(tools=[pb.Tool(name=f"f{i}") for i in range(MAX_TOOLS + 1)], **NONE_PB),
                       f"tools: 129 tools, more than the {MAX_TOOLS}"),
    "tool-twice": ({"tools": [WEATHER, WEATHER], **NONE}, pb.ChatRequest(tools=[WEATHER_PB] * 2, **NONE_PB),
                   "tools: function 'get_weather' is given twice"),
    "named-unknown": ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                      pb.ChatRequest(tools=[WEATHER_PB], tool_choice=pb.ToolChoice(function="nope")),
                      "tool_choice.function: 'nope': not one of the tools (get_weather)"),
    "named-pattern": ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "no pe"}}},
                      pb.ChatRequest(tools=[WEATHER_PB], tool_choice=pb.ToolChoice(function="no pe")),
                      "tool_choice.function: 'no pe': not one of the tools"),
    "mode-unknown": ({"tools": [WEATHER], "tool_choice": "sometimes"},
                     pb.ChatRequest(tools=[WEATHER_PB], tool_choice=pb.ToolChoice(mode="sometimes")),
                     "tool_choice.mode: 'sometimes'"),
    "required-without-tools": ({"tool_choice": "required"}, pb.ChatRequest(tool_choice=pb.ToolChoice(mode="required")),
                               "tool_choice=required: needs tools"),
    "named-without-tools": ({"tool_choice": {"type": "function", "function": {"name": "f"}}},
                            pb.ChatRequest(tool_choice=pb.ToolChoice(function="f")), "tool_choice="),
    "auto-without-flags": ({"tools": [WEATHER]}, pb.ChatRequest(tools=[WEATHER_PB]),
                           '"auto" tool choice requires --enable-auto-tool-choice'),
    "call-name-empty": ({"messages": [USER, {**ASSISTANT, "tool_calls": [_call(name="", arguments="{}")]}]},
                        pb.ChatRequest(messages=calls(pb.ToolCall(id="c", arguments="{}"))),
                        f"messages.1.tool_calls.0.name: {PATTERN}"),
    "arguments-not-json": ({"messages": [USER, {**ASSISTANT, "tool_calls": [_call(name="f", arguments="{x")]}]},
                           pb.ChatRequest(messages=calls(pb.ToolCall(id="c", name="f", arguments="{x"))),
                           "messages.1.tool_calls.0.arguments: not JSON"),
    "arguments-not-object": ({"messages": [USER, {**ASSISTANT, "tool_calls": [_call(name="f", arguments="[1]")]}]},
                             pb.ChatRequest(messages=calls(pb.ToolCall(id="c", name="f", arguments="[1]"))),
                             "messages.1.tool_calls.0.arguments: must be a JSON object"),
    "too-many-calls": ({"messages": [USER, {**ASSISTANT, "tool_calls": [_call(name="f")] * (MAX_TOOLS + 1)}]},
                       pb.ChatRequest(messages=calls(*[pb.ToolCall(id="c", name="f")] * (MAX_TOOLS + 1))),
                       f"messages.1.tool_calls: 129 calls, more than {MAX_TOOLS}"),
    "no-messages": ({"messages": []}, pb.ChatRequest(messages=[]), "messages: must not be empty"),
    "template-kwargs-not-object": ({"chat_template_kwargs": [1]}, pb.ChatRequest(chat_template_kwargs_json="[1]"),
                                   "chat_template_kwargs_json: must be a JSON object"),
}


# The HTTP error's param where it is not the top field the gRPC details name.
HTTP_PARAM = {"auto-without-flags": "tool_choice", "template-kwargs-not-object": "chat_template_kwargs"}


@pytest.mark.parametrize("case", REFUSED)
def test_what_http_refuses_grpc_refuses_naming_the_proto_field(case):
    body, request_, details = REFUSED[case]
    if "messages" not in body:
        body, request_ = {"messages": [USER], **body}, pb.ChatRequest(messages=[USER_PB])
        request_.MergeFrom(REFUSED[case][1])
    r, e = asyncio.run(both(body, request_))
    assert r.status_code == 400, r.text
    assert isinstance(e, grpc.aio.AioRpcError), e
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith(details), e.details()
    top = details.split(":")[0].split(".")[0].split("=")[0]
    assert r.json()["error"]["param"] == HTTP_PARAM.get(case, top), r.json()


def test_a_tool_loop_runs_the_http_prompt_over_grpc():
    """Tools, calls (one without arguments) and a result without tool_call_id: taken by both, the same prompt."""
    body = {"messages": [USER, {**ASSISTANT, "tool_calls": [_call(name="get_weather", arguments='{"city": "Paris"}'),
                                                            {"type": "function", "function": {"name": "get_time"}}]},
                         {"role": "tool", "content": "sunny"}],
            "tools": [WEATHER, {"type": "function", "function": {"name": "get_time"}}], **NONE,
            "return_token_ids": True}
    request = pb.ChatRequest(messages=[*calls(pb.ToolCall(id="c", name="get_weather", arguments='{"city": "Paris"}'),
                                              pb.ToolCall(name="get_time")),
                                       pb.ChatMessage(role="tool", content="sunny")],
                             tools=[WEATHER_PB, pb.Tool(name="get_time")], **NONE_PB, return_prompt_token_ids=True)
    backend = qwen_backend()
    r, responses = asyncio.run(both(body, request, backend))
    assert r.status_code == 200, r.text
    assert "".join(x.delta.text for x in responses) == r.json()["choices"][0]["message"]["content"] == "abc"
    assert list(responses[0].prompt_token_ids) == r.json()["prompt_token_ids"]
    prompt = backend.tokenizer.decode(r.json()["prompt_token_ids"])
    assert '"name": "get_weather", "description": "The weather in a city"' in prompt and '"strict": true' in prompt
    assert '{"name": "get_time", "arguments": {}}' in prompt and "<tool_response>\nsunny" in prompt
