"""Limits before work (router/core.py RouterLimits, router/http.py, router/grpc_server.py): a body over
--max-request-bytes is 413 before it is parsed, a gRPC message over --max-grpc-message-bytes is RESOURCE_EXHAUSTED
before it is parsed, a prompt over --max-prompt-bytes or with a lone surrogate is 400 before it is tokenized, a
request fanning out past --max-sub-requests is 400 before any sub-request starts, JSON nested too deeply is 400, and
long prompts are tokenized in a worker thread, not on the event loop. Over a scripted backend (no services)."""
import asyncio
import socket
import threading

import grpc
import httpx
import pytest

from protos.tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from router.core import RouterCore, RouterLimits
from router.grpc_server import start_grpc_server
from router.http import create_app
from router.server import main as router_main
from scripted_backend import Scripted


@pytest.fixture
def anyio_backend():
    return "asyncio"


def client(backend=None, limits=RouterLimits(), **app_kwargs) -> httpx.AsyncClient:
    app = create_app(RouterCore(backend or Scripted(), limits), **app_kwargs)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


def error(r: httpx.Response) -> tuple[int, str | None, str]:
    e = r.json()["error"]
    return r.status_code, e["param"], e["message"]


@pytest.mark.anyio
async def test_a_body_over_the_limit_is_413_declared_or_streamed(anyio_backend):
    async with client(max_request_bytes=1000) as c:
        declared = await c.post("/v1/completions", content=b'{"prompt": "' + b"a" * 2000 + b'"}',
                                headers={"content-type": "application/json"})

        async def chunks():
            for _ in range(10):
                yield b" " * 500

        streamed = await c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        small = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert declared.status_code == 413 and "2014 bytes, more than the 1000" in error(declared)[2]
    assert streamed.status_code == 413 and "more than the 1000 bytes" in error(streamed)[2]
    assert small.status_code == 200


def test_a_grpc_message_over_the_limit_is_resource_exhausted_naming_the_flag():
    """The public server takes 16 MiB by default (the workers' internal ones 512 MiB: KV blocks)."""
    async def main():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{s.getsockname()[1]}"
        server = await start_grpc_server(RouterCore(Scripted()), address)
        try:
            async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as ch:
                stub = generate_pb2_grpc.GenerateStub(ch)

                async def generate(prompt: str):
                    req = generate_pb2.GenerateRequest(prompt=prompt, params=common_pb2.SamplingParams(max_tokens=3))
                    try:
                        return "".join([r.delta.text async for r in stub.Generate(req, timeout=30)])
                    except grpc.aio.AioRpcError as e:
                        return e.code(), e.details()
                return await generate("x" * (20 << 20)), await generate("hi")
        finally:
            await server.stop(0)

    (code, details), small = asyncio.run(main())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details == ("tandem.v1.Generate.Generate: tandem.v1.GenerateRequest: request message: 20971529 bytes, "
                       "more than the 16777216 this server takes (--max-grpc-message-bytes)")
    assert small == "abc"


@pytest.mark.parametrize("value", ["0", str(1 << 30)])
def test_the_grpc_message_limit_is_checked_at_start(value, capsys):
    with pytest.raises(SystemExit) as ei:
        router_main(["--colocated", "--max-grpc-message-bytes", value])
    assert ei.value.code == 2
    assert f"--max-grpc-message-bytes={value}: must be in [1, 536870912]" in capsys.readouterr().err


@pytest.mark.anyio
async def test_prompts_are_checked_before_they_are_tokenized(anyio_backend):
    backend = Scripted()
    calls = []
    tokenizer = backend.tokenizer
    backend.tokenizer = lambda text, **kw: calls.append(len(text)) or tokenizer(text, **kw)
    async with client(backend, RouterLimits(max_prompt_bytes=100)) as c:
        long = await c.post("/v1/completions", json={"prompt": "é" * 60})  # 60 characters, 120 bytes
        surrogate = await c.post("/v1/completions", content=b'{"prompt": "ab\\ud800cd"}',
                                 headers={"content-type": "application/json"})
        chat = await c.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
                            headers={"content-type": "application/json"})
        tok = await c.post("/tokenize", json={"prompt": "x" * 101})
    assert error(long) == (400, "prompt", "prompt: 120 bytes, more than the 100 a prompt may have (--max-prompt-bytes)")
    assert error(surrogate) == (400, "prompt", "prompt: not valid text: a lone UTF-16 surrogate ('\\ud800') at "
                                               "character 2")
    assert error(chat)[:2] == (400, "messages") and "lone UTF-16 surrogate" in error(chat)[2]
    assert error(tok)[:2] == (400, "prompt") and "101 characters" in error(tok)[2]
    assert calls == []  # the tokenizer saw none of them


@pytest.mark.anyio
async def test_fan_out_past_the_limit_starts_nothing(anyio_backend):
    backend = Scripted()
    async with client(backend, RouterLimits(max_sub_requests=256)) as c:
        big = await c.post("/v1/completions", json={"prompt": ["hi"] * 100, "n": 128})
        ok = await c.post("/v1/completions", json={"prompt": ["hi"] * 16, "n": 16, "max_tokens": 3})
    async with client(backend, RouterLimits(max_sub_requests=64)) as c:
        one = await c.post("/v1/completions", json={"prompt": "hi", "n": 100})
    assert error(big) == (400, "n", "n: 100 prompts x n=128 = 12800 completions, more than the 256 one request may "
                                    "ask for (--max-sub-requests)")
    assert error(one) == (400, "n", "n: n=100 completions, more than the 64 one request may ask for "
                                    "(--max-sub-requests)")
    assert ok.status_code == 200 and len(backend.served) == 256  # only the request within the limit ran


@pytest.mark.anyio
async def test_json_nested_too_deeply_is_400(anyio_backend):
    async with client() as c:
        r = await c.post("/v1/completions", content=b"[" * 100_000 + b"]" * 100_000,
                         headers={"content-type": "application/json"})
    assert error(r) == (400, None, "malformed JSON in the request body: nested too deeply")


@pytest.mark.anyio
async def test_long_prompts_are_tokenized_off_the_event_loop(anyio_backend):
    backend = Scripted()
    threads = []
    tokenizer = backend.tokenizer
    backend.tokenizer = lambda text, **kw: threads.append((len(text), threading.current_thread())) or tokenizer(
        text, **kw)
    async with client(backend) as c:
        for prompt in ("short", "word " * 10_000):
            await c.post("/tokenize", json={"prompt": prompt})
    (short, t_short), (long, t_long) = threads
    assert t_short is threading.main_thread() and t_long is not threading.main_thread(), threads


@pytest.mark.anyio
async def test_values_the_wire_cannot_carry_are_400_naming_the_field(anyio_backend):
    async with client() as c:
        top_k = await c.post("/v1/completions", json={"prompt": "hi", "top_k": 2**31})
        seed = await c.post("/v1/completions", json={"prompt": "hi", "seed": 2**63})
    assert error(top_k)[:2] == (400, "top_k") and error(seed)[:2] == (400, "seed"), (top_k.text, seed.text)


@pytest.mark.anyio
async def test_token_ids_outside_the_vocabulary_are_400_before_echo_decodes_them(anyio_backend):
    async with client() as c:
        got = [await c.post("/v1/completions", json={"prompt": [bad], "echo": True}) for bad in (-1, 2**40, 512)]
    for r, bad in zip(got, (-1, 2**40, 512)):
        assert error(r) == (400, "prompt_token_ids", f"prompt_token_ids: token id {bad} is outside the vocabulary "
                                                     "[0, 512)"), r.text
