"""router/tool_parsers: each format's calls and content, whole and split across arbitrary delta boundaries; a call
that opens with its name and then its arguments object goes out at once and its arguments stream."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.tool_parsers import PARSERS
from router.tool_parsers.base import Arguments, ToolCall
from router.tool_parsers.call_reader import WAIT, Head, call_head
from router.tool_parsers.hermes import HermesParser
from router.tool_parsers.llama3_json import Llama3JsonParser


def calls(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed[1]]


def split_parse(parser_cls, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    """The text fed in pieces cut at `cuts`: (content, [(name, arguments)])."""
    parser, events, last = parser_cls(), [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    events += parser.finish()
    return merged(events)


def merged(events) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of a parser's events, each Arguments appended to the call before it."""
    content, found = "", []
    for e in events:
        if isinstance(e, str):
            content += e
        elif isinstance(e, Arguments):
            assert found, "arguments before any call"
            found[-1] = (found[-1][0], found[-1][1] + e.text)
        else:
            found.append((e.name, e.arguments))
    return content, found


def whole(parser_cls, text: str):
    content, found = parser_cls().parse(text)
    return content, [(c.name, c.arguments) for c in found]


HERMES = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": [1, "}"]}}'
    '</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"s": "</tool_call> inside"}}\n</tool_call>',  # the tag in a string
    '<tool_call>not json</tool_call> then text',
    '<tool_call>{"name": "f", "arguments": {"a": 1}}',  # unclosed: the model stopped on its end of turn
    '<tool_call>{"name": "f", "argu',  # cut short: content
    'a < b and <tool_ca is not a tag',
    '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name: content
    '你好 <tool_call>{"name": "f", "parameters": {"q": "é"}}</tool_call> after',
]


def test_hermes_calls_and_content():
    content, found = HermesParser().parse(HERMES[0])
    assert content == "Let me check.\n" and [(c.name, json.loads(c.arguments)) for c in found] == [
        ("get_weather", {"city": "Paris"})]
    assert calls(HermesParser().parse(HERMES[1])) == [("a", {}), ("b", {"x": [1, "}"]})]
    assert HermesParser().parse(HERMES[3]) == ("<tool_call>not json</tool_call> then text", [])
    assert calls(HermesParser().parse(HERMES[4])) == [("f", {"a": 1})]
    assert HermesParser().parse(HERMES[5]) == (HERMES[5], [])
    assert HermesParser().parse(HERMES[6]) == (HERMES[6], [])
    assert HermesParser().parse(HERMES[7]) == (HERMES[7], [])
    content, found = HermesParser().parse(HERMES[8])
    assert content == "你好  after" and calls((content, found)) == [("f", {"q": "é"})]
    assert json.loads(found[0].arguments) == {"q": "é"} and "é" in found[0].arguments  # (not \\u escaped)


def test_hermes_closing_tag_inside_a_string_of_a_streaming_call_is_text():
    # The call went out at `{"name": "f", "arguments": {`; its strings are the model's text, tags and all.
    content, found = HermesParser().parse(HERMES[2])
    assert content == "" and calls((content, found)) == [("f", {"s": "</tool_call> inside"})]


def test_hermes_closing_tag_outside_strings_ends_a_streaming_call_where_it_is():
    text = '<tool_call>{"name": "f", "arguments": {"a": [1, 2</tool_call> and after'
    assert whole(HermesParser, text) == (" and after", [("f", '{"a": [1, 2')])
    # Before the head is certain the block is no call yet: a tag there ends it as text, as before.
    assert whole(HermesParser, '<tool_call>{"name": "f</tool_call>') == ('<tool_call>{"name": "f</tool_call>', [])


LLAMA = [
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": "}{"}}',
    '  {"name": "a", "parameters": {}} and then words',
    'The weather is fine.',
    '{"not": "a call"}',
    '<|python_ta',
    '{"name": "a", "parameters": {"x": ',
]


