"""Llama 3.1/3.2's JSON format (`--tool-call-parser llama3_json`): the whole reply is the call(s), optionally behind
`<|python_tag|>`: `{"name": ..., "parameters": {...}}`, several separated by `;`.

As vLLM's parser: a reply that starts (after whitespace) with `{` or `<|python_tag|>` is calls; any other reply is
content. In calls, an object that opens as a streaming call (`{"name": "f", "parameters": {`: call_reader.py) is
that call at once, its arguments streamed to the end of its object; any other whole JSON object that names a
function is a call (`parameters` or `arguments`). The first text that is neither (or an object that is incomplete
at the end) ends the calls, and it and the rest are content.
`<|python_tag|>` is a special token: it reaches the text only when special tokens are not skipped.
"""
from __future__ import annotations

from router.tool_parsers.base import Event, ToolCall, ToolParser, call_from_object, decode_object
from router.tool_parsers.call_reader import WAIT, ArgumentsReader, Head, call_head

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def __init__(self) -> None:
        self.buf = ""
        self.mode = "start"  # "start" (undecided), "calls", "arguments" (a streaming call's object), "content"
        self.reader: ArgumentsReader | None = None

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        if self.mode == "start":
            head = self.buf.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return out  # undecided yet
            if head.startswith(PYTHON_TAG):
                self.buf, self.mode = head[len(PYTHON_TAG):], "calls"
            elif head.startswith("{"):
                self.buf, self.mode = head, "calls"
            else:
                self.mode = "content"
        if self.mode == "content":
            out.append(self.buf)
            self.buf = ""
            return out
        while True:
            if self.mode == "arguments":
                self.buf, ended = self.reader.emit(self.buf, out)
                if not ended:
                    return out
                self.mode = "calls"
            start = len(self.buf) - len(self.buf.lstrip(_SEPARATORS))
            if start == len(self.buf):
                return out
            if self.buf[start] != "{":
                self.mode = "content"
                out.append(self.buf[start:])
                self.buf = ""
                return out
            head = call_head(self.buf, start)
            if isinstance(head, Head):
                out.append(ToolCall(head.name, ""))
                self.buf, self.mode, self.reader = self.buf[head.arguments_at:], "arguments", ArgumentsReader()
                continue
            if head is WAIT:
                return out
            decoded = decode_object(self.buf, start)
            if decoded is None:
                return out  # incomplete so far
            call = call_from_object(decoded[0])
            if call is None:
                self.mode = "content"
                out.append(self.buf[start:])
                self.buf = ""
                return out
            out.append(call)
            self.buf = self.buf[decoded[1]:]

    def finish(self) -> list[Event]:
        buf, self.buf = self.buf, ""
        if self.mode == "calls":
            buf = buf.lstrip(_SEPARATORS)
        return [buf] if buf else []
