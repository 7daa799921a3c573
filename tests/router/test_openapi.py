"""router/openapi.py: /openapi.json describes every request body the routes parse by hand (each POST path's body
resolves to its pydantic model's fields), the answers they give (200 models, OpenAI's error JSON for each error
status), and is a valid OpenAPI 3.1 document whose every `$ref` resolves."""
import asyncio

import httpx
import pytest

from router.core import RouterCore
from router.http import create_app
from router.openai_protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                    CompletionResponse, DetokenizeRequest, DetokenizeResponse, SimpleGenerateRequest,
                                    SimpleGenerateResponse, TokenizeRequest, TokenizeResponse)
from scripted_backend import Scripted

POSTS = {"/v1/completions": (CompletionRequest, CompletionResponse),
         "/v1/chat/completions": (ChatCompletionRequest, ChatCompletionResponse),
         "/generate": (SimpleGenerateRequest, SimpleGenerateResponse),
         "/tokenize": (TokenizeRequest, TokenizeResponse),
         "/detokenize": (DetokenizeRequest, DetokenizeResponse)}
PREFIX = "#/components/schemas/"


@pytest.fixture(scope="module")
def doc():
    async def fetch():
        transport = httpx.ASGITransport(app=create_app(RouterCore(Scripted())))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            r = await c.get("/openapi.json")
        assert r.status_code == 200
        return r.json()

    return asyncio.run(fetch())


def resolve(doc: dict, schema: dict) -> dict:
    ref = schema["$ref"]
    assert ref.startswith(PREFIX), ref
    return doc["components"]["schemas"][ref[len(PREFIX):]]


def refs(node):
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for v in node.values():
            yield from refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from refs(v)


def test_every_post_path_has_its_models_body_and_answers(doc):
    posts = {path for path, item in doc["paths"].items() if "post" in item}
    assert posts == set(POSTS)
    for path, (model, answer) in POSTS.items():
        op = doc["paths"][path]["post"]
        body = op["requestBody"]
        assert body["required"] is True
        schema = resolve(doc, body["content"]["application/json"]["schema"])
        assert set(schema["properties"]) == set(model.model_fields), path
        assert set(schema.get("required", ())) == {n for n, f in model.model_fields.items() if f.is_required()}
        ok = op["responses"]["200"]["content"]["application/json"]["schema"]
        assert set(resolve(doc, ok)["properties"]) == set(answer.model_fields), path
        statuses = {"400", "401", "404", "413"} | ({"429", "503"} if answer not in (TokenizeResponse,
                                                                                    DetokenizeResponse) else set())
        assert statuses <= set(op["responses"]), (path, op["responses"].keys())
        for status in statuses:
            error = resolve(doc, op["responses"][status]["content"]["application/json"]["schema"])
            assert set(resolve(doc, error["properties"]["error"])["properties"]) == {"message", "type", "param",
                                                                                   "code"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "text/event-stream" in doc["paths"][path]["post"]["responses"]["200"]["content"]


def test_the_gets_are_documented_as_they_answer(doc):
    paths = doc["paths"]
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    health = paths["/health"]["get"]["responses"]
    assert {resolve(doc, health[s]["content"]["application/json"]["schema"])["title"] for s in ("200", "503")} == {
        "HealthStatus"}
    assert resolve(doc, paths["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"])[
        "title"] == "ModelList"
    for path in ("/v1/models", "/version"):
        assert "401" in paths[path]["get"]["responses"]


def test_the_stop_bounds_are_in_the_schema(doc):
    stop = doc["components"]["schemas"]["CompletionRequest"]["properties"]["stop"]["anyOf"]
    assert {"type": "string", "maxLength": 1024} in stop
    assert {"type": "array", "items": {"type": "string", "maxLength": 1024}, "maxItems": 64} in stop


def test_nested_models_and_field_docs_are_in_the_components(doc):
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    messages = chat["properties"]["messages"]
    assert messages["type"] == "array" and messages["minItems"] == 1 and "messages" in chat["required"]
    message = resolve(doc, messages["items"])
    assert set(message["properties"]) == {"role", "content", "tool_calls", "tool_call_id", "name"}
    prompt = {s.get("type") for s in doc["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"]}
    assert prompt == {"string", "array"}
    assert "[DONE]" in resolve(doc, doc["components"]["schemas"]["CompletionRequest"]["properties"]["stream_options"]
                               ["anyOf"][0])["properties"]["include_usage"]["description"]


def test_the_document_is_valid_openapi_3_1_and_every_ref_resolves(doc):
    jsonschema = pytest.importorskip("jsonschema")
    from schemathesis.specs.openapi.definitions import OPENAPI_31

    jsonschema.Draft202012Validator(OPENAPI_31).validate(doc)
    for name, schema in doc["components"]["schemas"].items():
        jsonschema.Draft202012Validator.check_schema(schema)
    for ref in refs(doc):
        assert ref.startswith(PREFIX) and ref[len(PREFIX):] in doc["components"]["schemas"], ref
    assert "$defs" not in str(doc)  # hoisted: nothing points inside a model's own schema


def test_schemathesis_loads_every_operation(doc):
    schemathesis = pytest.importorskip("schemathesis")
    schema = schemathesis.openapi.from_dict(doc)
    schema.validate()
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in ops} >= {("POST", p) for p in POSTS} | {("GET", "/health")}
    for op in ops:
        if op.method.upper() == "POST":
            assert [b.media_type for b in op.body] == ["application/json"], op.path
