"""router/chat_template.py with the real chat templates of Qwen2.5 and Llama 3.1 (tests/router/chat_templates, from
their HuggingFace tokenizer configs): tools and a tool loop's turns render as each family expects."""
from pathlib import Path

import pytest

from engine.tokenizer import synthetic_tokenizer
from router.chat_template import ChatTemplateError, render, template_messages
from router.openai_protocol import ChatCompletionRequest

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
LOOP = [{"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def tokenizer(name: str):
    tok = synthetic_tokenizer(512)
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


def rendered(name: str, messages=LOOP, **kw) -> str:
    body = ChatCompletionRequest(messages=messages, tools=[WEATHER])
    return render(tokenizer(name), template_messages(body.messages), tools=[WEATHER],
                  add_generation_prompt=kw.get("add_generation_prompt", True),
                  continue_final_message=kw.get("continue_final_message", False))


def test_qwen2_5_renders_tools_calls_and_results():
    text = rendered("qwen2_5")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    # The call's arguments as an object (text would be quoted twice), the result in <tool_response>.
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


def test_llama3_1_renders_tools_calls_and_results():
    text = rendered("llama3_1")
    assert "Environment: ipython" in text and '"name": "get_weather"' in text
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in text
    assert "<|start_header_id|>ipython<|end_header_id|>" in text


def test_a_template_that_refuses_is_a_400_naming_messages():
    two = [LOOP[0], {"role": "assistant", "content": "", "tool_calls": LOOP[1]["tool_calls"] * 2}]
    with pytest.raises(ChatTemplateError, match="only supports single tool-calls") as e:
        rendered("llama3_1", two)
    assert e.value.field == "messages"


def test_continue_final_message_leaves_the_last_turn_open():
    msgs = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one, two,"}]
    text = rendered("qwen2_5", msgs, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("one, two,")
