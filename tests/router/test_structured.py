"""router/structured.py: each spelling of a constraint in the OpenAI bodies maps onto one StructuredOutputsParams,
and a wrong one is a ValueError naming the field the client sent."""
from __future__ import annotations

import asyncio

import pytest

from engine.sampling_params import StructuredOutputsParams as S
from router import structured
from router.openai_protocol import ChatCompletionRequest, CompletionRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


@pytest.mark.parametrize("body,expected", [
    (chat(), None),
    (chat(response_format={"type": "text"}), None),
    (chat(response_format={"type": "json_object"}), S(json_object=True)),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}),
     S(json=SCHEMA)),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
          structured_outputs={"disable_any_whitespace": True}), S(json=SCHEMA, disable_any_whitespace=True)),
    (CompletionRequest(prompt="x", guided_json=SCHEMA), S(json=SCHEMA)),
    (CompletionRequest(prompt="x", guided_regex=r"\d+"), S(regex=r"\d+")),
    (CompletionRequest(prompt="x", guided_choice=["a", "b"]), S(choice=["a", "b"])),
    (CompletionRequest(prompt="x", guided_grammar='root ::= "a"'), S(grammar='root ::= "a"')),
    (CompletionRequest(prompt="x", structured_outputs={"regex": "a+", "disable_any_whitespace": False}),
     S(regex="a+")),
])
def test_spellings_map_onto_one_constraint(body, expected):
    asyncio.run(structured.prepare(body))  # (checked on a worker thread; the result is kept on the body)
    assert body.structured_outputs_params() == expected
    assert body.sampling_params(max_tokens=4, logprobs=None).structured_outputs == expected


@pytest.mark.parametrize("body,message", [
    (chat(response_format={"type": "json_schema"}), "^response_format.json_schema: required"),
    (chat(response_format={"type": "yaml"}), "^response_format.type='yaml': must be one of"),
    (chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}),
     r"^response_format.json_schema.schema: invalid \(.*foo"),
    (CompletionRequest(prompt="x", guided_regex="a(", guided_choice=["a"]),
     "^guided_regex: give one output constraint, not also guided_choice"),
    (CompletionRequest(prompt="x", guided_regex="a("), r"^guided_regex: invalid \(Regex parsing error"),
    (CompletionRequest(prompt="x", structured_outputs={"regex": "a", "nope": 1}),
     "^structured_outputs: unknown field"),
    (CompletionRequest(prompt="x", structured_outputs={"disable_any_whitespace": True}),
     "^structured_outputs: names no constraint"),
    (CompletionRequest(prompt="x", guided_json=SCHEMA, guided_whitespace_pattern=r"\s"),
     "^guided_json: not supported by the xgrammar backend"),
])
def test_bad_constraints_name_the_request_field(body, message):
    with pytest.raises(ValueError, match=message):
        body.structured_outputs_params()
