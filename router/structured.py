"""Structured-output fields of the OpenAI-compatible bodies -> the engine's StructuredOutputsParams.

A request may constrain its output in one of three spellings, all mapped here onto the one constraint the engine
runs (engine/sampling_params.py, StructuredOutputsParams):
- OpenAI's `response_format`: {"type": "text"} (none), {"type": "json_object"}, {"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}}, and vLLM's {"type": "structural_tag", ...};
- vLLM's `structured_outputs` object (StructuredOutputsParams' fields);
- vLLM's legacy `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (+ `guided_whitespace_pattern`).
At most one constraint per request (400 naming both otherwise); a `structured_outputs` object that names no kind
only gives its options (`disable_any_whitespace`, ...) to the constraint of another spelling, as vLLM merges
`response_format` into it. Checking a constraint parses it with xgrammar, which
takes time that grows with its size: `prepare` does it on a worker thread before the endpoint is built, and the
body keeps the result (or the error, raised as a 400 where the sampling parameters are built).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr

from engine.sampling_params import StructuredOutputsParams

_LEGACY = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_LEGACY_KIND = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                "guided_grammar": "grammar"}
_KINDS = {"json", "regex", "choice", "grammar", "json_object", "structural_tag"}


class StructuredFields(BaseModel):
    """The request fields that constrain the output (mixed into the generating bodies)."""
    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)

    response_format: dict[str, Any] | None = None
    """OpenAI's: {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's: exactly one of json, regex, choice, grammar, json_object, structural_tag, and JSON options."""
    guided_json: str | dict[str, Any] | None = None
    """vLLM's legacy: a JSON schema the output follows."""
    guided_regex: str | None = None
    """vLLM's legacy: a regex the output matches."""
    guided_choice: list[str] | None = None
    """vLLM's legacy: the output is one of these strings."""
    guided_grammar: str | None = None
    """vLLM's legacy: an EBNF grammar the output belongs to."""
    guided_whitespace_pattern: str | None = None
    """vLLM's legacy: a whitespace regex for JSON (the xgrammar backend refuses it)."""

    _structured: tuple | None = PrivateAttr(default=None)  # (params or None, error or None), set by prepare

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The constraint, or None; raises ValueError naming the request field."""
        if self._structured is None:
            self._structured = _build(self)
        params, error = self._structured
        if error is not None:
            raise error
        return params


async def prepare(body) -> None:
    """Checks the body's constraint on a worker thread (a no-op for a body without one)."""
    if not isinstance(body, StructuredFields) or not (_sources(body) or body.structured_outputs):
        return
    body._structured = await asyncio.to_thread(_build, body)


def _sources(body: StructuredFields) -> list[str]:
    names = [n for n in _LEGACY if getattr(body, n) is not None]
    if body.structured_outputs is not None and _KINDS & set(body.structured_outputs):
        names.append("structured_outputs")
    rf = body.response_format
    if rf is not None and rf.get("type") != "text":
        names.append("response_format")
    return names


def _build(body: StructuredFields) -> tuple:
    try:
        return _params(body), None
    except ValueError as e:
        return None, e


def _params(body: StructuredFields) -> StructuredOutputsParams | None:
    sources = _sources(body)
    if not sources:
        if body.guided_whitespace_pattern is not None:
            raise ValueError("guided_whitespace_pattern: applies only with guided_json or a JSON response_format")
        if body.structured_outputs:
            raise ValueError("structured_outputs: names no constraint (one of json, regex, choice, grammar, "
                             "json_object, structural_tag), and no response_format or guided_* field gives one")
        return None
    if len(sources) > 1:
        raise ValueError(f"{sources[0]}: give one output constraint, not also {', '.join(sources[1:])}")
    source = sources[0]
    ws = body.guided_whitespace_pattern
    if source == "response_format":
        field, kw = _response_format(body.response_format)
    elif source == "structured_outputs":
        field, kw = "structured_outputs", dict(body.structured_outputs)
    else:
        field, kw = source, {_LEGACY_KIND[source]: getattr(body, source)}
    if ws is not None:
        kw.setdefault("whitespace_pattern", ws)
    if source != "structured_outputs" and body.structured_outputs:  # options only (see the module docstring)
        kw = {**body.structured_outputs, **kw}
    try:
        return StructuredOutputsParams.from_dict(kw)
    except TypeError as e:  # a field of the wrong shape that from_dict passed on
        raise ValueError(f"{field}: {e}") from None
    except ValueError as e:
        msg = str(e)
        if field != "structured_outputs":  # name the field the client sent, not the engine's
            head, _, rest = msg.partition(": ")
            msg = f"{field}: {rest}" if head.startswith("structured_outputs") else f"{field}: {msg}"
        raise ValueError(msg) from None


def _response_format(rf: dict[str, Any]) -> tuple[str, dict]:
    kind = rf.get("type")
    if kind == "json_object":
        return "response_format", {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema: required with type json_schema, an object with "
                             "name and schema")
        schema = spec.get("schema")
        if schema is None:  # OpenAI's SDK of old sent the schema as json_schema.json_schema
            schema = spec.get("json_schema")
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema: required, a JSON schema object")
        return "response_format.json_schema.schema", {"json": schema}
    if kind == "structural_tag":
        tag = {k: v for k, v in rf.items() if k != "type"}
        return "response_format", {"structural_tag": json.dumps(tag)}
    raise ValueError(f"response_format.type={kind!r}: must be one of text, json_object, json_schema, "
                     "structural_tag")
