"""Every gRPC method of every Tandem process, fuzzed end to end (`tandem up`: a real router, prefill and decode
process): REQUESTS_PER_METHOD random, mutated and raw requests per method and process (proto_fuzz.py), health and
reflection included, sent as raw bytes through a generic channel so that nothing on our side checks them first.
TransferKv gets streams: a real reservation, then a legitimate transfer with its messages mutated, reordered,
repeated, cut or cut short, or random messages and bytes with or without a reservation. All of it concurrently,
every method's requests mixed.

What must hold: no call ends UNKNOWN or INTERNAL (nor UNAVAILABLE from a live server), and every refusal says why in
a message that arrives; every process is alive at the end and back to the load it had before (no block, request or
reservation left); a greedy request after the fuzz gets the tokens it got before; and the logs hold no traceback per
bad request (serving/errors.py logs repeated failures once per interval, with a count), no huge or injected lines.
gRPC's client-side INTERNAL for a write that raced the server's end of a stream (CLIENT_WRITE_RACE) is counted
apart: the server's answer never reached us.
"""
from __future__ import annotations

import asyncio
import collections
import random
import time
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import strategies as st

import proto_fuzz as pf
from engine import EngineArgs, LLMEngine
from kv_transfer.layout import layout_of
from kv_transfer.sender import CLIENT_WRITE_RACE  # gRPC's own client-side INTERNAL: not the server's answer
from protos.tandem.v1 import common_pb2, decode_pb2, generate_pb2, kv_transfer_pb2 as kv, prefill_pb2
from serving import health as health_codec
from stack import Stack, alive

pytestmark = pytest.mark.slow

REQUESTS_PER_METHOD = 300  # per method and process (health: on each of the three)
IN_FLIGHT = 48  # calls at once: most of the slow ones wait (a reservation for its KV, an open for its reservation)
POOL_BLOCKS = 1024  # each worker's KV pool: small enough that the fuzz also meets a full pool
CALL_TIMEOUT_S = 4.0
DECODE_TIMEOUT_S = 1.5  # a reservation the fuzz made is held this long, then cancelled
MAX_TRACEBACKS = 3
# A refusal is fine; these mean a handler raised something nobody mapped (or gRPC failed to parse it).
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
# A live server never answers UNAVAILABLE itself: from a worker (or the router's own methods) it means the connection
# went (a crash, a GOAWAY). Only the router's Generate may pass it on ("no healthy instance").
MAY_BE_UNAVAILABLE = {"router Generate/Generate", "router Generate/Chat"}
PARSE_ERROR = "not a valid message"
# A refusal names the field, not the whole of a huge value: a status message past 8-16 KiB never arrives (the client
# answers RESOURCE_EXHAUSTED "received metadata size exceeds ... limit" and drops the connection). The services cut
# theirs at serving.errors.MAX_MESSAGE_WIRE_BYTES.
MAX_DETAILS_CHARS = 4096
TOO_LONG_DETAILS = "metadata size exceeds"
MAX_LOG_LINE_CHARS = 2000  # the logs quote what callers sent in short (serving.errors.shown)
MAX_LOG_LINES = 1500  # (about 400 in a run: start-up, and a line per failed transfer or handshake)
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
REFLECTION_V1 = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"  # (the same messages on the wire)
LEGIT_PROMPT = [7, 300, 42, 42, 42, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 5, 6]
VOCAB = 512  # random:tiny's


@pytest.fixture(scope="module")
def stack():
    s = Stack("--model", "random:tiny", "--num-gpu-blocks-override", str(POOL_BLOCKS), prefill=1, decode=1)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def layout():
    """random:tiny's KV layout, as every worker of the stack has it (its cache: float32 on the CPU)."""
    engine = LLMEngine.from_engine_args(EngineArgs(model="random:tiny", device="cpu", num_gpu_blocks_override=128))
    return layout_of(engine.kv_cache)


# ---- what is sent ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Method:
    name: str  # for the report: "<process> <Service>/<Method>"
    target: str  # "router" or a worker name of Stack.worker_ports
    path: str  # "/tandem.v1.Decode/Decode"
    kind: str  # unary | stream (server-streaming) | bidi (lists of requests) | transfer (TransferPlans)
    timeout_s: float = CALL_TIMEOUT_S


