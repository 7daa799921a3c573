"""Tool calling against a live stack with the official openai SDK: a tiny random Qwen2 whose tokenizer carries
Qwen2.5's real chat template (tests/router/chat_templates), `--tool-call-parser hermes --enable-auto-tool-choice`.

Random weights do not decide to call a tool, so what can be checked honestly is checked: the template renders the
tools and the tool turns (the prompt grows by them), `tool_choice: none` leaves the text alone, `auto` parses
whatever the model wrote the same way streamed and gathered. The full loop (call, result, answer) runs with a named
choice, which the structured-outputs grammar enforces: it needs engine.sampling_params.StructuredOutputsParams.

Arguments stream as they are generated: with `tool_choice: required` (the grammar makes the calls), and with `auto`
where a `guided_regex` makes the model write two calls in the parser's format (Hermes here; Llama 3 JSON on a
second, colocated stack with `--tool-call-parser llama3_json`), text before them included. Through the SDK's
`chat.completions.stream`, each multi-key arguments object arrives in many deltas, which put together equal the
arguments of the same seeded request not streamed; cut short by max_tokens, both views hold the same partial call."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from stack import Stack

pytestmark = pytest.mark.slow

TEMPLATES = Path(__file__).resolve().parents[1] / "router" / "chat_templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    # (a closed set of cities: the model's weights are random, and a free string need not end within max_tokens;
    # the grammar makes any output a valid call only once it ends)
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

try:
    from engine.sampling_params import StructuredOutputsParams  # noqa: F401
    HAVE_GRAMMAR = True
except ImportError:
    HAVE_GRAMMAR = False


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2_dir, tmp_path_factory) -> Path:
    from engine.tokenizer import load_synthetic

    out = tmp_path_factory.mktemp("tiny-qwen2-tools") / "model"
    shutil.copytree(tiny_qwen2_dir, out)
    tok = load_synthetic(out)
    tok.chat_template = (TEMPLATES / "qwen2_5.jinja").read_text()
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def stack(model_dir):
    s = Stack("--model", str(model_dir), "--served-model-name", "qwen", "--tool-call-parser", "hermes",
              "--enable-auto-tool-choice", prefill=1, decode=1).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.http + "/v1", api_key="unused", timeout=120, max_retries=0)


def assembled(chunks):
    """The chunks through the openai SDK's own assembler (its snapshot: a reply cut by max_tokens is kept, where
    `get_final_completion` would refuse it)."""
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.current_completion_snapshot


# ---------------------------------------------------------------------------------------------------- streaming
def strict(name: str, properties: dict) -> dict:
    """A strict function tool (the SDK's `chat.completions.stream` parses strict tools' arguments as they come)."""
    return {"type": "function", "function": {"name": name, "strict": True, "parameters": {
        "type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}}}


FORECAST = strict("get_forecast", {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                   "unit": {"type": "string", "enum": ["C", "F"]}})
CLOCK = strict("get_time", {"zone": {"type": "string", "enum": ["UTC", "CET"]}, "hour24": {"type": "boolean"}})
_FORECAST_ARGS = r'\{"city": "(Paris|Oslo|Lima)", "days": [1-7], "unit": "(C|F)"\}'
_CLOCK_ARGS = r'\{"zone": "(UTC|CET)", "hour24": (true|false)\}'
# Two calls in each parser's format, text before them in Hermes' (random weights write what the regex allows).
HERMES_CALLS = (r'[a-z]{2,6}\. <tool_call>\n\{"name": "get_forecast", "arguments": ' + _FORECAST_ARGS +
                r'\}\n</tool_call>\n<tool_call>\n\{"name": "get_time", "arguments": ' + _CLOCK_ARGS +
                r'\}\n</tool_call>')
LLAMA_CALLS = (r'<\|python_tag\|>\{"name": "get_forecast", "parameters": ' + _FORECAST_ARGS +
               r'\}; \{"name": "get_time", "parameters": ' + _CLOCK_ARGS + r'\}')


def streamed_calls(client, sdk_stream: bool = True, **kw):
    """The request streamed: (the completion as the SDK assembled it; per call index, the arguments fragments of
    the chunks; each call's first entry as it came). sdk_stream: through `chat.completions.stream` (strict tools
    parsed; it refuses an answer cut short), else `create(stream=True)` into the SDK's assembler."""
    deltas, firsts, chunks = {}, [], []
    if sdk_stream:
        with client.chat.completions.stream(**kw) as stream:
            chunks = [event.chunk for event in stream if event.type == "chunk"]
            completion = stream.get_final_completion()
    else:
        chunks = list(client.chat.completions.create(**kw, stream=True))
        completion = assembled(chunks)
    for chunk in chunks:
        for tc in (tc for c in chunk.choices for tc in c.delta.tool_calls or ()):
            if tc.id:
                firsts.append(tc)
            elif tc.function.arguments:
                deltas.setdefault(tc.index, []).append(tc.function.arguments)
    return completion, deltas, firsts


