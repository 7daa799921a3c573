"""A chat's messages -> the prompt token ids the model runs, through the served model's chat template. One piece for
every chat entry point: the HTTP chat endpoint and /tokenize (router/openai_serving.py) and the gRPC Chat RPC
(router/grpc_server.py), so that the same messages become the same prompt on both APIs.

Errors are RequestError naming the field (HTTP 400, gRPC INVALID_ARGUMENT): no messages, continue_final_message with
add_generation_prompt, chat_template_kwargs that are no JSON object or name one of apply_chat_template's own
parameters, and a chat the template itself refuses (a template that raises on roles that do not alternate).
"""
from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

from router.core import RequestError, RouterCore

# apply_chat_template's own parameters: a template variable of one of these names would change how it runs (tokenize,
# return_tensors, ...) rather than what the template sees.
_RESERVED = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"kwargs"} | {
    "messages"}


@dataclass(frozen=True)
class Chat:
    messages: list[dict[str, str]]
    """{"role": ..., "content": ...}, oldest first."""
    add_generation_prompt: bool = True
    """Open an assistant turn after the messages."""
    continue_final_message: bool = False
    """Leave the last message open, for the model to continue it."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the template."""

    def __post_init__(self) -> None:
        if not self.messages:
            raise RequestError("invalid_argument", "messages", "messages: must not be empty")
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestError("invalid_argument", "continue_final_message",
                               "continue_final_message: cannot be true with add_generation_prompt true (one continues "
                               "the last message, the other opens a new one); set add_generation_prompt false")
        if not isinstance(self.chat_template_kwargs, dict):
            raise RequestError("invalid_argument", "chat_template_kwargs",
                               "chat_template_kwargs: must be a JSON object")
        if reserved := sorted(_RESERVED & set(self.chat_template_kwargs)):
            raise RequestError("invalid_argument", "chat_template_kwargs",
                               f"chat_template_kwargs: {', '.join(reserved)}: reserved (set them as request fields, "
                               "if at all)")


def kwargs_from_json(text: str, name: str = "chat_template_kwargs_json") -> dict[str, Any]:
    """A JSON object's text as template variables; empty text: none."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise RequestError("invalid_argument", name, f"{name}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise RequestError("invalid_argument", name, f"{name}: must be a JSON object, not {type(value).__name__}")
    return value


def render(tokenizer, chat: Chat) -> str:
    """The prompt text of `chat`: the tokenizer's template, or for a model without one (random test models) a plain
    transcript, "role: content" a line."""
    if not getattr(tokenizer, "chat_template", None):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in chat.messages)
        if chat.continue_final_message:
            return text.removesuffix("\n")
        return text + ("assistant:" if chat.add_generation_prompt else "")
    try:
        return tokenizer.apply_chat_template(chat.messages, tokenize=False,
                                             add_generation_prompt=chat.add_generation_prompt,
                                             continue_final_message=chat.continue_final_message,
                                             **chat.chat_template_kwargs)
    except (jinja2.TemplateError, ValueError, TypeError) as e:  # (the template's raise_exception is a TemplateError)
        raise RequestError("invalid_argument", "messages",
                           f"messages: the model's chat template refused them: {e}") from None


async def prompt_ids(core: RouterCore, chat: Chat) -> list[int]:
    """`chat`'s prompt token ids, checked against --max-prompt-bytes and tokenized by the core (off the event loop
    when long). The template already put in the special tokens it wants: none are added."""
    return await core.tokenize(render(core.tokenizer, chat), "messages", add_special_tokens=False)
