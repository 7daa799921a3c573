"""KV transfer through NIXL on the CPU, end to end: a real decode process and two real prefill processes, one started
with `--kv-transfer nixl` (UCX between the agents over loopback / shared memory on this machine), one with
`--kv-transfer grpc`, driven the way the router drives them. Greedy tokens must be the same on both paths and equal
`engine.LLM`'s; every NIXL transfer reports the NIXL path and moves no KV byte over gRPC. Then the test process acts
as a prefill with its own NIXL agent: forged block ids and a forged cache region fail alone, naming the field; a
transfer that never commits is ended by the decode's deadline; and a decode killed during a transfer fails the
prefill's request. No block stays held on either side. Skipped when nixl_cu12 cannot be imported or its UCX backend
does not initialise."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from kv_transfer import nixl
from kv_transfer.cuda_ipc import host_identity
from protos.tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kv_transfer_pb2 as kv, prefill_pb2
from protos.tandem.v1 import prefill_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from ports import free_ports  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# float32: greedy tokens are decided far from rounding; chunks of 48 tokens, so a 100-token prompt is prefilled, and
# shipped, in three runs.
ENGINE = dict(model="random:tiny", device="cpu", dtype="float32", num_gpu_blocks_override=256, block_size=16,
              max_model_len=1024, max_num_batched_tokens=48, max_num_seqs=16)
PROMPT_LENS = (5, 40, 100)
MAX_TOKENS = 12


def _nixl_refusal() -> str | None:
    reason = nixl.import_error()
    if reason is None:
        try:
            nixl.NixlCache(torch.zeros(1, 1, 2, 1, 1, 8), "tandem-test-probe")
        except Exception as exc:  # noqa: BLE001
            reason = f"nixl's UCX backend did not initialise: {type(exc).__name__}: {exc}"
    return reason




def test_merged_runs_join_blocks_consecutive_on_both_sides():
    assert nixl.merged_runs([4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 7, 8]) == [(4, 0, 3), (9, 3, 1), (10, 7, 1), (2, 8, 1)]
    assert nixl.merged_runs(list(range(100, 164)), list(range(64))) == [(100, 0, 64)]
    assert nixl.merged_runs([], []) == []


def test_kv_transfer_nixl_without_the_package_is_refused_naming_flag_and_package(monkeypatch):
    from kv_transfer.sender import KvSender
    monkeypatch.setattr(nixl, "import_error", lambda: "the nixl-cu12 package cannot be imported (ImportError: x)")
    with pytest.raises(ValueError, match=r"--kv-transfer nixl: the nixl-cu12 package cannot be imported"):
        KvSender(torch.zeros(4, 2, 2, 16, 2, 16), "nixl")


def test_auto_offers_no_nixl_for_a_cpu_cache():  # (today's choice: bytes)
    from kv_transfer.sender import KvSender
    assert KvSender(torch.zeros(4, 2, 2, 16, 2, 16), "auto").nixl is None


def flags() -> list[str]:
    out = []
    for k, v in ENGINE.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


@pytest.fixture(scope="module")
def stack():
    reason = _nixl_refusal()
    if reason is not None:
        pytest.skip(reason)
    dport, nport, gport, dm, nm, gm = free_ports(6)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    logs = {name: tmp / f"tandem-nixl-{name}-{os.getpid()}.log" for name in ("decode", "nixl", "grpc")}

    def start(name, module, port, metrics, *extra):
        return subprocess.Popen([sys.executable, "-m", module, "--port", str(port), "--metrics-port", str(metrics),
                                 *extra, *flags()], cwd=ROOT, env=env, stdout=logs[name].open("w"),
                                stderr=subprocess.STDOUT)

    procs = {"decode": start("decode", "decode_svc.server", dport, dm),
             "nixl": start("nixl", "prefill_svc.server", nport, nm, "--kv-transfer", "nixl"),
             "grpc": start("grpc", "prefill_svc.server", gport, gm, "--kv-transfer", "grpc")}

    def tail() -> str:
        return "\n".join(f"== {k}\n{p.read_text()[-3000:]}" for k, p in logs.items())

    async def ready() -> bool:
        try:
            for port, stub in ((dport, decode_pb2_grpc.DecodeStub), (nport, prefill_pb2_grpc.PrefillStub),
                               (gport, prefill_pb2_grpc.PrefillStub)):
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                    await stub(ch).GetLoad(common_pb2.GetLoadRequest(), timeout=2)
            return True
        except grpc.aio.AioRpcError:
            return False

    try:
        deadline = time.monotonic() + 180
        while not asyncio.run(ready()):
            dead = [n for n, p in procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                pytest.fail(f"{dead or 'stack'} not serving:\n{tail()}")
            time.sleep(0.5)
        yield dict(decode=f"127.0.0.1:{dport}", nixl=f"127.0.0.1:{nport}", grpc=f"127.0.0.1:{gport}",
                   metrics={"decode": dm, "nixl": nm, "grpc": gm}, procs=procs, tail=tail)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def path_bytes(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {"grpc": 0.0, "ipc": 0.0, "nixl": 0.0}
    for m in re.finditer(r'^tandem:kv_transfer_path_bytes_total\{([^}]*)\} (\S+)$', text, re.M):
        out[re.search(r'path="(\w+)"', m.group(1)).group(1)] += float(m.group(2))
    return out


def params(max_tokens: int = MAX_TOKENS) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def serve_one(stack, prefill: str, rid: str, prompt: list[int]):
    """What the router does for one request: reserve on decode, prefill with the decode target, join the streams."""
    async with grpc.aio.insecure_channel(stack["decode"]) as dch, grpc.aio.insecure_channel(stack[prefill]) as pch:
        dcall = decode_pb2_grpc.DecodeStub(dch).Decode(decode_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=prompt, params=params(), kv_transfer_timeout_ms=60_000))
        assert (await dcall.read()).HasField("reserved")
        resps = [r async for r in prefill_pb2_grpc.PrefillStub(pch).Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, params=params(), decode_address=stack["decode"],
            kv_transfer_timeout_ms=60_000))]
        tokens = list(resps[0].first_token.delta.token_ids)
        while (r := await dcall.read()) is not grpc.aio.EOF:
            tokens += r.delta.token_ids
        return tokens, resps[-1].transfer_done


async def idle_load(address: str, stub) -> common_pb2.GetLoadResponse:
    """GetLoad once nothing is held (or as it stands after a generous deadline)."""
    async with grpc.aio.insecure_channel(address) as ch:
        deadline = time.monotonic() + 30
        while True:
            load = await stub(ch).GetLoad(common_pb2.GetLoadRequest())
            if (load.num_used_blocks == 0 and load.num_tracked_requests == 0) or time.monotonic() > deadline:
                return load
            await asyncio.sleep(0.1)


@pytest.mark.slow
def test_nixl_tokens_equal_the_grpc_path_and_the_offline_engine(stack):
    from engine import LLM, SamplingParams

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(300, 500, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    expected = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                   ignore_eos=True))]
    before = {k: path_bytes(p) for k, p in stack["metrics"].items()}

    async def scenario():
        via_grpc = [await serve_one(stack, "grpc", f"g{i}", p) for i, p in enumerate(prompts)]
        # The decode now holds the prompts' full blocks in its prefix cache: these reuse them (the leading blocks
        # are not read again), then all at once, batched on both sides.
        hits = [await serve_one(stack, "nixl", f"h{i}", p) for i, p in enumerate(prompts)]
        fresh = [torch.randint(100, 300, (n,), generator=gen).tolist() for n in PROMPT_LENS]
        many = await asyncio.gather(*(serve_one(stack, "nixl", f"n{i}", p) for i, p in enumerate(fresh)))
        return via_grpc, hits, fresh, list(many)

    via_grpc, hits, fresh, many = asyncio.run(scenario())
    after = {k: path_bytes(p) for k, p in stack["metrics"].items()}
    fresh_expected = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(
        [{"prompt_token_ids": p} for p in fresh], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                 ignore_eos=True))]
    assert [t for t, _ in via_grpc] == expected, stack["tail"]()
    assert [t for t, _ in hits] == expected, stack["tail"]()
    assert [t for t, _ in many] == fresh_expected, stack["tail"]()
    block_bytes = ENGINE["block_size"] * 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x head_dim x float32
    nixl_done = [done for _, done in hits + many]
    for done, n in zip(nixl_done, PROMPT_LENS * 2):
        assert done.path == kv.KV_TRANSFER_PATH_NIXL
        assert done.num_blocks == -(-n // 16) and done.transfer_bytes == done.num_blocks * block_bytes
    assert all(done.path == kv.KV_TRANSFER_PATH_GRPC for _, done in via_grpc)
    assert after["nixl"]["grpc"] == before["nixl"]["grpc"]  # no KV byte of the nixl prefill went over gRPC
    assert after["nixl"]["nixl"] - before["nixl"]["nixl"] == sum(d.transfer_bytes for d in nixl_done)
    for addr, stub in ((stack["decode"], decode_pb2_grpc.DecodeStub), (stack["nixl"], prefill_pb2_grpc.PrefillStub)):
        load = asyncio.run(idle_load(addr, stub))
        assert load.num_used_blocks == 0 and load.num_tracked_requests == 0, load


class FakePrefill:
    """The test process as a prefill instance with its own NIXL agent: a cache of 8 blocks registered, offered to
    the decode instance in a real handshake."""

    def __init__(self, layout: kv.KvLayout, name: str, claim_blocks: int | None = None):
        shape = (8, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.kv_cache = torch.randn(shape)
        self.cache = nixl.NixlCache(self.kv_cache, name)
        self.offer = self.cache.offer()
        if claim_blocks is not None:
            self.offer.num_blocks = claim_blocks  # a lie: more blocks than it registered
        self.layout = layout

    async def handshake(self, decode) -> kv.KvHandshakeResponse:
        return await decode.KvHandshake(kv.KvHandshakeRequest(host=host_identity(), layout=self.layout,
                                                              nixl=self.offer, nixl_on_one_host=True))

    def open(self, rid: str, n_tokens: int, **nixl_fields) -> kv.KvTransferMessage:
        desc = kv.NixlCache()
        desc.CopyFrom(self.offer)
        desc.ClearField("agent_metadata")
        for k, v in nixl_fields.items():
            setattr(desc, k, v)
        return kv.KvTransferMessage(open=kv.KvTransferOpen(
            request_id=rid, layout=self.layout, num_prompt_tokens=n_tokens, num_blocks=-(-n_tokens // 16),
            deadline_ms=20_000, path=kv.KV_TRANSFER_PATH_NIXL, nixl=desc))


async def _code(awaitable):
    try:
        await awaitable
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    return "OK"


async def _reserve(decode, rid: str, n_tokens: int, timeout_ms: int = 20_000):
    call = decode.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=[3] * n_tokens,
                                                  params=params(4), kv_transfer_timeout_ms=timeout_ms))
    assert (await call.read()).HasField("reserved")
    return call


@pytest.mark.slow
def test_forged_descriptors_fail_alone_and_a_deadline_frees_both_sides(stack):
    from kv_transfer.layout import layout_of
    layout = layout_of(torch.zeros(1, 2, 2, 16, 2, 16))  # random:tiny's layout in float32
    ready = kv.KvTransferMessage

    async def scenario():
        out = {}
        async with grpc.aio.insecure_channel(stack["decode"]) as dch:
            decode = decode_pb2_grpc.DecodeStub(dch)
            honest = FakePrefill(layout, "tandem-test-honest")
            assert (await honest.handshake(decode)).path == kv.KV_TRANSFER_PATH_NIXL

            async def forged(rid, open_msg, block_ids):
                call = await _reserve(decode, rid, 20)

                async def messages():
                    yield open_msg
                    yield ready(ready=kv.KvBlocksReady(first_block_index=0, block_ids=block_ids))
                    yield ready(commit=kv.KvTransferCommit(first_token_id=5))
                return await _code(decode.TransferKv(messages())), await _code(call.read())

            out["block id"] = await forged("f-id", honest.open("f-id", 20), [1, 8])
            out["base"] = await forged("f-base", honest.open("f-base", 20, base_address=honest.offer.base_address
                                                             + 4096), [0, 1])
            out["unknown agent"] = await forged("f-agent", honest.open("f-agent", 20, agent_name="nobody"), [0, 1])
            # A peer whose handshake claims more blocks than it registered: NIXL refuses the read past its memory.
            liar = FakePrefill(layout, "tandem-test-liar", claim_blocks=1 << 20)
            assert (await liar.handshake(decode)).path == kv.KV_TRANSFER_PATH_NIXL
            out["unregistered"] = await forged("f-reg", liar.open("f-reg", 20), [0, 4000])
            out["honest"] = await forged("ok", honest.open("ok", 20), [2, 3])

            # Deadline: a transfer that reads its blocks and never commits.
            call = await _reserve(decode, "late", 20, timeout_ms=1500)
            stop = asyncio.Event()

            async def messages():
                yield honest.open("late", 20)
                yield ready(ready=kv.KvBlocksReady(first_block_index=0, block_ids=[0, 1]))
                await stop.wait()
            transfer = asyncio.ensure_future(_code(decode.TransferKv(messages())))
            out["deadline"] = await _code(call.read())
            stop.set()
            out["deadline transfer"] = await transfer
            out["load"] = await idle_load(stack["decode"], decode_pb2_grpc.DecodeStub)
        return out

    out = asyncio.run(scenario())
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert out["block id"][0][0] == invalid and "ready.block_ids: 8 is past" in out["block id"][0][1], out
    assert out["base"][0][0] == invalid and out["base"][0][1].startswith("open.nixl.base_address="), out
    assert out["unknown agent"][0][0] == grpc.StatusCode.FAILED_PRECONDITION, out
    assert "open.nixl.agent_name='nobody'" in out["unknown agent"][0][1], out
    assert out["unregistered"][0][0] == invalid and "NIXL refused the read" in out["unregistered"][0][1], out
    for case in ("block id", "base", "unknown agent", "unregistered"):
        assert out[case][1][0] == invalid or out[case][1][0] == grpc.StatusCode.FAILED_PRECONDITION, out
    assert out["honest"] == ("OK", "OK"), out  # (the decode stream ends after its 4 tokens)
    assert out["deadline"][0] == grpc.StatusCode.DEADLINE_EXCEEDED, out
    assert out["deadline transfer"] != "OK", out
    assert out["load"].num_used_blocks == 0 and out["load"].num_tracked_requests == 0, out["load"]


def test_a_tensor_parallel_prefills_ranks_are_not_read_by_a_single_rank_decode(stack):
    """A tensor-parallel prefill offers each rank's cache (nixl_ranks): a decode of another size answers GRPC (whole
    blocks through rank 0) rather than read rank 0's half-head blocks as whole ones."""
    from kv_transfer.layout import layout_of
    layout = layout_of(torch.zeros(1, 2, 2, 16, 2, 16))

    async def scenario():
        async with grpc.aio.insecure_channel(stack["decode"]) as dch:
            ranks = [FakePrefill(layout, f"tandem-test-tp-rank{r}") for r in range(2)]
            return await decode_pb2_grpc.DecodeStub(dch).KvHandshake(kv.KvHandshakeRequest(
                host=host_identity(), layout=layout, nixl=ranks[0].offer, nixl_ranks=[p.offer for p in ranks],
                nixl_on_one_host=True))

    answer = asyncio.run(scenario())
    assert answer.path == kv.KV_TRANSFER_PATH_GRPC
    assert "the prefill is tensor-parallel (2 ranks), this decode instance is not" in answer.reason