def check_streams_like_gathered(client, tools, regex, expect_content: bool):
    for seed in (0, 1):
        kw = dict(model="qwen", messages=ASK, tools=tools, max_tokens=240, temperature=1.0, seed=seed,
                  extra_body={"guided_regex": regex})
        whole = client.chat.completions.create(**kw).choices[0]
        streamed, deltas, firsts = streamed_calls(client, **kw)
        choice = streamed.choices[0]
        assert whole.finish_reason == choice.finish_reason == "tool_calls", whole
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert [c.function.name for c in whole.message.tool_calls] == ["get_forecast", "get_time"]
        assert [(f.index, f.type, f.function.name, f.function.arguments) for f in firsts] == [
            (0, "function", "get_forecast", ""), (1, "function", "get_time", "")]
        for i, call in enumerate(whole.message.tool_calls):
            args = json.loads(call.function.arguments)
            assert "".join(deltas[i]) == call.function.arguments and len(deltas[i]) > len(args), (i, deltas[i])
            assert choice.message.tool_calls[i].function.parsed_arguments == args  # (the SDK's strict parse)
        assert (choice.message.content or "") == (whole.message.content or "")
        assert bool(whole.message.content) == expect_content


@pytest.mark.skipif(not HAVE_GRAMMAR, reason="needs structured outputs")
def test_hermes_calls_stream_their_arguments(client):
    check_streams_like_gathered(client, [FORECAST, CLOCK], HERMES_CALLS, expect_content=True)


