"""The gRPC Chat RPC's request as the HTTP chat endpoint reads its body, and its tool calls back into protobuf.

A ChatRequest's messages and tools are validated by the same models as an HTTP body's (router/openai_protocol.py:
ChatMessage, ChatTool), so that a message or a tool the HTTP API refuses is refused here too, naming the field as
the proto spells it (`tools.0.name`, `messages.2.tool_calls.0.arguments`). They then go through the same chat
template code (router/chat_template.py) and the same tool-choice rules and grammar (router/tool_calls.py): the same
messages, tools and seed give the same tokens and the same calls on both APIs.

The proto's empty strings are OpenAI's absent fields (proto3 has no null for a plain string): an empty
tool_call_id or name is not sent to the template, as the HTTP endpoint leaves out a field the client left out; empty
arguments are the HTTP body's default, "{}".
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import ValidationError

from protos.tandem.v1 import generate_pb2
from router.core import RequestError
from router.openai_protocol import MAX_TOOLS, ChatMessage, ChatTool
from router.tool_calls import CallStream, ToolChoice, ToolChoiceError, ToolConfig

_MODES = ("none", "auto", "required")


def _invalid(field: str, message: str) -> RequestError:
    return RequestError("invalid_argument", field.split(".")[0], f"{field}: {message}")


def _json_object(text: str, field: str, what: str) -> dict:
    """text, which `field` holds, as the JSON object it must be (`what`: which object, for the message)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise _invalid(field, f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise _invalid(field, f"must be a JSON object ({what})")
    return value


def _validated(model, value: dict, where: str, renames: dict[str, str] | None = None):
    """value through the pydantic model; its first error as INVALID_ARGUMENT naming `where` and the proto field."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(part) for part in err["loc"])
        for openai_name, proto_name in (renames or {}).items():
            loc = loc.replace(openai_name, proto_name)
        raise _invalid(f"{where}.{loc}" if loc else where, err["msg"]) from None


def messages_from_proto(messages) -> list[ChatMessage]:
    """ChatRequest.messages as the HTTP endpoint's ChatMessage models (checked the same way)."""
    out = []
    for i, m in enumerate(messages):
        if len(m.tool_calls) > MAX_TOOLS:
            raise _invalid(f"messages.{i}.tool_calls", f"{len(m.tool_calls)} calls, more than {MAX_TOOLS}")
        value: dict = {"role": m.role, "content": m.content}
        if m.tool_calls:
            # (arguments decoded here, so that bad ones are named as the proto spells them; empty: "{}", as HTTP's
            # default)
            value["tool_calls"] = [{"id": c.id or None, "type": "function", "function": {
                "name": c.name, "arguments": _json_object(c.arguments or "{}", f"messages.{i}.tool_calls.{j}.arguments",
                                                          "the call's arguments")}}
                                   for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id:
            value["tool_call_id"] = m.tool_call_id
        if m.name:
            value["name"] = m.name
        out.append(_validated(ChatMessage, value, f"messages.{i}",
                              {"function.name": "name", "function.arguments": "arguments"}))
    return out


def tools_from_proto(tools) -> list[dict] | None:
    """ChatRequest.tools as OpenAI's tool dicts ({"type": "function", "function": {...}}); None without tools."""
    if len(tools) > MAX_TOOLS:
        raise _invalid("tools", f"{len(tools)} tools, more than the {MAX_TOOLS} a request may give")
    out = []
    for i, t in enumerate(tools):
        fn: dict = {"name": t.name}
        if t.description:
            fn["description"] = t.description
        if t.parameters_json:
            fn["parameters"] = _json_object(t.parameters_json, f"tools.{i}.parameters_json",
                                            "the parameters' JSON schema")
        if t.strict:
            fn["strict"] = True
        tool = _validated(ChatTool, {"type": "function", "function": fn}, f"tools.{i}",
                          {"function.parameters": "parameters_json", "function.": ""})
        out.append(tool.model_dump(exclude_none=True))
    return out or None


def tool_choice_from_proto(request: generate_pb2.ChatRequest) -> str | dict | None:
    """ChatRequest.tool_choice as OpenAI's value: a mode, {"type": "function", "function": {"name"}}, or None."""
    if not request.HasField("tool_choice"):
        return None
    which = request.tool_choice.WhichOneof("choice")
    if which == "function":
        name = request.tool_choice.function
        if request.tools and name not in (names := [t.name for t in request.tools]):
            raise _invalid("tool_choice.function", f"{name!r}: not one of the tools ({', '.join(names)})")
        return {"type": "function", "function": {"name": name}}
    mode = request.tool_choice.mode if which == "mode" else ""
    if mode not in _MODES:
        raise _invalid("tool_choice.mode", f"{mode!r}: one of {', '.join(_MODES)} (or set tool_choice.function)")
    return mode


@dataclass(frozen=True)
class ChatTools:
    """A Chat request's tools as the template and the tool-call streams take them."""
    tools: list[dict] | None
    choice: ToolChoice

    @classmethod
    def of(cls, request: generate_pb2.ChatRequest, config: ToolConfig) -> "ChatTools":
        tools = tools_from_proto(request.tools)
        parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
        try:
            return cls(tools, ToolChoice.of(tools, tool_choice_from_proto(request), parallel, config))
        except ToolChoiceError as e:
            raise RequestError("invalid_argument", e.field, str(e)) from None


class ProtoCalls:
    """Each completion's output through its tool-call stream (router/tool_calls.py), as GenerateResponse fields."""

    def __init__(self, choice: ToolChoice):
        self.choice = choice
        self.streams: dict[int, CallStream] = {}

    def add(self, response: generate_pb2.GenerateResponse, text: str, finish: str | None) -> str | None:
        """Sets response.content and response.tool_calls for completion response.index's next text; returns the
        finish reason to send ("tool_calls" where "stop" ended a completion that made calls)."""
        if (stream := self.streams.get(response.index)) is None:
            if (stream := self.choice.stream()) is None:
                return finish
            self.streams[response.index] = stream
        content, entries = stream.feed(text, final=finish is not None)
        response.content = content
        for e in entries:
            fn = e["function"]
            response.tool_calls.add(index=e["index"], id=e.get("id", ""), name=fn.get("name", ""),
                                    arguments=fn["arguments"])
        if finish is not None:
            del self.streams[response.index]
        return stream.finish_reason(finish)
