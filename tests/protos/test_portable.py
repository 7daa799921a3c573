"""The .proto files compile anywhere with `protoc -I protos`: nothing in them names this repository's layout, each
names its Go and Java package, and the Python protoc writes from a copy of them imports on its own and talks to a
live router (Generate, and Chat, whose output equals the HTTP chat endpoint's for the same messages)."""
from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest

from protos.tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from stack import Stack  # noqa: E402  (tests/e2e's helpers)

PROTOS = Path(__file__).resolve().parents[2] / "protos"
FILES = sorted((PROTOS / "tandem" / "v1").glob("*.proto"))
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
MAX_TOKENS = 8


@pytest.mark.parametrize("proto", FILES, ids=lambda p: p.name)
def test_imports_are_relative_to_protos_and_packages_are_named(proto):
    text = proto.read_text()
    for imported in re.findall(r'^import "([^"]+)";', text, re.M):
        assert (PROTOS / imported).is_file(), f"{proto.name}: import {imported!r} is not relative to protos/"
    assert re.search(r'^option go_package = "[^"]+/tandem/v1;tandemv1";', text, re.M), proto.name
    assert re.search(r'^option java_package = "[\w.]+";', text, re.M), proto.name


def _compile_a_copy(tmp_path: Path) -> Path:
    """The .proto files copied out of the repository and compiled there with grpcio-tools; returns the output dir.
    protoc runs in a child, as a user runs it: grpc_tools.protoc.main inside this process (whose protobuf runtime
    already holds the committed stubs and every other test's state) ended the whole test run with a segfault."""
    grpc_tools = pytest.importorskip("grpc_tools")

    src, out = tmp_path / "include", tmp_path / "gen"
    shutil.copytree(PROTOS / "tandem", src / "tandem", ignore=shutil.ignore_patterns("*.py", "*.pyi", "__pycache__"))
    out.mkdir()
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(src)) for p in sorted(src.rglob("*.proto"))]
    r = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{src}", f"-I{well_known}",
                        f"--python_out={out}", f"--grpc_python_out={out}", *files], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return out


def test_a_copy_compiles_with_protoc_and_imports_alone(tmp_path):
    out = _compile_a_copy(tmp_path)
    # Isolated mode: neither the repository nor the current directory is on the path; only the generated code.
    code = (f"import sys; sys.path.insert(0, {str(out)!r}); "
            "from tandem.v1 import decode_pb2, decode_pb2_grpc, generate_pb2_grpc, prefill_pb2_grpc; "
            "m = decode_pb2.DecodeRequest(request_id='x'); "
            "assert decode_pb2.DecodeRequest.FromString(m.SerializeToString()).request_id == 'x'; "
            "print(decode_pb2.DESCRIPTOR.name)")
    r = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "tandem/v1/decode.proto"


def test_committed_stubs_register_the_same_file_names():
    from protos.tandem.v1 import decode_pb2, generate_pb2

    assert decode_pb2.DESCRIPTOR.name == "tandem/v1/decode.proto"
    assert generate_pb2.DESCRIPTOR.dependencies[0].name == "tandem/v1/common.proto"


# ------------------------------------------------------------------------------------------- against a live router
# Run in a child in isolated mode, with only the generated code on the path (the committed stubs register the same
# file names in this process's descriptor pool): Generate and Chat, greedy and seeded, as a user's client would.
_CLIENT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import grpc
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc

def run(stub, method, request):
    toks, text = [], ""
    for r in getattr(stub, method)(request, timeout=120):
        toks += r.delta.token_ids
        text += r.delta.text
    return {"token_ids": toks, "text": text, "prompt_tokens": r.usage.prompt_tokens}

with grpc.insecure_channel(sys.argv[2]) as ch:
    stub = generate_pb2_grpc.GenerateStub(ch)
    messages = [generate_pb2.ChatMessage(**m) for m in json.loads(sys.argv[3])]
    greedy = common_pb2.SamplingParams(temperature=0, max_tokens=int(sys.argv[4]))
    seeded = common_pb2.SamplingParams(temperature=1.0, seed=7, max_tokens=int(sys.argv[4]))
    print(json.dumps({
        "models": list(stub.ListModels(generate_pb2.ListModelsRequest()).models),
        "generate": run(stub, "Generate", generate_pb2.GenerateRequest(prompt="Once upon a time", params=greedy)),
        "chat": run(stub, "Chat", generate_pb2.ChatRequest(messages=messages, params=greedy)),
        "chat_seeded": run(stub, "Chat", generate_pb2.ChatRequest(messages=messages, params=seeded)),
    }))