@pytest.mark.slow
def test_a_decode_killed_during_a_transfer_fails_the_prefill_request_and_frees_its_blocks(stack):
    """(Last: it kills the decode process.) The decode is stopped, so the transfer opens into its socket and waits,
    then killed: the prefill's request fails, whatever part of the transfer it had reached."""
    prompt = torch.randint(300, 500, (300,), generator=torch.Generator().manual_seed(9)).tolist()
    decode_proc = stack["procs"]["decode"]

    async def scenario():
        async with grpc.aio.insecure_channel(stack["decode"]) as dch, \
                grpc.aio.insecure_channel(stack["nixl"]) as pch:
            dcall = decode_pb2_grpc.DecodeStub(dch).Decode(decode_pb2.DecodeRequest(
                request_id="doomed", prompt_token_ids=prompt, params=params(), kv_transfer_timeout_ms=60_000))
            assert (await dcall.read()).HasField("reserved")
            os.kill(decode_proc.pid, signal.SIGSTOP)
            prefill = prefill_pb2_grpc.PrefillStub(pch).Prefill(prefill_pb2.PrefillRequest(
                request_id="doomed", prompt_token_ids=prompt, params=params(), decode_address=stack["decode"],
                kv_transfer_timeout_ms=60_000))
            first = await prefill.read()  # the first token: the prefill is done, its transfer under way
            assert first.HasField("first_token")
            decode_proc.kill()  # (SIGKILL ends a stopped process)
            decode_proc.wait(30)
            code = await _code(_drain(prefill))
            return code, await idle_load(stack["nixl"], prefill_pb2_grpc.PrefillStub)

    code, load = asyncio.run(scenario())
    assert code != "OK" and code[0] in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED,
                                        grpc.StatusCode.CANCELLED), code
    assert "decode" in code[1], code
    assert load.num_used_blocks == 0 and load.num_tracked_requests == 0, load


async def _drain(call):
    while await call.read() is not grpc.aio.EOF:
        pass