@dataclass(frozen=True)
class TransferPlan:
    """One TransferKv stream: a reservation for `reserve_tokens` prompt tokens first (0: none), then `messages`, each
    serialized and its bytes mutated. Opens whose request_id is "rid" get the reservation's id."""
    reserve_tokens: int
    messages: tuple[tuple[kv.KvTransferMessage | bytes, pf.ByteMutation], ...]


def _service(module, name: str):
    return module.DESCRIPTOR.services_by_name[name]


def methods() -> list[Method]:
    out = []
    for target, module, service, kinds in (
            ("router", generate_pb2, "Generate", {"Generate": "stream", "Chat": "stream", "Tokenize": "unary",
                                                     "ListModels": "unary"}),
            ("prefill-0", prefill_pb2, "Prefill", {"Prefill": "stream", "GetLoad": "unary"}),
            ("decode-0", decode_pb2, "Decode", {"Decode": "stream", "TransferKv": "transfer", "KvHandshake": "unary",
                                                "GetLoad": "unary"})):
        svc = _service(module, service)
        for m in svc.methods:
            timeout = DECODE_TIMEOUT_S if (service, m.name) == ("Decode", "Decode") else CALL_TIMEOUT_S
            out.append(Method(f"{target} {service}/{m.name}", target, f"/{svc.full_name}/{m.name}", kinds[m.name],
                              timeout))
    for target in ("router", "prefill-0", "decode-0"):
        out.append(Method(f"{target} Health/Check", target, health_codec.CHECK_METHOD, "unary"))
        out.append(Method(f"{target} Reflection/ServerReflectionInfo", target, REFLECTION, "bidi"))
        out.append(Method(f"{target} ReflectionV1/ServerReflectionInfo", target, REFLECTION_V1, "bidi"))
    return out


def _params(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**{"temperature": 0.0, "max_tokens": 4, **kw})


def seeds(method: Method, decode_address: str, layout) -> list:
    """Legitimate requests of `method`, for the mutations to start from."""
    prompt = LEGIT_PROMPT[:9]
    host = kv.HostIdentity(boot_id="b", hostname="fuzz", process_id="p", pid=1)
    return {
        "Generate": [generate_pb2.GenerateRequest(prompt_token_ids=prompt, params=_params()),
                     generate_pb2.GenerateRequest(model="random:tiny", prompt="Hello there", params=_params(n=2))],
        "Chat": [generate_pb2.ChatRequest(messages=[generate_pb2.ChatMessage(role="user", content="Hi")],
                                          params=_params()),
                 generate_pb2.ChatRequest(model="random:tiny", params=_params(n=2), add_generation_prompt=False,
                                          continue_final_message=True, chat_template_kwargs_json='{"x": [1, "y"]}',
                                          messages=[generate_pb2.ChatMessage(role="system", content="Be brief."),
                                                    generate_pb2.ChatMessage(role="assistant", content="Sure")])],
        "Tokenize": [generate_pb2.TokenizeRequest(text="Hello there")],
        "ListModels": [generate_pb2.ListModelsRequest()],
        "Prefill": [prefill_pb2.PrefillRequest(request_id="fuzz-p", prompt_token_ids=prompt, params=_params()),
                    # (the Decode seed's id and prompt: when two such requests of the fuzz meet, a real transfer)
                    prefill_pb2.PrefillRequest(request_id="fuzz-d", prompt_token_ids=prompt, params=_params(),
                                               decode_address=decode_address, kv_transfer_timeout_ms=1000)],
        "GetLoad": [common_pb2.GetLoadRequest()],
        "Decode": [decode_pb2.DecodeRequest(request_id="fuzz-d", prompt_token_ids=prompt, params=_params(),
                                            kv_transfer_timeout_ms=1000)],
        "KvHandshake": [kv.KvHandshakeRequest(host=host, layout=layout),
                        kv.KvHandshakeRequest(host=host, layout=layout, cache=kv.CudaIpcCache(
                            host=host, device_uuid="GPU-0", mem_handle=b"\x01" * 64, storage_size_bytes=1 << 20,
                            num_blocks=16))],
    }[method.path.rsplit("/", 1)[1]]




