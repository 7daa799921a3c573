"""Tool calling on the chat endpoint: which tool choice a request makes, the grammar that enforces `required` and a
named choice, and the per-choice stream that turns output text into content and OpenAI tool calls.

The life of a chat request with `tools`:
1. `ToolChoice.of(body, config)` settles the choice: none (tools rendered, output is content), auto (the
   `--tool-call-parser` reads calls from the text; needs `--enable-auto-tool-choice`, as vLLM), required or a named
   function (`tool_choice_constraint`: a JSON schema the structured-outputs grammar holds the output to, vLLM's:
   an array of {name, parameters} for required, the function's parameters for a named one).
2. The messages go to the chat template with the tools (router/openai_serving.py: `chat_prompt_ids`); assistant
   turns with `tool_calls` carry their arguments decoded, as the templates of Qwen2.5 and Llama 3.1 expect.
3. Each choice's deltas go through a `CallStream`: content goes out as content; a call as a first delta entry
   (index, id, type, name, arguments "") as soon as its name is certain, then entries of its index and more
   arguments text as the model writes them (OpenAI's and vLLM's streaming), which the SDK appends. The gathered
   answer runs the same stream over the whole text, so both carry the same calls, arguments to the character.
   finish_reason "stop" becomes "tool_calls" when calls were made; `parallel_tool_calls: false` keeps the first
   call only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from router.tool_parsers import PARSERS, ToolCall, ToolParser
from router.tool_parsers.base import Arguments, Event, arguments_text, decode_object
from router.tool_parsers.call_reader import WAIT, ArgumentsReader, Head, call_head
from engine.sampling_params import StructuredOutputsParams

AUTO_FLAGS = "--enable-auto-tool-choice and --tool-call-parser"


class ToolChoiceError(ValueError):
    """A tool choice this request or this server cannot have; `field` names the request field."""

    def __init__(self, field_name: str, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.field, self.code = field_name, code


@dataclass(frozen=True)
class ToolConfig:
    """The router's tool-calling flags (vLLM's names)."""
    tool_call_parser: str | None = None
    """How `tool_choice: auto` reads calls from the model's text: hermes (Hermes, Qwen2.5, Qwen3) or llama3_json
    (Llama 3.1/3.2)."""
    enable_auto_tool_choice: bool = False
    """Let the model decide whether to call a tool (`tool_choice: auto`, the default when `tools` are given)."""

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser={self.tool_call_parser!r}: one of {', '.join(PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice: needs --tool-call-parser (which format the model's calls have)")


def tool_choice_constraint(tools: list[dict], choice: str | dict, parallel: bool = True) -> dict | None:
    """The JSON schema that holds the output to the call(s) `choice` asks for (None: no constraint).

    tools: OpenAI's [{"type": "function", "function": {"name", "parameters", ...}}]; choice: "none", "auto",
    "required" or {"type": "function", "function": {"name": ...}}. Required: an array of at least one (at most one
    without parallel calls) {"name": <one of the tools>, "parameters": <its schema>}; the tools' `$defs` are merged at
    the top, where their `$ref`s point. Named: that function's parameters (an object without them)."""
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in functions:
            raise ToolChoiceError("tool_choice", f"tool_choice: function {name!r} is not one of the tools "
                                                 f"({', '.join(functions)})")
        return functions[name].get("parameters") or {"type": "object", "properties": {}}
    if choice != "required":
        return None
    defs: dict = {}
    for name, fn in functions.items():
        fn_defs = (fn.get("parameters") or {}).get("$defs", {})
        if not isinstance(fn_defs, dict):
            raise ToolChoiceError("tools", f"tools: {name}.parameters.$defs must be an object of schemas")
        for key, schema in fn_defs.items():
            if key in defs and defs[key] != schema:
                raise ToolChoiceError("tools", f"tools: $defs.{key} is defined differently by two tools; "
                                               "tool_choice=required needs one definition of each")
            defs[key] = schema
    items = [{"properties": {"name": {"type": "string", "enum": [name]},
                             "parameters": fn.get("parameters") or {"type": "object", "properties": {}}},
              "required": ["name", "parameters"]} for name, fn in functions.items()]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def constrained(params, schema: dict, choice) -> object:
    """params with the structured-outputs grammar `schema` (engine.sampling_params.StructuredOutputsParams)."""
    if params.structured_outputs is not None:
        raise ToolChoiceError("tool_choice", f"tool_choice={_shown(choice)}: constrains the output already; leave "
                                             "response_format (or structured_outputs) out")
    # Compact JSON (no free whitespace between tokens): a call's arguments need none, and a weak model could
    # otherwise spend max_tokens on whitespace and end mid-call.
    return replace(params, structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))


def _shown(choice) -> str:
    return choice if isinstance(choice, str) else json.dumps(choice)


