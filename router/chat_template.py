"""A chat request's messages (and tools) through the model's chat template, as the text of the prompt.

Messages go to the template as HuggingFace's templates read them: role and content; an assistant turn's
`tool_calls` with `function.arguments` decoded to an object (Qwen2.5's and Llama 3.1's templates write it with
`tojson`: text would come out quoted twice); a tool result's `tool_call_id` and `name`. Tools go in `tools=`; a
template that has no place for them (SmolLM2's, ChatML without tools) leaves them out, as vLLM lets it: the model
then does not see them (`tool_choice` required or named still holds its output to a call). A template that refuses
the messages (Llama 3.1's raises on two calls in one turn) is a 400 naming `messages`.

One piece for every chat entry point: the HTTP chat endpoint and /tokenize (router/openai_serving.py) and the gRPC
Chat RPC (router/grpc_server.py, through `Chat` and `prompt_ids`), so that the same messages become the same prompt
on both APIs. `chat_template_kwargs` (vLLM's) are more template variables; one that names an apply_chat_template
parameter of its own (tokenize, return_tensors, ...) is refused.
"""
from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

from router.core import RequestError, RouterCore
from router.tool_parsers.base import arguments_text

# apply_chat_template's own parameters: a template variable of one of these names would change how it runs (tokenize,
# return_tensors, ...) rather than what the template sees.
_RESERVED = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"kwargs"} | {
    "messages"}


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


def check_template_kwargs(kwargs: Any, name: str = "chat_template_kwargs") -> dict[str, Any]:
    if not isinstance(kwargs, dict):
        raise ChatTemplateError(name, f"{name}: must be a JSON object")
    if reserved := sorted(_RESERVED & set(kwargs)):
        raise ChatTemplateError(name, f"{name}: {', '.join(reserved)}: reserved (set them as request fields, if at "
                                      "all)")
    return kwargs


def render(tokenizer, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True,
           continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text. continue_final_message: the last message stays open (its text is where the reply goes on)."""
    if not messages:
        raise ChatTemplateError("messages", "messages: must not be empty")
    kwargs = check_template_kwargs(chat_template_kwargs or {})
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
                                             continue_final_message=continue_final_message, **kwargs)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        raise ChatTemplateError("messages", f"messages: the model's chat template refused them: {e}") from None


@dataclass(frozen=True)
class Chat:
    """A chat as the gRPC Chat RPC receives it."""
    messages: list[dict]
    """As `template_messages` makes them, oldest first."""
    tools: list[dict] | None = None
    """OpenAI's tool dicts, for the template to render."""
    add_generation_prompt: bool = True
    """Open an assistant turn after the messages."""
    continue_final_message: bool = False
    """Leave the last message open, for the model to continue it."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the template."""


def kwargs_from_json(text: str, name: str = "chat_template_kwargs_json") -> dict[str, Any]:
    """A JSON object's text as template variables; empty text: none."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise RequestError("invalid_argument", name, f"{name}: not JSON ({e})") from None
    try:
        return check_template_kwargs(value, name)
    except ChatTemplateError as e:
        raise RequestError("invalid_argument", e.field, str(e)) from None


async def prompt_ids(core: RouterCore, chat: Chat) -> list[int]:
    """`chat`'s prompt token ids, checked against --max-prompt-bytes and tokenized by the core (off the event loop
    when long). The template already put in the special tokens it wants: none are added."""
    try:
        text = render(core.tokenizer, chat.messages, tools=chat.tools,
                      add_generation_prompt=chat.add_generation_prompt,
                      continue_final_message=chat.continue_final_message,
                      chat_template_kwargs=chat.chat_template_kwargs)
    except ChatTemplateError as e:
        raise RequestError("invalid_argument", e.field, str(e)) from None
    return await core.tokenize(text, "messages", add_special_tokens=False)
