"""--api-key on the router's two public APIs (serving/auth.py), over a scripted backend: HTTP answers 401 in
OpenAI's error shape without the right `Authorization: Bearer` key, except on the open paths; gRPC answers
UNAUTHENTICATED without the right `authorization` metadata, with health left open."""
import asyncio
import socket

import grpc
import httpx
import pytest

from protos.tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from router.core import RouterCore
from router.grpc_server import start_grpc_server
from router.http import create_app
from scripted_backend import Scripted
from serving import health
from serving.auth import ENV_API_KEY, ApiKey

KEY = "s3cret-key"


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def _client(**app_kwargs):
    app = create_app(RouterCore(Scripted()), ApiKey(KEY), **app_kwargs)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


@pytest.mark.anyio
async def test_http_needs_the_key_except_on_open_paths(anyio_backend):
    body = {"prompt": "hi", "max_tokens": 3}
    async with await _client() as c:
        missing = await c.post("/v1/completions", json=body)
        wrong = await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        not_bearer = await c.post("/v1/completions", json=body, headers={"Authorization": KEY})
        right = await c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        models = await c.get("/v1/models")
        health_, livez, metrics = await c.get("/health"), await c.get("/livez"), await c.get("/metrics")
    for r in (missing, wrong, not_bearer, models):
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert right.status_code == 200 and right.json()["choices"][0]["text"] == "abc"
    assert health_.status_code == livez.status_code == metrics.status_code == 200


@pytest.mark.anyio
async def test_no_open_paths_protects_health_too(anyio_backend):
    async with await _client(open_paths=()) as c:
        assert (await c.get("/health")).status_code == 401
        assert (await c.get("/health", headers={"Authorization": f"Bearer {KEY}"})).status_code == 200


def test_grpc_needs_the_key_and_health_stays_open():
    async def main():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{s.getsockname()[1]}"
        core = RouterCore(Scripted())
        server = await start_grpc_server(core, address, api_key=ApiKey(KEY))
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                stub = generate_pb2_grpc.GenerateStub(ch)

                async def list_models(metadata):
                    try:
                        return list((await stub.ListModels(generate_pb2.ListModelsRequest(), metadata=metadata)).models)
                    except grpc.aio.AioRpcError as e:
                        return e.code()

                async def generate(metadata):
                    req = generate_pb2.GenerateRequest(prompt="hi", params=common_pb2.SamplingParams(max_tokens=3))
                    try:
                        return "".join([r.delta.text async for r in stub.Generate(req, metadata=metadata)])
                    except grpc.aio.AioRpcError as e:
                        return e.code()

                good = (("authorization", f"Bearer {KEY}"),)
                bad = (("authorization", "Bearer nope"),)
                return (await list_models(good), await list_models(None), await list_models(bad),
                        await generate(good), await generate(None), await health.check_callable(ch)("", timeout=5))
        finally:
            await server.stop(0)

    unauth = grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(main()) == (["tiny"], unauth, unauth, "abc", unauth, health.SERVING)


def test_the_key_comes_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_API_KEY, raising=False)
    assert ApiKey.from_flag(None) is None
    assert ApiKey.from_flag("k").matches("Bearer k")
    monkeypatch.setenv(ENV_API_KEY, "from-env")
    assert ApiKey.from_flag(None).matches(b"Bearer from-env") and not ApiKey.from_flag(None).matches("Bearer k")
    assert ApiKey.from_flag("flag-wins").matches("Bearer flag-wins")
    with pytest.raises(ValueError, match="api_key: must not be empty"):
        ApiKey("")