def request_strategy(method: Method, decode_address: str, layout) -> st.SearchStrategy:
    if method.kind == "transfer":
        return transfer_plans(layout)
    if method.kind == "bidi":
        from grpc_reflection.v1alpha import reflection_pb2 as rp

        R = rp.ServerReflectionRequest
        reflection_seeds = [R(list_services=""), R(file_containing_symbol="tandem.v1.Decode"),
                            R(file_by_filename="protos/tandem/v1/common.proto"),
                            R(file_containing_extension=rp.ExtensionRequest(containing_type="tandem.v1.KvLayout",
                                                                            extension_number=5)),
                            R(all_extension_numbers_of_type="tandem.v1.KvLayout")]
        return st.lists(pf.request_bytes(R.DESCRIPTOR, reflection_seeds), min_size=1, max_size=4)
    if method.path == health_codec.CHECK_METHOD:
        from grpc_health.v1 import health_pb2

        names = ["", "tandem.v1.Generate", "tandem.v1.Prefill", "tandem.v1.Decode", "nope"]
        return pf.request_bytes(health_pb2.HealthCheckRequest.DESCRIPTOR,
                                [health_pb2.HealthCheckRequest(service=n) for n in names])
    module = {"router": generate_pb2, "prefill-0": prefill_pb2, "decode-0": decode_pb2}[method.target]
    service = module.DESCRIPTOR.services_by_name[method.path.split("/")[1].rsplit(".", 1)[1]]
    desc = service.methods_by_name[method.path.rsplit("/", 1)[1]].input_type
    return pf.request_bytes(desc, seeds(method, decode_address, layout))


