"""router/tool_parsers: each format's calls and content, whole and split across arbitrary delta boundaries."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.tool_parsers import PARSERS
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
    return ("".join(e for e in events if isinstance(e, str)),
            [(e.name, e.arguments) for e in events if not isinstance(e, str)])


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


def test_hermes_tag_inside_a_string_ends_the_block_as_text():
    # The block ends at the first closing tag: its body is then no whole object, so it is content (whole or split).
    content, found = HermesParser().parse(HERMES[2])
    assert found == [] and content.startswith("<tool_call>")


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
    assert Llama3JsonParser().parse(LLAMA[6]) == (LLAMA[6], [])


@pytest.mark.parametrize("name,texts", [("hermes", HERMES), ("llama3_json", LLAMA)])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_split_gives_what_the_whole_text_gives(name, texts, data):
    text = data.draw(st.sampled_from(texts))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert split_parse(PARSERS[name], text, cuts) == whole(PARSERS[name], text)


PIECES = list('<>/{}":,; \n\\abfnmetool_call[]') + ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": {}}',
                                                  "<|python_tag|>"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=30).map("".join), st.lists(st.integers(0, 200), max_size=8))
def test_random_text_splits_the_same_and_loses_nothing_outside_calls(text, cuts):
    for cls in PARSERS.values():
        assert split_parse(cls, text, [c for c in cuts if c <= len(text)]) == whole(cls, text)
    content, found = HermesParser().parse(text)
    if not found:
        assert content == text  # no call: every character is content
