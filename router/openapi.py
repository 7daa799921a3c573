"""The router's OpenAPI document (`/openapi.json`): what FastAPI derives from the routes, plus what it cannot see.

The POST routes read their bodies by hand (router/http.py `_parse`: the body-size limit, malformed JSON and pydantic
errors answered in OpenAI's error shape, naming the field), so FastAPI sees no body parameter. Each such route
declares its body here instead: `request_body(Model)` goes in the route's `openapi_extra` as a `$ref` to
`#/components/schemas/<Model>`, and `install()` puts every declared model's JSON schema (validation mode, its
`$defs` hoisted into components/schemas so every ref resolves) into the document FastAPI builds. `responses()` is the
route's declared answers: its 200 model, the event stream when it streams, and OpenAI's error JSON for each error
status it can give.
"""
from __future__ import annotations

from collections.abc import Iterable

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from router.openai_protocol import ErrorResponse

REF = "#/components/schemas/{model}"

# Every error status the HTTP API answers (in OpenAI's error JSON), and why.
ERRORS = {
    400: "bad input: malformed JSON, a wrong type or value, or an OpenAI feature this server lacks; `param` names "
         "the field",
    401: "missing or wrong API key (only when the router runs with --api-key)",
    404: "the model named is not served here",
    413: "the request body is larger than --max-request-bytes",
    429: "too many requests: the router is at its limit; retry later",
    503: "no prefill or decode instance can serve the request now, or the router is shutting down",
}
GENERATE_ERRORS = (400, 401, 404, 413, 429, 503)
TOKENIZE_ERRORS = (400, 401, 404, 413)


def request_body(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra`: its JSON body is `model` (registered by install())."""
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def responses(ok: type[BaseModel] | None, errors: Iterable[int], stream: str | None = None) -> dict:
    """A route's `responses`: 200 as `ok` (and as a `stream` body of that media type when the request asks to
    stream), and each error status in `errors` as OpenAI's error JSON."""
    out: dict[int, dict] = {status: {"model": ErrorResponse, "description": ERRORS[status]} for status in errors}
    if ok is not None:
        out[200] = {"model": ok, "description": f"the answer, {ok.__name__}"}
    if stream is not None:
        ok_200 = out.setdefault(200, {"description": "the answer"})
        ok_200["description"] += f"; with stream=true, {stream}"
        ok_200["content"] = {stream: {"schema": {"type": "string"}}}
    return out


def install(app: FastAPI, bodies: Iterable[type[BaseModel]]) -> None:
    """Makes app.openapi() add the JSON schema of each request body model to the document's components."""
    bodies = tuple(bodies)
    done: list[dict] = []

    def openapi() -> dict:
        doc = FastAPI.openapi(app)  # (cached by FastAPI until the routes change)
        if not done or done[0] is not doc:
            _add_schemas(doc, bodies)
            done[:] = [doc]
        return doc

    app.openapi = openapi


def _add_schemas(doc: dict, models: tuple[type[BaseModel], ...]) -> None:
    _, top = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in top.get("$defs", {}).items():
        if name in schemas and schemas[name] != schema:
            raise RuntimeError(f"OpenAPI components/schemas/{name}: two different models by that name")
        schemas[name] = schema