@pytest.mark.skipif(not HAVE_GRAMMAR, reason="needs structured outputs")
def test_a_call_cut_short_streams_what_the_gathered_answer_holds(client):
    kw = dict(model="qwen", messages=ASK, tools=[FORECAST, CLOCK], temperature=1.0, seed=3,
              extra_body={"guided_regex": HERMES_CALLS})
    full = client.chat.completions.create(**kw, max_tokens=240, logprobs=True).choices[0]
    tokens = [t.token for t in full.logprobs.content]
    second = full.message.tool_calls[1].function.arguments
    # max_tokens ends the output inside the second call's arguments (the byte-level tokenizer: one token each)
    at = "".join(tokens).index(second) + len(second) // 2
    cut = next(k for k in range(len(tokens)) if len("".join(tokens[:k])) >= at)
    assert len("".join(tokens[:cut])) == at
    whole = client.chat.completions.create(**kw, max_tokens=cut).choices[0]
    streamed = assembled(client.chat.completions.create(**kw, max_tokens=cut, stream=True)).choices[0]
    assert whole.finish_reason == streamed.finish_reason == "length"
    got = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert got == [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls]
    assert got == [(full.message.tool_calls[0].function.name, full.message.tool_calls[0].function.arguments),
                   ("get_time", second[:len(second) // 2])]
    assert streamed.message.content == whole.message.content == full.message.content


@pytest.mark.skipif(not HAVE_GRAMMAR, reason="needs structured outputs")
@pytest.mark.parametrize("seed,parallel", [(0, False), (1, False), (0, True), (1, True)])
def test_required_calls_stream_their_arguments(client, seed, parallel):
    """The grammar's array of calls; one call without parallel calls (the SDK's strict stream), else as many as
    the random weights write before max_tokens (the last may be cut short: the SDK's assembler takes that)."""
    kw = dict(model="qwen", messages=ASK, tools=[FORECAST, CLOCK], tool_choice="required", max_tokens=200,
              temperature=1.0, seed=seed, parallel_tool_calls=parallel)
    whole = client.chat.completions.create(**kw).choices[0]
    streamed, deltas, firsts = streamed_calls(client, sdk_stream=not parallel, **kw)
    choice = streamed.choices[0]
    assert choice.finish_reason == whole.finish_reason
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert calls and [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == calls
    assert [(f.index, f.function.name, f.function.arguments) for f in firsts] == [
        (i, name, "") for i, (name, _) in enumerate(calls)]
    if not parallel:
        assert len(calls) == 1 and whole.finish_reason == "tool_calls"
    for i, (name, arguments) in enumerate(calls):
        assert "".join(deltas.get(i, [])) == arguments
        if whole.finish_reason == "tool_calls" or i < len(calls) - 1:  # (the last may be cut short)
            args = json.loads(arguments)
            assert set(args) == set((FORECAST if name == "get_forecast" else CLOCK)["function"]["parameters"]
                                    ["properties"]) and len(deltas[i]) > len(args)


@pytest.fixture(scope="module")
def llama_client(model_dir):
    s = Stack("--model", str(model_dir), "--served-model-name", "qwen", "--tool-call-parser", "llama3_json",
              "--enable-auto-tool-choice", colocated=True).wait_ready()
    yield openai.OpenAI(base_url=s.http + "/v1", api_key="unused", timeout=120, max_retries=0)
    s.stop()


@pytest.mark.skipif(not HAVE_GRAMMAR, reason="needs structured outputs")
def test_llama3_json_calls_stream_their_arguments(llama_client):
    check_streams_like_gathered(llama_client, [FORECAST, CLOCK], LLAMA_CALLS, expect_content=False)


def test_tools_and_tool_turns_are_rendered(client):
    plain = client.chat.completions.create(model="qwen", messages=ASK, max_tokens=1)
    with_tools = client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], tool_choice="none",
                                                max_tokens=1)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + len(json.dumps(WEATHER)) // 2
    loop = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    after = client.chat.completions.create(model="qwen", messages=loop, tools=[WEATHER], tool_choice="none",
                                           max_tokens=1)
    assert after.usage.prompt_tokens > with_tools.usage.prompt_tokens


def test_tool_choice_none_is_plain_content(client):
    r = client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], tool_choice="none",
                                       max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.tool_calls in (None, []) and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content


@pytest.mark.parametrize("seed", [0, 1])
def test_auto_parses_the_same_streamed_and_gathered(client, seed):
    kw = dict(model="qwen", messages=ASK, tools=[WEATHER], max_tokens=24, temperature=1.0, seed=seed)
    whole = client.chat.completions.create(**kw).choices[0]
    streamed = assembled(client.chat.completions.create(**kw, stream=True)).choices[0]
    assert streamed.message.content == whole.message.content
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert streamed.finish_reason == whole.finish_reason


@pytest.mark.skipif(not HAVE_GRAMMAR, reason="needs engine.sampling_params.StructuredOutputsParams (the "
                                             "structured-outputs work) to enforce a named tool_choice")
@pytest.mark.parametrize("stream", [False, True])
def test_a_full_tool_loop_with_a_named_choice(client, stream):
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model="qwen", messages=ASK, tools=[WEATHER], tool_choice=named, max_tokens=48, temperature=0)
    if stream:
        choice = assembled(client.chat.completions.create(**kw, stream=True)).choices[0]
    else:
        choice = client.chat.completions.create(**kw).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert isinstance(args.get("city"), str)
    assert choice.finish_reason == "tool_calls"
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    kw = dict(model="qwen", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=8,
              extra_body={"ignore_eos": True})
    if stream:
        answer = assembled(client.chat.completions.create(**kw, stream=True))
    else:
        answer = client.chat.completions.create(**kw)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason == "length"
    assert not answer.choices[0].message.tool_calls


