"""What a tool-call parser turns model text into, and the incremental interface every format implements.

A parser sees the output text one delta at a time (`feed`) and answers with events: content text, a tool call, or
more arguments text for the call before. A call goes out once the text makes it certain, never guessed: a call
object that opens with its name and then its arguments object goes out there, its arguments following as they are
generated (router/tool_parsers/call_reader.py); any other goes out whole, once its JSON is. So nothing sent has to
be taken back: text that turns out not to be a call (a malformed block, an object without a name) goes out as
content instead. Gathering (non-streaming) runs the same parser over the whole text (`parse`), so a streamed answer
and a gathered one always carry the same content and the same calls, however the text was split.
"""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One function call the model made: `arguments` is JSON text (OpenAI's `function.arguments`)."""
    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or tool_call_id()


@dataclass
class Arguments:
    """More of the last call's arguments text (it went out before its arguments were whole)."""
    text: str


Event = str | ToolCall | Arguments
"""A parser's output: content text, a call (its arguments whole, or so far), or more of the last call's arguments."""


def arguments_text(value) -> str:
    """A call's arguments as OpenAI sends them: JSON text (already text: as it is)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def call_from_object(obj, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """The call a decoded JSON value describes ({"name": ..., "arguments" or "parameters": ...}), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in arguments_keys if k in obj), {})
    if not isinstance(args, (dict, str)):
        return None
    return ToolCall(obj["name"], arguments_text(args))


_DECODER = json.JSONDecoder()


def decode_object(text: str, start: int) -> tuple[object, int] | None:
    """The JSON value starting at text[start] and where it ends, or None while it is incomplete or invalid."""
    try:
        return _DECODER.raw_decode(text, start)
    except json.JSONDecodeError:
        return None


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of text could be the start of marker (kept until the next delta decides)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolParser(ABC):
    """One output's parser (one per choice): feed it the deltas in order, then finish it."""

    name: str

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """Events the text so far makes certain."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """Events for what was held back, at the end of the output."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole output's content and calls."""
        content, calls = [], []
        for e in self.feed(text) + self.finish():
            if isinstance(e, str):
                content.append(e)
            elif isinstance(e, Arguments):
                calls[-1].arguments += e.text
            else:
                calls.append(e)
        return "".join(content), calls
