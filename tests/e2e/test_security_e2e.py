"""TLS and the API key end to end: `tandem up --tls-cert --tls-key --tls-ca --api-key` with a throwaway CA (trustme).
The official OpenAI SDK talks HTTPS to the router with the key and gets the same greedy tokens as the offline engine,
and is refused (401) with another key; the public gRPC API serves TLS and wants the key; every internal hop is mutual
TLS: each worker refuses a plaintext client and a client whose certificate another CA signed, and answers one with
our certificate (the router's and the prefill's hops work, or nothing would be served). The key is on no command
line `tandem up` prints."""
from __future__ import annotations

import asyncio
import ssl

import grpc
import httpx
import pytest

from engine import LLM, SamplingParams
from protos.tandem.v1 import common_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc, prefill_pb2_grpc
from serving.rpc import channel
from stack import Stack
from tls_pki import make_pki

trustme = pytest.importorskip("trustme")
openai = pytest.importorskip("openai")

PROMPT = "The capital of France is"
KEY = "e2e-api-key"
AUTH = (("authorization", f"Bearer {KEY}"),)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def stack(pki):
    tls = pki["server"]
    s = Stack("--model", "random:tiny", "--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca,
              "--api-key", KEY, decode=1, scheme="https").wait_ready()
    yield s
    s.stop()


def test_the_openai_sdk_over_https_equals_the_offline_engine(stack, pki):
    expected = LLM(model="random:tiny", device="cpu").generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))
    with httpx.Client(verify=ssl.create_default_context(cafile=pki["client"].ca), timeout=120) as http:
        client = openai.OpenAI(base_url=f"{stack.http}/v1", api_key=KEY, http_client=http)
        got = client.completions.create(model="random:tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                                        extra_body={"return_tokens_as_token_ids": True})
        stranger = openai.OpenAI(base_url=f"{stack.http}/v1", api_key="not-the-key", http_client=http)
        with pytest.raises(openai.AuthenticationError) as refused:
            stranger.completions.create(model="random:tiny", prompt=PROMPT, max_tokens=8)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    assert not any(KEY in line for line in stack.lines if line.startswith("tandem up: started"))
    ids = [int(t.removeprefix("token_id:")) for t in got.choices[0].logprobs.tokens]
    assert ids == expected[0].outputs[0].token_ids
    assert got.usage.completion_tokens == 8


def test_plain_http_to_the_https_port_is_refused(stack):
    with pytest.raises(httpx.HTTPError):
        httpx.get(stack.http.replace("https://", "http://") + "/health", timeout=10).raise_for_status()


def test_the_public_grpc_api_serves_tls_and_refuses_plaintext(stack, pki):
    async def generate(ch, metadata=AUTH):
        req = generate_pb2.GenerateRequest(prompt=PROMPT, params=common_pb2.SamplingParams(temperature=0, max_tokens=4))
        try:
            stub = generate_pb2_grpc.GenerateStub(ch)
            return sum([len(r.delta.token_ids) async for r in stub.Generate(req, timeout=60, metadata=metadata)])
        except grpc.aio.AioRpcError as e:
            return e.code()

    async def main():
        ca = open(pki["client"].ca, "rb").read()
        async with grpc.aio.secure_channel(stack.grpc, grpc.ssl_channel_credentials(root_certificates=ca)) as ch:
            tls = await generate(ch)
            no_key = await generate(ch, metadata=None)
        async with channel(stack.grpc) as ch:
            plain = await generate(ch)
        return tls, no_key, plain

    assert asyncio.run(main()) == (4, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE)


@pytest.mark.parametrize("worker", ["prefill-0", "decode-0"])
def test_every_worker_admits_only_our_certificates(stack, pki, worker):
    stub = prefill_pb2_grpc.PrefillStub if worker.startswith("prefill") else decode_pb2_grpc.DecodeStub
    address = f"127.0.0.1:{stack.worker_ports[worker]}"

    async def load(tls):
        async with channel(address, tls) as ch:
            try:
                return (await stub(ch).GetLoad(common_pb2.GetLoadRequest(), timeout=10)).role
            except grpc.aio.AioRpcError as e:
                return e.code()

    async def main():
        return [await load(tls) for tls in (pki["client"], None, pki["stranger"])]

    assert asyncio.run(main()) == [worker.split("-")[0], grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]
