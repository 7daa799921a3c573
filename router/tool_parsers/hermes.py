"""Hermes' format, which Qwen2.5 and Qwen3 use too: each call is `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`, with content before, between or after the calls.

Outside a block, text is content, except a tail that could be the start of `<tool_call>` (held until the next
delta). Inside one, the body grows until it holds one whole JSON object; that object, if it names a function, is a
call (`arguments` or `parameters`); text after it up to `</tool_call>` is dropped. A block whose body is no such
object by `</tool_call>` (or by the end of the output) goes out as content, tags and all. An unclosed block that
holds a whole call at the end counts (vLLM's parser accepts it too: the model may stop on its end-of-turn token
right after the JSON).
"""
from __future__ import annotations

from router.tool_parsers.base import Event, ToolParser, call_from_object, decode_object, held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def __init__(self) -> None:
        self.buf = ""  # content not yet sent, or the open block's body
        self.in_call = False
        self.done = False  # the open block's call was sent: the rest of the body is dropped

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while True:
            if not self.in_call:
                at = self.buf.find(OPEN)
                if at < 0:
                    keep = held_back(self.buf, OPEN)
                    if len(self.buf) > keep:
                        out.append(self.buf[:len(self.buf) - keep])
                        self.buf = self.buf[len(self.buf) - keep:]
                    return out
                if at:
                    out.append(self.buf[:at])
                self.buf, self.in_call, self.done = self.buf[at + len(OPEN):], True, False
                continue
            end = self.buf.find(CLOSE)
            if not self.done:
                call = self._call(self.buf if end < 0 else self.buf[:end])
                if call is not None:
                    out.append(call)
                    self.done = True
                elif end >= 0:  # closed without a call in it: it was text
                    out.append(OPEN + self.buf[:end + len(CLOSE)])
            if end < 0:
                return out
            self.buf, self.in_call = self.buf[end + len(CLOSE):], False

    @staticmethod
    def _call(body: str):
        start = len(body) - len(body.lstrip())
        if start == len(body) or body[start] != "{":
            return None
        decoded = decode_object(body, start)
        return None if decoded is None else call_from_object(decoded[0])

    def finish(self) -> list[Event]:
        buf, self.buf = self.buf, ""
        if not self.in_call:
            return [buf] if buf else []
        return [] if self.done else [OPEN + buf]