"""


@pytest.fixture(scope="module")
def router():
    """`tandem up --colocated --model random:tiny`: one process, the router and its engine."""
    stack = Stack("--colocated", "--model", "random:tiny").wait_ready()
    yield stack
    stack.stop()


def _http_tokens(client: httpx.Client, path: str, **body) -> tuple[list[int], str]:
    r = client.post(path, json={"model": "random:tiny", "max_tokens": MAX_TOKENS, "logprobs": True if path.endswith(
        "chat/completions") else 0, "return_tokens_as_token_ids": True, **body})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if "message" in choice:
        tokens, text = [t["token"] for t in choice["logprobs"]["content"]], choice["message"]["content"]
    else:
        tokens, text = choice["logprobs"]["tokens"], choice["text"]
    return [int(t.removeprefix("token_id:")) for t in tokens], text


@pytest.mark.slow
def test_stubs_compiled_outside_call_generate_and_chat_as_http_answers(tmp_path, router):
    out = _compile_a_copy(tmp_path)
    r = subprocess.run([sys.executable, "-I", "-c", _CLIENT, str(out), router.grpc, json.dumps(MESSAGES),
                        str(MAX_TOKENS)], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    with httpx.Client(base_url=router.http, timeout=120) as client:
        completion = _http_tokens(client, "/v1/completions", prompt="Once upon a time", temperature=0)
        chat = _http_tokens(client, "/v1/chat/completions", messages=MESSAGES, temperature=0)
        seeded = _http_tokens(client, "/v1/chat/completions", messages=MESSAGES, temperature=1.0, seed=7)
        chat_prompt = client.post("/tokenize", json={"model": "random:tiny", "messages": MESSAGES}).json()["count"]
    assert got["models"] == ["random:tiny"]
    assert (got["generate"]["token_ids"], got["generate"]["text"]) == completion
    assert (got["chat"]["token_ids"], got["chat"]["text"]) == chat
    assert (got["chat_seeded"]["token_ids"], got["chat_seeded"]["text"]) == seeded
    assert got["chat"]["prompt_tokens"] == chat_prompt
    assert len(got["chat"]["token_ids"]) == MAX_TOKENS and got["chat"]["token_ids"] != got["chat_seeded"]["token_ids"]


async def _chat(address: str, **kwargs) -> list[int]:
    async with grpc.aio.insecure_channel(address) as ch:
        toks = []
        async for r in generate_pb2_grpc.GenerateStub(ch).Chat(generate_pb2.ChatRequest(**kwargs), timeout=120):
            toks += r.delta.token_ids
        return toks


@pytest.mark.slow
def test_chat_continues_the_final_message_as_http_does(router):
    messages = [*MESSAGES, {"role": "assistant", "content": "Blue is"}]
    greedy = common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    toks = asyncio.run(_chat(router.grpc, messages=[generate_pb2.ChatMessage(**m) for m in messages], params=greedy,
                             continue_final_message=True))
    with httpx.Client(base_url=router.http, timeout=120) as client:
        expected, _ = _http_tokens(client, "/v1/chat/completions", messages=messages, temperature=0,
                                   continue_final_message=True, add_generation_prompt=False)
        opened, _ = _http_tokens(client, "/v1/chat/completions", messages=messages, temperature=0)
    assert toks == expected and toks != opened


BAD_CHATS = [
    (dict(), "INVALID_ARGUMENT", "messages"),
    (dict(messages=[generate_pb2.ChatMessage(role="user", content="hi")], continue_final_message=True,
          add_generation_prompt=True), "INVALID_ARGUMENT", "continue_final_message"),
    (dict(messages=[generate_pb2.ChatMessage(role="user", content="hi")], chat_template_kwargs_json="{nope"),
     "INVALID_ARGUMENT", "chat_template_kwargs_json"),
    (dict(messages=[generate_pb2.ChatMessage(role="user", content="hi")], chat_template_kwargs_json="[1]"),
     "INVALID_ARGUMENT", "chat_template_kwargs_json"),
    (dict(messages=[generate_pb2.ChatMessage(role="user", content="hi")],
          chat_template_kwargs_json='{"tokenize": true}'), "INVALID_ARGUMENT", "chat_template_kwargs_json"),
    (dict(messages=[generate_pb2.ChatMessage(role="user", content="hi")],
          params=common_pb2.SamplingParams(top_p=2.0)), "INVALID_ARGUMENT", "top_p"),
    (dict(messages=[generate_pb2.ChatMessage(role="user", content="hi" * 5000)]), "INVALID_ARGUMENT", "messages"),
    (dict(model="gpt-17", messages=[generate_pb2.ChatMessage(role="user", content="hi")]), "NOT_FOUND", "model"),
]


@pytest.mark.slow
@pytest.mark.parametrize("kwargs,code,field", BAD_CHATS, ids=[f"{f}-{i}" for i, (_, _, f) in enumerate(BAD_CHATS)])
def test_a_bad_chat_is_refused_naming_the_field_and_the_router_stays_up(router, kwargs, code, field):
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        asyncio.run(_chat(router.grpc, **kwargs))
    assert ei.value.code().name == code, ei.value.details()
    assert re.match(rf"^{field}\b", ei.value.details()), ei.value.details()
    assert asyncio.run(_chat(router.grpc, messages=[generate_pb2.ChatMessage(role="user", content="ok")],
                             params=common_pb2.SamplingParams(max_tokens=2)))
