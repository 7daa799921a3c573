"""Tool-call parsers, one module per model family's format (`--tool-call-parser`, vLLM's names)."""
from __future__ import annotations

from router.tool_parsers.base import Event, ToolCall, ToolParser
from router.tool_parsers.hermes import HermesParser
from router.tool_parsers.llama3_json import Llama3JsonParser

PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}

__all__ = ["PARSERS", "Event", "ToolCall", "ToolParser"]