# ---- TransferKv streams ----------------------------------------------------------------------------------------
def legit_transfer(layout, num_tokens: int, runs: list[int], first_token: int) -> list[kv.KvTransferMessage]:
    """What a prefill instance sends for a reservation of num_tokens: the open, the blocks in runs of the given sizes
    (the last run takes what is left), the commit."""
    num_blocks = -(-num_tokens // layout.block_size)
    msgs = [kv.KvTransferMessage(open=kv.KvTransferOpen(request_id="rid", layout=layout, num_prompt_tokens=num_tokens,
                                                        num_blocks=num_blocks, deadline_ms=3000))]
    first = 0
    for size in runs + [num_blocks]:
        n = min(size, num_blocks - first)
        if n <= 0:
            break
        msgs.append(kv.KvTransferMessage(blocks=kv.KvBlocks(first_block_index=first, num_blocks=n,
                                                            data=bytes(n * layout.block_bytes))))
        first += n
    msgs.append(kv.KvTransferMessage(commit=kv.KvTransferCommit(first_token_id=first_token)))
    return msgs


_SEQUENCE_OPS = ["drop", "duplicate", "swap", "insert", "mutate", "bytes", "reopen", "past_end", "short_data",
                 "commit_first", "ready", "ipc_path", "no_commit"]


@st.composite
def _mutated_sequence(draw, layout) -> TransferPlan:
    """A legitimate transfer for a real reservation, with zero to three of _SEQUENCE_OPS applied."""
    tokens = draw(st.integers(1, 90))
    runs, first_token = draw(st.lists(st.integers(1, 3), max_size=4)), draw(st.integers(0, VOCAB - 1))
    msgs = legit_transfer(layout, tokens, runs, first_token)
    mutations = [pf.ByteMutation("none")] * len(msgs)
    num_blocks = msgs[0].open.num_blocks
    for _ in range(draw(st.integers(0, 3))):
        op, i = draw(st.sampled_from(_SEQUENCE_OPS)), draw(st.integers(0, len(msgs) - 1))
        if op == "drop" and len(msgs) > 1:
            del msgs[i], mutations[i]
        elif op == "duplicate":
            msgs.insert(i, msgs[i])
            mutations.insert(i, mutations[i])
        elif op == "swap":
            j = draw(st.integers(0, len(msgs) - 1))
            msgs[i], msgs[j] = msgs[j], msgs[i]
            mutations[i], mutations[j] = mutations[j], mutations[i]
        elif op == "insert":
            msgs.insert(i, draw(pf.message(kv.KvTransferMessage.DESCRIPTOR)))
            mutations.insert(i, pf.ByteMutation("none"))
        elif op == "mutate":
            msgs[i] = draw(pf.mutated_message([msgs[i]]))
        elif op == "bytes":
            mutations[i] = draw(pf.byte_mutations())
        elif op == "reopen":
            msgs.insert(i, msgs[0])
            mutations.insert(i, pf.ByteMutation("none"))
        elif op == "past_end":
            n = draw(st.integers(1, 3))
            first = num_blocks - draw(st.integers(0, 1))
            msgs.insert(i, kv.KvTransferMessage(blocks=kv.KvBlocks(first_block_index=first, num_blocks=n,
                                                                   data=bytes(n * layout.block_bytes))))
            mutations.insert(i, pf.ByteMutation("none"))
        elif op == "short_data":
            msgs.insert(i, kv.KvTransferMessage(blocks=kv.KvBlocks(first_block_index=0, num_blocks=1,
                                                                   data=bytes(layout.block_bytes - 1))))
            mutations.insert(i, pf.ByteMutation("none"))
        elif op == "commit_first":
            msgs.insert(0, msgs[-1])
            mutations.insert(0, pf.ByteMutation("none"))
        elif op == "ready":
            msgs.insert(i, kv.KvTransferMessage(ready=kv.KvBlocksReady(first_block_index=0, block_ids=[0, 1])))
            mutations.insert(i, pf.ByteMutation("none"))
        elif op == "ipc_path":  # (on whatever is first now: a message that was no open becomes one)
            op_msg = kv.KvTransferMessage()
            op_msg.CopyFrom(msgs[0])
            op_msg.open.path = draw(st.sampled_from([kv.KV_TRANSFER_PATH_CUDA_IPC, 7, -1]))
            msgs[0] = op_msg
        elif op == "no_commit":
            msgs = msgs[:-1] or msgs
            mutations = mutations[:len(msgs)]
    return TransferPlan(tokens, tuple(zip(msgs, mutations)))


def transfer_plans(layout) -> st.SearchStrategy[TransferPlan]:
    random_items = st.lists(st.tuples(st.one_of(pf.message(kv.KvTransferMessage.DESCRIPTOR), pf.raw_bytes()),
                                      st.one_of(st.just(pf.ByteMutation("none")), pf.byte_mutations())), max_size=6)
    return st.one_of(
        _mutated_sequence(layout), _mutated_sequence(layout),
        st.builds(TransferPlan, st.sampled_from([0, 0, 20]), random_items.map(tuple)),
    )


# ---- sending ---------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    answered: bool  # the call got at least one response


def _raw(msg) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


async def _unary(ch: grpc.aio.Channel, m: Method, raw: bytes) -> Outcome:
    try:
        await ch.unary_unary(m.path)(raw, timeout=m.timeout_s)
    except grpc.aio.AioRpcError as e:
        return Outcome(e.code(), e.details() or "", False)
    return Outcome(grpc.StatusCode.OK, "", True)


async def _stream(ch: grpc.aio.Channel, m: Method, raw: bytes) -> Outcome:
    answered = False
    try:
        async for _ in ch.unary_stream(m.path)(raw, timeout=m.timeout_s):
            answered = True
    except grpc.aio.AioRpcError as e:
        return Outcome(e.code(), e.details() or "", answered)
    return Outcome(grpc.StatusCode.OK, "", answered)


async def _write_all(call, raws) -> None:
    """Writes raws to a client-streaming call until the server ends it (then stops: see CLIENT_WRITE_RACE)."""
    for raw in raws:
        if call.done():
            return
        try:
            await call.write(raw)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return
    if not call.done():
        try:
            await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass


async def _bidi(ch: grpc.aio.Channel, m: Method, raws: list[bytes]) -> Outcome:
    call = ch.stream_stream(m.path)(timeout=m.timeout_s)
    await _write_all(call, raws)
    answered = False
    try:
        while await call.read() is not grpc.aio.EOF:
            answered = True
    except grpc.aio.AioRpcError as e:
        return Outcome(e.code(), e.details() or "", answered)
    return Outcome(grpc.StatusCode.OK, "", answered)


async def _transfer(ch: grpc.aio.Channel, m: Method, plan: TransferPlan, rid: str, record) -> Outcome:
    """The plan's reservation (a Decode call, recorded as "<decode> reservation"), then its stream."""
    reservation = None
    if plan.reserve_tokens:
        req = decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=[3] * plan.reserve_tokens, params=_params(),
                                       kv_transfer_timeout_ms=3000)
        reservation = ch.unary_stream("/tandem.v1.Decode/Decode")(req.SerializeToString(), timeout=2 * CALL_TIMEOUT_S)
        try:
            await reservation.read()
        except grpc.aio.AioRpcError as e:
            record(m.target + " reservation", Outcome(e.code(), e.details() or "", False))
            reservation = None
    raws = []
    for msg, mutation in plan.messages:
        if isinstance(msg, kv.KvTransferMessage) and msg.HasField("open") and msg.open.request_id == "rid":
            msg = kv.KvTransferMessage.FromString(msg.SerializeToString())
            msg.open.request_id = rid
        raws.append(mutation(_raw(msg)))
    call = ch.stream_unary(m.path)(timeout=m.timeout_s)
    await _write_all(call, raws)
    try:
        await call
        out = Outcome(grpc.StatusCode.OK, "", True)
    except grpc.aio.AioRpcError as e:
        out = Outcome(e.code(), e.details() or "", False)
    if reservation is not None:  # its stream: the tokens after a commit, else why it ended
        try:
            while await reservation.read() is not grpc.aio.EOF:
                pass
            record(m.target + " reservation", Outcome(grpc.StatusCode.OK, "", True))
        except grpc.aio.AioRpcError as e:
            record(m.target + " reservation", Outcome(e.code(), e.details() or "", True))
    return out


