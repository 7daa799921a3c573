"""A chat request's messages (and tools) through the model's chat template, as the text of the prompt.

Messages go to the template as HuggingFace's templates read them: role and content; an assistant turn's
`tool_calls` with `function.arguments` decoded to an object (Qwen2.5's and Llama 3.1's templates write it with
`tojson`: text would come out quoted twice); a tool result's `tool_call_id` and `name`. Tools go in `tools=`; a
template that has no place for them (SmolLM2's, ChatML without tools) leaves them out, as vLLM lets it: the model
then does not see them (`tool_choice` required or named still holds its output to a call). A template that refuses
the messages (Llama 3.1's raises on two calls in one turn) is a 400 naming `messages`.
"""
from __future__ import annotations

import json

import jinja2

from router.tool_parsers.base import arguments_text


class ChatTemplateError(ValueError):
    """The messages cannot be rendered; `field` names the request field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name


def template_messages(messages) -> list[dict]:
    """ChatMessage models as the dicts a chat template reads."""
    out = []
    for i, m in enumerate(messages):
        msg: dict = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name,
                                               "arguments": _arguments(c.function.arguments, i, j)}}
                                 for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def _arguments(value, i: int, j: int) -> dict:
    where = f"messages.{i}.tool_calls.{j}.function.arguments"
    if isinstance(value, dict):
        return value
    try:
        decoded = json.loads(value)
    except json.JSONDecodeError as e:
        raise ChatTemplateError("messages", f"{where}: not JSON ({e}); send the arguments the call was given") \
            from None
    if not isinstance(decoded, dict):
        raise ChatTemplateError("messages", f"{where}: must be a JSON object, got {arguments_text(decoded)[:80]}")
    return decoded


def render(tokenizer, messages: list[dict], *, tools: list[dict] | None, add_generation_prompt: bool,
           continue_final_message: bool) -> str:
    """The prompt text. continue_final_message: the last message stays open (its text is where the reply goes on)."""
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError("continue_final_message", "continue_final_message=true: needs "
                                                          "add_generation_prompt=false (a new turn or the last one "
                                                          "continued, not both)")
    if continue_final_message and messages[-1]["role"] != "assistant":
        raise ChatTemplateError("continue_final_message", f"continue_final_message=true: the last message must be "
                                                          f"the assistant's to continue, not {messages[-1]['role']!r}")
    if not getattr(tokenizer, "chat_template", None):  # a model without a template (random test models)
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if continue_final_message:
            return text.removesuffix("\n")
        return text + ("assistant:" if add_generation_prompt else "")
    try:
        return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        raise ChatTemplateError("messages", f"messages: the model's chat template refused them: {e}") from None
