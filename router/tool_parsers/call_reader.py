"""Reads one call object, `{"name": ..., "arguments": {...}}`, as its text comes, so that its arguments stream.

A call streams when its object opens with the name, then the arguments object: `{"name": "f", "arguments": {`
(or `"parameters"`; whitespace wherever JSON allows it), the order in which Hermes, Qwen and Llama 3 write calls and
in which the `tool_choice: required` grammar makes them. That prefix makes the call certain: `call_head` finds it,
the call goes out with its name, and an `ArgumentsReader` passes the arguments on as the model writes them, raw:
the fragments put together are the arguments' JSON text exactly as generated (OpenAI's `function.arguments`).
Any other object (another key first, arguments that are no object) is no streaming call; its parser reads it whole.

Once out, a call stays one: arguments cut short (max_tokens) or broken keep the text they had, the same however the
output was split, so a streamed answer and a gathered one agree.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from router.tool_parsers.base import Arguments, Event

WAIT = "wait"
"""call_head's answer while the text so far could still become a streaming call's head."""

_WS = " \t\r\n"
_NAME, _KEY = object(), object()
_HEAD = ("{", '"name"', ":", _NAME, ",", _KEY, ":")


@dataclass(frozen=True)
class Head:
    """A streaming call's head: the function's name, and where its arguments object starts (at its `{`)."""
    name: str
    arguments_at: int


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _literal(text: str, i: int, literal: str) -> int | str | None:
    got = text[i:i + len(literal)]
    if got == literal:
        return i + len(literal)
    return WAIT if len(got) < len(literal) and literal.startswith(got) else None


def _string_end(text: str, i: int) -> int | str:
    """Where the JSON string that opens at text[i] ends (after its quote), or WAIT while it is open."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return WAIT


def call_head(text: str, start: int) -> Head | str | None:
    """The head of a streaming call whose object starts at text[start] (leading whitespace allowed), WAIT while the
    text could still become one, None when it cannot (its parser reads the object whole)."""
    i, name = start, None
    for part in _HEAD:
        i = _skip(text, i)
        if i == len(text):
            return WAIT
        if part is _NAME:
            if text[i] != '"':
                return None
            end = _string_end(text, i)
            if end is WAIT:
                return WAIT
            try:
                name = json.loads(text[i:end])
            except ValueError:  # a bad escape or a raw control character: no JSON string
                return None
            if not name:
                return None
            i = end
            continue
        literal = ('"arguments"' if text.startswith('"a', i) else '"parameters"') if part is _KEY else part
        i = _literal(text, i, literal)
        if not isinstance(i, int):
            return i
    i = _skip(text, i)
    if i == len(text):
        return WAIT
    return Head(name, i) if text[i] == "{" else None


class ArgumentsReader:
    """The rest of a streaming call's object, from its arguments' `{`: the arguments' text, then whatever else the
    object holds (dropped) up to its closing `}`.

    stop: a marker that ends the object where it stands outside a JSON string (Hermes' `</tool_call>`: a model
    may close the block before the object); a tail that may be its start is left unread until the next text."""

    def __init__(self, stop: str | None = None):
        self.stop = stop
        self.phase = "arguments"  # then "after" (between them and `,` or `}`), "rest" (more members)
        self.depth = 0  # brackets open in the current phase
        self.in_string = self.escaped = False

    def feed(self, text: str) -> tuple[str, int, bool]:
        """(arguments text, characters read, ended) for the next text. text[read:] is unread: fed again with what
        follows when not ended, what follows the call object when ended."""
        i, n, arguments_end = 0, len(text), None
        started_in_arguments = self.phase == "arguments"
        ended = False
        while i < n:
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                i += 1
                continue
            if self.stop is not None and ch == self.stop[0]:
                if text.startswith(self.stop, i):
                    ended = True
                    break
                if self.stop.startswith(text[i:]):
                    break  # maybe the marker: decided by the next text
            if self.phase == "after":
                if ch in _WS:
                    i += 1
                    continue
                if ch == ",":
                    self.phase, self.depth = "rest", 0
                    i += 1
                    continue
                ended = True
                i += ch == "}"  # anything else ends the object too, and stays unread
                break
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                if self.phase == "rest" and self.depth == 0:
                    ended, i = True, i + 1
                    break
                self.depth -= 1
                if self.phase == "arguments" and self.depth == 0:
                    self.phase, arguments_end = "after", i + 1
            i += 1
        if not started_in_arguments:
            return "", i, ended
        return text[:i if arguments_end is None else arguments_end], i, ended

    def emit(self, text: str, out: list[Event]) -> tuple[str, bool]:
        """feed, for a parser: the arguments text goes onto out as one Arguments event (none when there is none);
        returns (the unread rest of text, ended)."""
        piece, read, ended = self.feed(text)
        if piece:
            out.append(Arguments(piece))
        return text[read:], ended