def test_llama3_json_calls_and_content():
    assert calls(Llama3JsonParser().parse(LLAMA[0])) == [("get_weather", {"city": "Paris"})]
    assert calls(Llama3JsonParser().parse(LLAMA[1])) == [("a", {"x": 1}), ("b", {"y": "}{"})]
    assert whole(Llama3JsonParser, LLAMA[2]) == ("and then words", [("a", "{}")])
    assert Llama3JsonParser().parse(LLAMA[3]) == ("The weather is fine.", [])
    assert Llama3JsonParser().parse(LLAMA[4]) == ('{"not": "a call"}', [])
    assert Llama3JsonParser().parse(LLAMA[5]) == ("<|python_ta", [])
    # Cut short in its arguments (max_tokens): the call went out with its name; its arguments are what came.
    assert whole(Llama3JsonParser, LLAMA[6]) == ("", [("a", '{"x": ')])


@pytest.mark.parametrize("name,texts", [("hermes", HERMES), ("llama3_json", LLAMA)])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_split_gives_what_the_whole_text_gives(name, texts, data):
    text = data.draw(st.sampled_from(texts))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert split_parse(PARSERS[name], text, cuts) == whole(PARSERS[name], text)


PIECES = list('<>/{}":,; \n\\abfnmetool_call[]') + ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": {}}',
                                                  '{"name": "g", "arguments": {', '"parameters": {', "<|python_tag|>"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=30).map("".join), st.lists(st.integers(0, 200), max_size=8))
def test_random_text_splits_the_same_and_loses_nothing_outside_calls(text, cuts):
    for cls in PARSERS.values():
        assert split_parse(cls, text, [c for c in cuts if c <= len(text)]) == whole(cls, text)
    content, found = HermesParser().parse(text)
    if not found:
        assert content == text  # no call: every character is content


# ---------------------------------------------------------------------------------------------------- streaming
def test_call_head():
    text = '{ "name" : "get_weather" ,\n "arguments": {"city": "Paris"}}'
    assert call_head(text, 0) == Head("get_weather", text.index("{", 1))
    assert call_head('  {"name": "f", "parameters": {', 2) == Head("f", 30)
    for cut in range(len(text.split(": {")[0]) + 2):
        assert call_head(text[:cut], 0) is WAIT, text[:cut]  # could still be one
    for other in ('{"arguments": {}, "name": "f"}', '{"name": "f", "arguments": "{}"}', '{"name": "", "arguments": {',
                  '{"name": 3, "arguments": {', '{"name": "f"}', '{"name": "f", "id": 1, "arguments": {',
                  '{"name": "a\tb", "arguments": {', '{"nam": "f"'):
        assert call_head(other, 0) is None, other


def feed_pieces(parser, pieces: list[str]) -> list[list]:
    """Each piece's events (the last with finish's)."""
    out = [parser.feed(p) for p in pieces]
    out[-1] += parser.finish()
    return out


@pytest.mark.parametrize("name,text", [
    ("hermes", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}'),
])
def test_arguments_stream_token_by_token(name, text):
    per_char = feed_pieces(PARSERS[name](), list(text))
    events = [e for piece in per_char for e in piece]
    starts = [e for e in events if isinstance(e, ToolCall)]
    assert [(c.name, c.arguments) for c in starts] == [("get_weather", ""), ("get_time", "")]
    # the name goes out with the `{` that opens the arguments, then one fragment per character of them
    first = next(i for i, piece in enumerate(per_char) if any(isinstance(e, ToolCall) for e in piece))
    assert text[first] == "{" and text[first - 1] != "{"
    first_call = events[events.index(starts[0]) + 1:events.index(starts[1])]
    fragments = [e.text for e in first_call if isinstance(e, Arguments)]
    assert "".join(fragments) == '{"city": "Paris", "days": 3}' and all(len(f) == 1 for f in fragments)
    assert merged(events)[1] == whole(PARSERS[name], text)[1]
    assert json.loads(merged(events)[1][1][1]) == {"zone": "CET"}


def test_a_call_in_another_key_order_goes_out_whole():
    text = '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>'
    events = [e for piece in feed_pieces(HermesParser(), list(text)) for e in piece]
    assert not any(isinstance(e, Arguments) for e in events)
    assert [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)] == [("f", {"a": 1})]


def test_members_after_the_arguments_are_dropped_and_the_object_ends():
    text = '{"name": "f", "arguments": {"a": "}"}, "extra": {"b": [1, "]"]}} then words'
    assert whole(Llama3JsonParser, text) == ("then words", [("f", '{"a": "}"}')])