class Fuzz:
    def __init__(self, stack: Stack):
        self.stack = stack
        self.outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.bad: list[tuple[str, Outcome, bytes | TransferPlan]] = []
        self.sent: collections.Counter = collections.Counter()  # calls
        self.messages: collections.Counter = collections.Counter()  # request messages of the streaming calls
        self.parse_errors: collections.Counter = collections.Counter()
        self.handled: collections.Counter = collections.Counter()  # answered, or refused by the service's own checks

    def address(self, target: str) -> str:
        return self.stack.grpc if target == "router" else f"127.0.0.1:{self.stack.worker_ports[target]}"

    def record(self, name: str, out: Outcome, request=b"") -> None:
        if out.code == grpc.StatusCode.INTERNAL and out.details == CLIENT_WRITE_RACE:
            self.outcomes[name]["client write race"] += 1
            return
        self.outcomes[name][out.code.name] += 1
        if PARSE_ERROR in out.details:
            self.parse_errors[name] += 1
        elif out.answered or out.code not in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED):
            self.handled[name] += 1
        unavailable = out.code == grpc.StatusCode.UNAVAILABLE and name not in MAY_BE_UNAVAILABLE
        if out.code in FORBIDDEN or unavailable or (out.code != grpc.StatusCode.OK and not out.details) \
                or len(out.details) > MAX_DETAILS_CHARS or TOO_LONG_DETAILS in out.details:
            self.bad.append((name, out, request))

    async def run(self, work: list[tuple[Method, object]]) -> None:
        channels = {t: grpc.aio.insecure_channel(self.address(t), options=[
            ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
            for t in {m.target for m, _ in work}}
        gate = asyncio.Semaphore(IN_FLIGHT)

        async def one(k: int, m: Method, request) -> None:
            async with gate:
                ch = channels[m.target]
                self.sent[m.name] += 1
                if m.kind == "transfer":
                    self.messages[m.name] += len(request.messages)
                    out = await _transfer(ch, m, request, f"fuzz-kv-{k}", self.record)
                elif m.kind == "bidi":
                    self.messages[m.name] += len(request)
                    out = await _bidi(ch, m, request)
                elif m.kind == "stream":
                    out = await _stream(ch, m, request)
                else:
                    out = await _unary(ch, m, request)
                self.record(m.name, out, request)

        try:
            await asyncio.gather(*(one(k, m, r) for k, (m, r) in enumerate(work)))
        finally:
            for ch in channels.values():
                await ch.close()


# ---- checks ----------------------------------------------------------------------------------------------------
async def _loads(stack: Stack) -> dict[str, tuple]:
    out = {}
    for name, port in stack.worker_ports.items():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            service = "Decode" if name.startswith("decode") else "Prefill"
            raw = await ch.unary_unary(f"/tandem.v1.{service}/GetLoad")(b"", timeout=5)
            load = common_pb2.InstanceLoad.FromString(raw)
            out[name] = (load.num_used_blocks, load.num_requests_running, load.num_requests_waiting,
                         load.num_tracked_requests)
    return out


async def _settled_loads(stack: Stack, baseline: dict | None, timeout_s: float = 30.0) -> dict[str, tuple]:
    """The workers' loads once equal to baseline (None: once nothing is held), or the last ones after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = await _loads(stack)
        if (loads == baseline if baseline else all(v == (0, 0, 0, 0) for v in loads.values())) \
                or time.monotonic() > deadline:
            return loads
        await asyncio.sleep(0.2)


async def _greedy(stack: Stack) -> list[int]:
    req = generate_pb2.GenerateRequest(prompt_token_ids=LEGIT_PROMPT, params=_params(max_tokens=24, ignore_eos=True))
    toks = []
    async with grpc.aio.insecure_channel(stack.grpc) as ch:
        async for raw in ch.unary_stream("/tandem.v1.Generate/Generate")(req.SerializeToString(), timeout=60):
            toks += generate_pb2.GenerateResponse.FromString(raw).delta.token_ids
    return toks


def test_fuzz_every_method(stack, layout):
    ms = methods()
    decode_address = f"127.0.0.1:{stack.worker_ports['decode-0']}"
    drawn: dict[str, list] = {}  # by path: health and reflection send every process the same requests
    for m in ms:
        if m.path not in drawn:
            drawn[m.path] = pf.draw(request_strategy(m, decode_address, layout), REQUESTS_PER_METHOD)
    work = [(m, r) for m in ms for r in drawn[m.path]]
    random.Random(0).shuffle(work)  # every process gets every method's requests mixed
    stack.wait_ready()

    async def main():
        before = await _greedy(stack)
        baseline = await _settled_loads(stack, None)
        fuzz = Fuzz(stack)
        t0 = time.monotonic()
        await fuzz.run(work)
        seconds = time.monotonic() - t0
        after_loads = await _settled_loads(stack, baseline)
        after = await _greedy(stack)
        return before, baseline, fuzz, seconds, after_loads, after

    before, baseline, fuzz, seconds, after_loads, after = asyncio.run(main())
    def line(name: str) -> str:
        streamed = f" ({fuzz.messages[name]} messages)" if fuzz.messages[name] else ""
        return f"  {name}: {fuzz.sent[name]} calls{streamed}, {dict(fuzz.outcomes[name])}"
    report = "\n".join(line(name) for name in sorted(fuzz.outcomes))
    print(f"\nfuzz: {len(work)} calls in {seconds:.1f} s\n{report}")  # (the reservations: TransferKv's own)

    assert not fuzz.bad, "\n".join(f"{name}: {o.code.name} {o.details[:300]!r} for {str(r)[:300]}"
                                   for name, o, r in fuzz.bad[:20])
    for m in ms:
        assert fuzz.sent[m.name] >= REQUESTS_PER_METHOD, (m.name, fuzz.sent[m.name])
        # Both paths were reached: bytes that are no message, and messages the service itself answered or refused.
        assert fuzz.parse_errors[m.name] > 0 and fuzz.handled[m.name] > 0, (m.name, fuzz.outcomes[m.name])
    assert fuzz.outcomes["decode-0 Decode/TransferKv"]["OK"] > 0  # (the unmutated transfers went through)
    dead = [name for name, pid in stack.child_pids().items() if not alive(pid)]
    assert not dead and stack.proc.poll() is None, dead
    assert after_loads == baseline, (after_loads, baseline)
    assert after == before and len(before) == 24
    longest = max(stack.lines, key=len)
    assert len(longest) <= MAX_LOG_LINE_CHARS, longest[:300]
    assert len(stack.lines) <= MAX_LOG_LINES, collections.Counter(line[24:80] for line in stack.lines).most_common(5)
    tracebacks = [i for i, line in enumerate(stack.lines) if line.startswith("Traceback")]
    assert len(tracebacks) <= MAX_TRACEBACKS, "".join(
        "".join(stack.lines[i - 1:i + 30]) for i in tracebacks[:3])
