"""Structured outputs through live stacks with the official `openai` SDK: `chat.completions.parse` with a pydantic
model returns an object that validates (random:tiny, where only the grammar makes it valid, and SmolLM2), a regex
and a choice hold for many seeded samples, a bad schema is a 400 naming the field, and the same seeded request
gives the same tokens through the disaggregated stack (the prefill draws the first token under the grammar, the
decode continues it) and `--colocated` (one engine)."""
from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from stack import Stack

pytestmark = pytest.mark.slow

REGEX = r"[a-c]{3}-\d{2}"


class Pet(BaseModel):
    name: Annotated[str, Field(pattern=r"^[a-z]{1,6}$")]
    age: Annotated[int, Field(ge=0, le=30)]
    kind: Literal["cat", "dog"]
    vaccinated: bool


@pytest.fixture(scope="module")
def disaggregated():
    s = Stack("--model", "random:tiny", prefill=1, decode=1).wait_ready(timeout=600)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def colocated():
    s = Stack("--model", "random:tiny", colocated=True).wait_ready(timeout=600)
    yield s
    s.stop()


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http + "/v1", api_key="unused", timeout=120, max_retries=0)


def parse_pets(stack: Stack, **kw):
    # Random weights take the whitespace the schema allows between tokens as often as anything else: fixed
    # separators keep the objects short (vLLM's option, merged into the response_format's constraint).
    return client(stack).chat.completions.parse(
        model="random:tiny", messages=[{"role": "user", "content": "Describe a pet as JSON."}],
        response_format=Pet, temperature=1.0, max_tokens=120, logprobs=True,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}}, **kw)


def test_parse_validates_and_matches_colocated(disaggregated, colocated):
    got = {}
    for name, stack in (("disaggregated", disaggregated), ("colocated", colocated)):
        completion = parse_pets(stack, n=3, seed=1234)
        for choice in completion.choices:
            assert choice.finish_reason == "stop", choice
            assert isinstance(choice.message.parsed, Pet)
            Pet.model_validate_json(choice.message.content)
        got[name] = [[t.token for t in c.logprobs.content] for c in completion.choices]
    assert got["disaggregated"] == got["colocated"]
    assert len({tuple(t) for t in got["disaggregated"]}) == 3  # completion i draws with seed + i


def test_regex_and_choice_hold_for_100_seeded_samples(disaggregated):
    c = client(disaggregated)
    regex = c.completions.create(model="random:tiny", prompt="id:", n=50, seed=7, temperature=1.0, max_tokens=12,
                                 extra_body={"guided_regex": REGEX})
    texts = [ch.text for ch in regex.choices]
    assert all(re.fullmatch(REGEX, t) for t in texts), [t for t in texts if not re.fullmatch(REGEX, t)]
    regex2 = c.completions.create(model="random:tiny", prompt="id:", n=50, seed=57, temperature=1.0,
                                  max_tokens=12, extra_body={"structured_outputs": {"regex": REGEX}})
    assert all(re.fullmatch(REGEX, ch.text) for ch in regex2.choices)
    assert len(set(texts + [ch.text for ch in regex2.choices])) > 50
    choice = c.chat.completions.create(model="random:tiny", messages=[{"role": "user", "content": "Colour?"}],
                                       n=100, seed=3, temperature=1.0, max_tokens=8,
                                       extra_body={"guided_choice": ["red", "green", "blue"]})
    colours = [ch.message.content for ch in choice.choices]
    assert len(colours) == 100 and all(ch.finish_reason == "stop" for ch in choice.choices)
    assert set(colours) == {"red", "green", "blue"}, colours  # (100 draws: each of the three comes up)

def test_guided_json_and_guided_grammar_hold_for_seeded_samples(disaggregated):
    c = client(disaggregated)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = c.completions.create(model="random:tiny", prompt="json:", n=20, seed=5, temperature=1.0, max_tokens=40,
                             extra_body={"guided_json": schema, "structured_outputs": {"disable_any_whitespace": True}})
    for ch in r.choices:
        assert ch.finish_reason == "stop", ch
        value = json.loads(ch.text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9, value
    grammar = 'root ::= ("yes" | "no") "-" [0-9] [0-9]'
    r = c.completions.create(model="random:tiny", prompt="answer:", n=50, seed=9, temperature=1.0, max_tokens=12,
                             extra_body={"guided_grammar": grammar})
    texts = [ch.text for ch in r.choices]
    assert all(re.fullmatch(r"(yes|no)-\d\d", t) for t in texts), texts
    assert {t.split("-")[0] for t in texts} == {"yes", "no"}


def test_json_object_gives_json_objects(disaggregated):
    # response_format json_object: any JSON object, which random weights reach only through the grammar. A choice
    # that stops is one whole object; one cut by max_tokens is still the start of one.
    completion = client(disaggregated).chat.completions.create(
        model="random:tiny", messages=[{"role": "user", "content": "Any JSON object."}], n=20, seed=11,
        temperature=1.0, max_tokens=64, response_format={"type": "json_object"},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    stopped = [ch for ch in completion.choices if ch.finish_reason == "stop"]
    assert stopped, [ch.message.content for ch in completion.choices]
    for ch in completion.choices:
        text = ch.message.content
        assert text.startswith("{"), text
        if ch.finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert ch.finish_reason == "length", ch

def test_bad_constraints_are_400_naming_the_field(disaggregated):
    c = client(disaggregated)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}, "strict": True}}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="random:tiny", messages=[{"role": "user", "content": "hi"}],
                                  response_format=bad_schema)
    assert e.value.body["param"] == "response_format" and "foo" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="random:tiny", prompt="x", extra_body={"guided_regex": "a(",
                                                                          "guided_choice": ["a"]})
    assert "give one output constraint" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="random:tiny", prompt="x", extra_body={"guided_grammar": "x" * 70000})
    assert e.value.body["param"] == "guided_grammar" and "must be at most 65536" in e.value.body["message"]
    # the stack still serves
    ok = c.completions.create(model="random:tiny", prompt="x", max_tokens=12, extra_body={"guided_regex": REGEX})
    assert re.fullmatch(REGEX, ok.choices[0].text)


def test_smollm2_parse_validates():
    class City(BaseModel):
        city: Annotated[str, Field(pattern=r"^[A-Za-z ]{1,20}$")]
        country: Annotated[str, Field(pattern=r"^[A-Za-z ]{1,20}$")]

    s = Stack("--model", "smollm2", "--max-model-len", "2048", prefill=1, decode=1).wait_ready(timeout=600)
    try:
        completion = client(s).chat.completions.parse(
            model="smollm2", messages=[{"role": "user", "content": "Which city is the capital of France? "
                                                                   "Answer in JSON."}],
            response_format=City, temperature=0.0, max_tokens=60)
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, City), completion
        assert parsed.city.strip().lower() == "paris", parsed
    finally:
        s.stop()