@pytest.mark.skipif(not HAVE_GRAMMAR, reason="needs structured outputs")
@pytest.mark.parametrize("stream", [False, True])
def test_a_named_choice_always_calls_that_tool(client, stream):
    """Of two tools, the named one: in every one of 8 seeded samples, one call with arguments that parse."""
    named = {"type": "function", "function": {"name": "get_time"}}
    kw = dict(model="qwen", messages=ASK, tools=[FORECAST, CLOCK], tool_choice=named, n=8, seed=21,
              temperature=1.0, max_tokens=60)
    r = assembled(client.chat.completions.create(**kw, stream=True)) if stream else client.chat.completions.create(**kw)
    assert len(r.choices) == 8
    for choice in r.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_time" and choice.finish_reason == "tool_calls", choice
        assert set(json.loads(call.function.arguments)) == {"zone", "hour24"}


# ---------------------------------------------------------------------------------------------------- gRPC Chat
def grpc_tools(tools: list[dict]):
    from protos.tandem.v1 import generate_pb2

    return [generate_pb2.Tool(name=t["function"]["name"], description=t["function"].get("description", ""),
                              parameters_json=json.dumps(t["function"]["parameters"]),
                              strict=t["function"].get("strict", False)) for t in tools]


def grpc_messages(messages: list[dict]):
    from protos.tandem.v1 import generate_pb2

    return [generate_pb2.ChatMessage(role=m["role"], content=m.get("content") or "",
                                     tool_call_id=m.get("tool_call_id", ""),
                                     tool_calls=[generate_pb2.ToolCall(id=c["id"], name=c["function"]["name"],
                                                                       arguments=c["function"]["arguments"])
                                                 for c in m.get("tool_calls", ())]) for m in messages]


def grpc_chat(stack, **fields) -> dict:
    """One gRPC Chat call, its responses put together as a client does: per completion index the token ids,
    content, calls (first entry: id and name; later entries append arguments), finish reason; and the prompt ids."""
    import asyncio

    import grpc

    from protos.tandem.v1 import generate_pb2, generate_pb2_grpc

    async def call():
        async with grpc.aio.insecure_channel(stack.grpc) as ch:
            return [r async for r in generate_pb2_grpc.GenerateStub(ch).Chat(generate_pb2.ChatRequest(**fields),
                                                                              timeout=120)]

    out: dict = {}
    for r in asyncio.run(call()):
        c = out.setdefault(r.index, {"token_ids": [], "content": "", "calls": [], "finish": None, "prompt": None})
        if r.prompt_token_ids:
            assert c["prompt"] is None, "prompt_token_ids twice for one completion"
            c["prompt"] = list(r.prompt_token_ids)
        c["token_ids"] += r.delta.token_ids
        c["content"] += r.content if r.HasField("content") else r.delta.text
        for tc in r.tool_calls:
            if tc.id:
                assert tc.index == len(c["calls"]) and tc.name, tc
                c["calls"].append({"id": tc.id, "name": tc.name, "arguments": tc.arguments})
            else:
                assert not tc.name and tc.index < len(c["calls"]), tc
                c["calls"][tc.index]["arguments"] += tc.arguments
        if r.delta.finish_reason:
            c["finish"] = r.delta.finish_reason
    return out