@dataclass(frozen=True)
class ToolChoice:
    """What one request's tools and tool_choice settle to."""
    mode: str  # "none", "auto", "required", "named"
    name: str | None = None  # mode "named": the function
    parser: str | None = None  # mode "auto": the format
    parallel: bool = True
    schema: dict | None = None  # modes "required" and "named": the output's grammar

    @classmethod
    def of(cls, tools: list[dict] | None, choice, parallel: bool, config: ToolConfig) -> "ToolChoice":
        """tools, tool_choice and parallel_tool_calls as the request gives them (tools: plain dicts)."""
        if not tools:
            if choice not in (None, "none"):
                raise ToolChoiceError("tool_choice", f"tool_choice={_shown(choice)}: needs tools")
            return cls("none", parallel=parallel)
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) < len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ToolChoiceError("tools", f"tools: function {twice!r} is given twice; names must be unique")
        if choice is None:
            choice = "auto"  # OpenAI's default when tools are given
        if choice == "none":
            return cls("none", parallel=parallel)
        if choice == "auto":
            if not config.enable_auto_tool_choice:
                raise ToolChoiceError("tool_choice", f'"auto" tool choice requires {AUTO_FLAGS} to be set on the '
                                                     "server (tool_choice=auto is the default when tools are given; "
                                                     "send tool_choice none, required or a named function otherwise)",
                                      "unsupported")
            return cls("auto", parser=config.tool_call_parser, parallel=parallel)
        schema = tool_choice_constraint(tools, choice, parallel)
        if isinstance(choice, dict):
            return cls("named", name=choice["function"]["name"], parallel=parallel, schema=schema)
        return cls("required", parallel=parallel, schema=schema)

    def stream(self) -> "CallStream | None":
        """A fresh per-choice stream (None: the output is content)."""
        if self.mode == "auto":
            return CallStream(PARSERS[self.parser](), self.parallel)
        if self.mode == "named":
            return CallStream(_NamedCall(self.name), self.parallel)
        if self.mode == "required":
            return CallStream(_CallArray(), self.parallel)
        return None


# ---------------------------------------------------------------------------------------------------- streams
class _NamedCall(ToolParser):
    """A named tool choice: the grammar makes the whole output the function's arguments. Its call goes out at once,
    its arguments as they come (they are the raw text)."""
    name = "named"

    def __init__(self, function: str):
        self.call: ToolCall | None = ToolCall(function, "")

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self.call is not None:
            out.append(self.call)
            self.call = None
        if text:
            out.append(Arguments(text))
        return out

    def finish(self) -> list[Event]:
        return self.feed("")


class _CallArray(ToolParser):
    """tool_choice=required: the grammar makes the output a JSON array of {"name", "parameters"}, in that order, so
    each element streams (router/tool_parsers/call_reader.py): the call goes out with its name, its arguments as
    they come. An element in another form is a call once it is whole. An output cut short before any call
    (max_tokens) is content."""
    name = "required"

    def __init__(self) -> None:
        self.buf, self.opened, self.broken = "", False, False
        self.raw, self.found = "", False  # the whole output (content, when it holds no call at all)
        self.reader: ArgumentsReader | None = None  # the element streaming now

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        self.raw += text
        out: list[Event] = []
        while not self.broken:
            if self.reader is not None:
                self.buf, ended = self.reader.emit(self.buf, out)
                if not ended:
                    break
                self.reader = None
            start = len(self.buf) - len(self.buf.lstrip(" \t\r\n,"))
            if start == len(self.buf):
                break
            if not self.opened:
                if self.buf[start] != "[":
                    self.broken = True
                    break
                self.opened, self.buf = True, self.buf[start + 1:]
                continue
            if self.buf[start] == "]":
                self.buf = self.buf[start + 1:]
                self.broken = True  # (nothing may follow)
                break
            head = call_head(self.buf, start)
            if isinstance(head, Head):
                out.append(ToolCall(head.name, ""))
                self.buf, self.reader, self.found = self.buf[head.arguments_at:], ArgumentsReader(), True
                continue
            if head is WAIT:
                break
            decoded = decode_object(self.buf, start)
            if decoded is None:
                break
            obj, end = decoded
            if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
                self.broken = True
                break
            out.append(ToolCall(obj["name"], arguments_text(obj.get("parameters", {}))))
            self.buf, self.found = self.buf[end:], True
        return out

    def finish(self) -> list[Event]:
        buf = (self.buf if self.found else self.raw).strip()
        self.buf = ""
        return [buf] if buf else []


@dataclass
class CallStream:
    """One choice's output through a parser: what each delta adds as OpenAI delta content and tool_calls. A call's
    first entry has its index, id, type and name, its arguments "" (OpenAI's and vLLM's first delta of a call); the
    entries after it, the index and more arguments text, which the client appends (the openai SDK's assembly)."""
    parser: ToolParser
    parallel: bool = True
    calls: list[ToolCall] = field(default_factory=list)
    dropped: bool = False  # parallel_tool_calls=false dropped a call after the first

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """(content, tool_calls delta entries) for the next text of the output; final: it is the last. A call's
        first entry and its arguments are two entries of one index (`chunked` puts them in two chunks)."""
        events = self.parser.feed(text) + (self.parser.finish() if final else [])
        content, entries = [], []
        for e in events:
            if isinstance(e, str):
                content.append(e)
            elif isinstance(e, Arguments):
                if not self.dropped:  # (a dropped call's arguments: every call after the first is dropped)
                    self.calls[-1].arguments += e.text
                    self._arguments(entries, len(self.calls) - 1, e.text)
            elif not self.parallel and self.calls:
                self.dropped = True
            else:
                self.calls.append(e)
                entries.append({"index": len(self.calls) - 1, "id": e.id, "type": "function",
                                "function": {"name": e.name, "arguments": ""}})
                self._arguments(entries, len(self.calls) - 1, e.arguments)  # (a call read whole: all of them)
        return "".join(content), entries

    @staticmethod
    def _arguments(entries: list[dict], index: int, text: str) -> None:
        if not text:
            return
        if entries and entries[-1]["index"] == index and "id" not in entries[-1]:
            entries[-1]["function"]["arguments"] += text
        else:
            entries.append({"index": index, "function": {"arguments": text}})

    @staticmethod
    def chunked(entries: list[dict]) -> list[list[dict]]:
        """The entries of one delta as the tool_calls of consecutive chunks: a call's first entry ends its chunk
        when more entries follow, so that no chunk holds two entries of one index."""
        groups: list[list[dict]] = [[]]
        for entry in entries:
            if groups[-1] and "id" in groups[-1][-1]:
                groups.append([])
            groups[-1].append(entry)
        return groups

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.calls else reason
