"""Hermes' format, which Qwen2.5 and Qwen3 use too: each call is `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`, with content before, between or after the calls.

Outside a block, text is content, except a tail that could be the start of `<tool_call>` (held until the next
delta). Inside one, a body that opens as a streaming call (`{"name": "f", "arguments": {`: call_reader.py) is that
call at once, its arguments streamed up to the end of its object (a `</tool_call>` inside one of its strings is
text of the string; one outside them ends the block, the arguments as they were). Any other body grows until it
holds one whole JSON object; that object, if it names a function, is a call (`arguments` or `parameters`). Text
after a call up to `</tool_call>` is dropped. A block whose body is no call by `</tool_call>` (or by the end of
the output) goes out as content, tags and all. An unclosed block that holds a call at the end counts (vLLM's
parser accepts it too: the model may stop on its end-of-turn token right after the JSON).
"""
from __future__ import annotations

from router.tool_parsers.base import Event, ToolCall, ToolParser, call_from_object, decode_object, held_back
from router.tool_parsers.call_reader import WAIT, ArgumentsReader, Head, call_head

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def __init__(self) -> None:
        self.buf = ""  # content not yet sent, or what of the open block is not read yet
        # "text": content; "body": a block's body, no call in it yet; "arguments": a streaming call's object;
        # "after": the block after its call (dropped up to </tool_call>)
        self.state = "text"
        self.reader: ArgumentsReader | None = None

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while True:
            if self.state == "text":
                at = self.buf.find(OPEN)
                if at < 0:
                    keep = held_back(self.buf, OPEN)
                    if len(self.buf) > keep:
                        out.append(self.buf[:len(self.buf) - keep])
                        self.buf = self.buf[len(self.buf) - keep:]
                    return out
                if at:
                    out.append(self.buf[:at])
                self.buf, self.state = self.buf[at + len(OPEN):], "body"
            elif self.state == "body":
                end = self.buf.find(CLOSE)
                body = self.buf if end < 0 else self.buf[:end]
                head = call_head(body, 0)
                if isinstance(head, Head):
                    out.append(ToolCall(head.name, ""))
                    self.buf, self.state = self.buf[head.arguments_at:], "arguments"
                    self.reader = ArgumentsReader(stop=CLOSE)
                    continue
                if head is WAIT and end < 0:
                    return out
                call = self._call(body)
                if call is not None:
                    out.append(call)
                    self.state = "after"
                elif end < 0:
                    return out
                else:  # closed without a call in it: it was text
                    out.append(OPEN + self.buf[:end + len(CLOSE)])
                    self.buf, self.state = self.buf[end + len(CLOSE):], "text"
            elif self.state == "arguments":
                self.buf, ended = self.reader.emit(self.buf, out)
                if not ended:
                    return out
                self.state = "after"
            else:  # "after"
                end = self.buf.find(CLOSE)
                if end < 0:
                    self.buf = self.buf[len(self.buf) - held_back(self.buf, CLOSE):]
                    return out
                self.buf, self.state = self.buf[end + len(CLOSE):], "text"

    @staticmethod
    def _call(body: str):
        start = len(body) - len(body.lstrip())
        if start == len(body) or body[start] != "{":
            return None
        decoded = decode_object(body, start)
        return None if decoded is None else call_from_object(decoded[0])

    def finish(self) -> list[Event]:
        buf, self.buf = self.buf, ""
        if self.state == "text":
            return [buf] if buf else []
        return [OPEN + buf] if self.state == "body" else []  # (a call's block: the rest is dropped)