@pytest.mark.skipif(not HAVE_GRAMMAR, reason="needs structured outputs")
@pytest.mark.parametrize("case", ["required", "required-one", "named", "auto-hermes"])
def test_grpc_chat_makes_the_http_endpoints_calls(stack, client, case):
    """The same messages, tools, tool choice and seed through gRPC Chat and POST /v1/chat/completions: the same
    prompt tokens, output tokens, content and calls (arguments to the character), FINISH_REASON_TOOL_CALLS."""
    from protos.tandem.v1 import common_pb2, generate_pb2

    tools = [FORECAST, CLOCK]
    http_kw: dict = dict(model="qwen", messages=ASK, tools=tools, temperature=1.0, seed=5, max_tokens=400,
                         extra_body={"return_token_ids": True})
    grpc_kw: dict = dict(messages=grpc_messages(ASK), tools=grpc_tools(tools), return_prompt_token_ids=True)
    so = None
    if case.startswith("required"):
        http_kw["tool_choice"] = "required"
        grpc_kw["tool_choice"] = generate_pb2.ToolChoice(mode="required")
        if case == "required-one":
            http_kw["parallel_tool_calls"] = grpc_kw["parallel_tool_calls"] = False
    elif case == "named":
        http_kw["tool_choice"] = {"type": "function", "function": {"name": "get_forecast"}}
        grpc_kw["tool_choice"] = generate_pb2.ToolChoice(function="get_forecast")
    else:  # auto: the model's text read by the hermes parser (a regex makes random weights write two calls)
        http_kw["extra_body"]["guided_regex"] = HERMES_CALLS
        so = common_pb2.StructuredOutputs(regex=HERMES_CALLS)
    grpc_kw["params"] = common_pb2.SamplingParams(temperature=1.0, seed=5, max_tokens=400, structured_outputs=so)
    want = client.chat.completions.create(**http_kw)
    got = grpc_chat(stack, **grpc_kw)
    (choice,) = want.choices
    g = got[0]
    assert g["prompt"] == want.model_extra["prompt_token_ids"]
    assert g["token_ids"] == choice.model_extra["token_ids"]
    # Parallel required calls run until max_tokens with random weights (the last call cut short): both say so.
    finish = {"tool_calls": common_pb2.FINISH_REASON_TOOL_CALLS, "length": common_pb2.FINISH_REASON_LENGTH}
    assert g["finish"] == finish[choice.finish_reason]
    assert choice.finish_reason == "tool_calls" or case == "required"
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert [(c["name"], c["arguments"]) for c in g["calls"]] == calls
    assert all(c["id"].startswith("call_") for c in g["calls"])
    assert g["content"] == (choice.message.content or "")
    if case == "auto-hermes":
        assert [name for name, _ in calls] == ["get_forecast", "get_time"] and g["content"]
    elif case in ("named", "required-one"):
        assert len(calls) == 1


@pytest.mark.skipif(not HAVE_GRAMMAR, reason="needs structured outputs")
def test_a_full_tool_loop_over_grpc(stack, client):
    """Call (a named choice), the tool's result as a tool turn, the answer, over gRPC Chat alone; each turn's prompt
    is the HTTP endpoint's rendering of the same messages (the call's turn and the tool's result in it)."""
    from protos.tandem.v1 import common_pb2, generate_pb2

    params = common_pb2.SamplingParams(temperature=0, max_tokens=48)
    first = grpc_chat(stack, messages=grpc_messages(ASK), tools=grpc_tools([WEATHER]), params=params,
                      tool_choice=generate_pb2.ToolChoice(function="get_weather"), return_prompt_token_ids=True)[0]
    (call,) = first["calls"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["city"] in ("Paris", "Oslo", "Lima")
    assert first["finish"] == common_pb2.FINISH_REASON_TOOL_CALLS and first["content"] == ""
    loop = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"}]
    answer = grpc_chat(stack, messages=grpc_messages(loop), tools=grpc_tools([WEATHER]),
                       tool_choice=generate_pb2.ToolChoice(mode="none"), return_prompt_token_ids=True,
                       params=common_pb2.SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))[0]
    assert answer["content"] and not answer["calls"] and answer["finish"] == common_pb2.FINISH_REASON_LENGTH
    http = client.chat.completions.create(model="qwen", messages=loop, tools=[WEATHER], tool_choice="none",
                                          max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    assert answer["prompt"] == http.model_extra["prompt_token_ids"]
    assert answer["token_ids"] == http.choices[0].model_extra["token_ids"]
    assert len(answer["prompt"]) > len(first["prompt"]) + 20  # (the call and the result are in it)
