"""KV transfer bandwidth, prefill -> decode, on each path: gRPC bytes, same-host CUDA IPC, and NIXL.

  python bench/kv_transfer.py --model random:qwen2.5-7b --dtype bfloat16 --device cuda     # every path
  python bench/kv_transfer.py --model random:qwen2.5-7b --dtype bfloat16 --device cuda --decode-device cuda:1
                                                            # decode on a second GPU: the IPC copy crosses NVLink
  python bench/kv_transfer.py --model random:qwen2.5-7b --narrow --random-kv --device cpu \
      --kv-cache-memory 1                                   # gRPC path only: the 7B's KV bytes, not its weights
  python bench/kv_transfer.py --model random:qwen2.5-7b --narrow --random-kv --device cpu \
      --kv-cache-memory 2 --paths grpc nixl                 # gRPC bytes beside NIXL (UCX on one host) on the CPU

The decode side is a real decode service (`python -m decode_svc.server`, its own process: CUDA IPC cannot map a
cache inside the process that exported it). The prefill side is this process: an engine computes each prompt's KV
(kv_hold, as the prefill service does), then the prefill service's own sender (`kv_transfer.sender.KvSender`)
streams it over a real TransferKv call. The path is negotiated once per run with the KvHandshake (on CUDA IPC the
decode service maps this process's cache then: the one-time mapping is not timed).

What is timed, per request: from the moment the KvTransferOpen is handed to gRPC, before any block is read, until
this process holds decode's KvTransferAck. It includes the open (on CUDA IPC: the cache handle, exchanged per
request, and decode's lookup of its mapping; on NIXL: the registered cache's descriptor), on gRPC the copies to the host, serialization, the loopback hop,
parsing and the writes into decode's cache, on CUDA IPC the device synchronization and the GPU-to-GPU copy, on NIXL decode's READ (UCX: on one host shared
memory, between hosts RDMA or TCP; the agents were added at the handshake, not timed), then the
commit (decode waits for its writes or copies, `commit_prefilled`) and the ack. The prompt's compute is not timed
(in the service it overlaps the transfer chunk by chunk). GB/s = the prompt's KV bytes (whole blocks, all layers,
keys and values) / that time; the table gives the median over --num-iters requests after --warmup ones.

Each request then decodes two more tokens on the decode service, and this process decodes them too, from the very
blocks it sent (the same reserve / commit_prefilled flow in its own engine): equal tokens and equal logprobs (to
LOGPROB_TOLERANCE) check that the blocks arrived intact; and the same prompts go through both paths.

--random-kv skips the prompt's compute: the request's blocks are filled with seeded random values instead (the same
for both paths, so the token check still holds). Transfers are the same; long prompts then cost no forward pass,
which makes CPU runs with a large model layout (e.g. random:smollm2-135m) take seconds, not minutes. --narrow
goes further for random:<preset> models: both sides load a small random model with the preset's KV layout (layers,
KV heads, head_dim, so the same bytes per token and per block) and nothing else of its size, saved once under
$TANDEM_CACHE_DIR; with --random-kv that measures the 7B's transfers on a laptop.

--protobuf-messages sends the gRPC path's blocks as KvTransferMessage protos through the generated stub (what
prefill_svc/core.py does until it sends through KvSender.transfer_kv), for comparison.

--profile (gRPC path) says which stage caps the transfer (bench/kv_profile.py): per request, the sender's staging,
wait for the copies to the host and encoding, the receiver's parsing and writes, each side's CPU time by thread, the
transit of a message between the processes, page faults; the gRPC ceiling of the host (pre-made messages of the
same size to a receiver that only counts them); and the top cProfile entries of the sender's main thread and of the
decode service's loop and engine threads. The timed numbers then include cProfile's overhead.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import kv_profile  # noqa: E402
from bench.common import REPO_ROOT, format_table, write_json  # noqa: E402
from engine import EngineArgs, LLMEngine, SamplingParams  # noqa: E402
from kv_transfer import nixl  # noqa: E402
from kv_transfer.base import GRPC  # noqa: E402
from kv_transfer.grpc_bytes import serialize  # noqa: E402
from kv_transfer.layout import block_rows  # noqa: E402
from kv_transfer.registry import PATH_LABELS  # noqa: E402
from kv_transfer.sender import KvSender  # noqa: E402
from protos.tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc  # noqa: E402
from serving.errors import ServiceError  # noqa: E402
from serving.rpc import GRPC_OPTIONS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:tiny", help="model spec (random:<preset> for benchmarks)")
    p.add_argument("--dtype", default="auto", help="model (and KV cache) dtype")
    p.add_argument("--device", default="auto", help="cpu | cuda | auto")
    p.add_argument("--decode-device", default=None,
                   help="the decode service's device (default: --device); cuda:1 times the copy between two GPUs")
    p.add_argument("--input-lens", type=int, nargs="+", default=[512, 8192], help="prompt lengths, tokens")
    p.add_argument("--paths", nargs="+", choices=["grpc", "ipc", "nixl"], default=None,
                   help="transfer paths (default: grpc and ipc on CUDA, grpc on the CPU; and nixl where nixl-cu12 "
                        "imports: on one host, UCX takes shared memory, not the NIC)")
    p.add_argument("--num-iters", type=int, default=5, help="timed requests per path and length")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests per path and length first")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=float, default=None,
                   help="KV cache GiB of each side (default: 2 on CUDA, 0.25 on the CPU)")
    p.add_argument("--json", default=None, help="result file (default: bench/results/kv_transfer-<device>.json)")
    p.add_argument("--decode-log", default=None, help="decode service log file (default: a temporary file)")
    p.add_argument("--random-kv", action="store_true",
                   help="fill the prompt's blocks with seeded random values instead of computing them")
    p.add_argument("--narrow", action="store_true",
                   help="random:<preset> only: load a small model with the preset's KV layout instead (see above)")
    p.add_argument("--protobuf-messages", action="store_true",
                   help="gRPC path: send KvTransferMessage protos through the generated stub (the slower way) instead "
                        "of KvSender.transfer_kv's pre-serialized blocks")
    p.add_argument("--message-bytes", type=int, default=None,
                   help="gRPC path: KV payload per message, rounded down to whole blocks (at least one; default: "
                        "kv_transfer.grpc_bytes.MESSAGE_BYTES)")
    p.add_argument("--profile", action="store_true",
                   help="gRPC path: per-stage times, CPU by thread, the host's gRPC ceiling and cProfiles of both "
                        "sides (see above)")
    return p.parse_args(argv)


def narrow_model(spec: str) -> str:
    """A model directory with `spec`'s KV layout (layers, KV heads, head_dim) and small everything else."""
    from transformers import AutoModelForCausalLM

    from engine.loader import RANDOM_PREFIX, cache_root, resolve_model
    from engine.tokenizer import synthetic_tokenizer

    if not spec.startswith(RANDOM_PREFIX):
        raise SystemExit(f"--narrow: needs a random:<preset> model, not {spec!r}")
    config = resolve_model(spec).config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    config.num_attention_heads = config.num_key_value_heads
    config.head_dim = head_dim
    config.hidden_size = head_dim * config.num_key_value_heads
    config.intermediate_size = 256
    config.vocab_size = 1024
    config.tie_word_embeddings = False
    out = cache_root() / f"narrow-{spec.removeprefix(RANDOM_PREFIX)}"
    if not (out / "model.safetensors").is_file():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out)
        synthetic_tokenizer(config.vocab_size).save_pretrained(out)
    return str(out)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags(args, max_model_len: int, device: str) -> list[str]:
    return ["--model", args.model, "--dtype", args.dtype, "--device", device, "--block-size",
            str(args.block_size), "--kv-cache-memory", str(args.kv_cache_memory), "--max-model-len",
            str(max_model_len), "--enforce-eager", "--no-enable-prefix-caching"]


def prefill_kv(engine, rid: str, prompt: list[int]) -> int:
    """Computes the prompt's KV in the local engine (held, as the prefill service holds it); returns token 1."""
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1), kv_hold=True)
    token = None
    while token is None:
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                token = out.new_token_ids[0]
    if engine.kv_cache.is_cuda:
        torch.cuda.synchronize(engine.kv_cache.device)
    return token


def random_kv(engine, prompt: list[int], ids: list[int]) -> None:
    """Fills blocks `ids` of the engine's cache with values seeded by the prompt."""
    gen = torch.Generator(device=engine.kv_cache.device).manual_seed(sum(prompt) % (1 << 31))
    cache = engine.kv_cache
    values = torch.randn((len(ids), *cache.shape[1:]), generator=gen, device=cache.device, dtype=torch.float32)
    cache[torch.tensor(ids, device=cache.device)] = values.to(cache.dtype)
    if cache.is_cuda:
        torch.cuda.synchronize(cache.device)


DECODE_PARAMS = dict(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0)
# Decode and this process run the same model on the same KV, in batches of one; a block that arrived wrong moves the
# logprobs of the tokens after it far more than this (float rounding differences between the two could not).
LOGPROB_TOLERANCE = 1e-3


def local_tokens(engine, rid: str, first: int) -> tuple[list[int], list[float]]:
    """Tokens and their logprobs of reserved request `rid` once committed with `first`, decoded by this engine."""
    tokens, logprobs = [first], []
    out = engine.commit_prefilled(rid, first)
    while not out.finished:
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                logprobs += [lp[t] for t, lp in zip(out.new_token_ids, out.new_logprobs)]
    return tokens, logprobs


def logprob_diff(r: dict) -> float:
    return max((abs(a - b) for a, b in zip(r["logprobs"], r["expected_logprobs"], strict=True)), default=0.0)


def same_decode(r: dict) -> bool:
    return r["tokens"] == r["expected"] and logprob_diff(r) <= LOGPROB_TOLERANCE


async def one_request(engine, sender: KvSender, stub, transfer_kv, path: int, rid: str, prompt: list[int],
                      compute: bool = True, encoded: bool = True, profile=None, timed: bool = True) -> dict:
    """One request: reserve, compute (or fill) the KV, transfer it, read decode's tokens and decode the same here.
    transfer_kv: the TransferKv callable, KvSender.transfer_kv for `encoded` blocks, else the generated stub's.
    profile: a kv_profile.SenderProfile that times this transfer's stages (when `timed`)."""
    call = stub.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, kv_transfer_timeout_ms=120_000,
                                                params=common_pb2.SamplingParams(**DECODE_PARAMS)))
    reserved = await call.read()
    assert reserved.HasField("reserved"), reserved
    num_blocks = -(-len(prompt) // sender.layout.block_size)
    # The blocks sent are those of a request reserved here too: after the transfer this engine decodes from them.
    ids = engine.reserve_prefilled(rid, prompt, SamplingParams(**DECODE_PARAMS))
    assert ids is not None and len(ids) == num_blocks, "the bench engine's KV cache holds two prompts"
    if compute:
        first = prefill_kv(engine, f"{rid}-prefill", prompt)
        block_rows(engine.kv_cache)[ids] = block_rows(engine.kv_cache)[engine.get_block_ids(f"{rid}-prefill")[
            :num_blocks]]
        engine.abort(f"{rid}-prefill")
        if engine.kv_cache.is_cuda:
            torch.cuda.synchronize(engine.kv_cache.device)
    else:
        first = prompt[-1]
        random_kv(engine, prompt, ids)

    async def messages():
        yield sender.open_message(rid, len(prompt), num_blocks, 120_000, path)
        # Timed. CUDA: all blocks at once, as the prefill service ships a chunk's (the copies to the host are queued
        # here, each message waits for its own when gRPC serializes it). CPU: message by message (block_messages
        # writes a CPU cache's message bytes at once, which the service's engine thread does beside the sending loop).
        step = num_blocks if engine.kv_cache.is_cuda or path != GRPC else sender.blocks_per_message
        for i in range(0, num_blocks, step):
            for msg in sender.block_messages(engine.kv_cache, path, i, ids[i:i + step], encoded=encoded):
                yield msg
        yield sender.commit_message(first, 0)

    t0 = time.perf_counter()
    if profile is None:
        ack = await transfer_kv(messages())
    else:
        ack = await profile.transfer(rid, timed, lambda: transfer_kv(messages()))
    seconds = time.perf_counter() - t0
    tokens, logprobs = [first], []
    while (r := await call.read()) is not grpc.aio.EOF:
        tokens += r.delta.token_ids
        logprobs += [p.candidates[0].logprob for p in r.delta.logprobs]  # the sampled token's first
    expected, expected_logprobs = local_tokens(engine, rid, first)  # (then finished: its blocks are free)
    assert ack.path == path, (ack.path, path)
    assert ack.received_bytes == num_blocks * sender.layout.block_bytes, ack
    return dict(seconds=seconds, bytes=ack.received_bytes, tokens=tokens, expected=expected, logprobs=logprobs,
                expected_logprobs=expected_logprobs)


async def wait_ready(stub, proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the decode service exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=2)
            return
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.5)
    raise SystemExit(f"the decode service did not start in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


async def run(args, engine, channel, proc, log, context_len: int, profile=None) -> tuple[list[dict], dict]:
    stub = decode_pb2_grpc.DecodeStub(channel)
    transfer_kv = stub.TransferKv if args.protobuf_messages else KvSender.transfer_kv(channel)
    await wait_ready(stub, proc, log)
    address = f"127.0.0.1:{args.port}"
    rows, notes = [], {}
    gen = torch.Generator().manual_seed(0)
    vocab = engine.runner.hf_config.vocab_size
    prompts = {n: [torch.randint(300, vocab, (n,), generator=gen).tolist() for _ in range(args.warmup + args.num_iters)]
               for n in args.input_lens if n < context_len}
    for n in args.input_lens:
        if n not in prompts:
            notes[f"{n} tokens"] = f"skipped: longer than {args.label}'s context ({context_len} tokens)"
    tokens: dict[tuple[int, int], list[int]] = {}
    for name in args.paths:
        sender = KvSender(engine.kv_cache, name)  # the --kv-transfer value
        if args.message_bytes:
            sender.blocks_per_message = max(1, args.message_bytes // sender.layout.block_bytes)
        try:
            path = await sender.path_to(address, stub)  # the handshake; on CUDA IPC the one-time mapping
        except ServiceError as e:
            notes[name] = f"not measured: {e.message}"
            print(f"{name}: {e.message}", flush=True)
            continue
        profiled = profile is not None and path == GRPC and not args.protobuf_messages
        send = KvSender.transfer_kv(channel, profile.serializer(serialize)) if profiled else transfer_kv
        for n, batch in prompts.items():
            runs = []
            for i, prompt in enumerate(batch):
                r = await one_request(engine, sender, stub, send, path, f"{name}-{n}-{i}", prompt,
                                      not args.random_kv, not args.protobuf_messages,
                                      profile if profiled else None, i >= args.warmup)
                if i >= args.warmup:
                    runs.append(r)
                first_path = tokens.setdefault((n, i), r["tokens"])
                if not same_decode(r):
                    notes[f"{name} {n} #{i}"] = (f"decode's tokens {r['tokens']} (logprobs {r['logprobs']}) differ "
                                                 f"from {r['expected']} ({r['expected_logprobs']}), decoded here from "
                                                 "the blocks sent")
                elif first_path != r["tokens"]:
                    notes[f"{name} {n} #{i}"] = f"tokens {r['tokens']} differ from the first path's {tokens[(n, i)]}"
            secs = [r["seconds"] for r in runs]
            med = statistics.median(secs)
            rows.append(dict(path=PATH_LABELS[path], input_len=n, bytes=runs[0]["bytes"], seconds_median=med,
                             seconds_min=min(secs), seconds_max=max(secs), gb_per_s=runs[0]["bytes"] / med / 1e9,
                             iters=len(runs), tokens_match=all(tokens[(n, i)] == r["tokens"] and same_decode(r)
                                                               for i, r in enumerate(runs, args.warmup)),
                             logprob_max_diff=max(logprob_diff(r) for r in runs)))
            print(f"{name} {n:6d} tokens: {runs[0]['bytes'] / 1e6:9.1f} MB  median {med * 1e3:8.3f} ms  "
                  f"{rows[-1]['gb_per_s']:8.2f} GB/s", flush=True)
            if profiled:
                profile.lengths[n] = [f"{name}-{n}-{i}" for i in range(args.warmup, len(batch))]
    if profile is not None:
        profile.message_bytes = sender.blocks_per_message * sender.layout.block_bytes
        profile.ceiling = await kv_profile.grpc_ceiling(channel, profile.message_bytes)
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.paths is None:
        args.paths = ["grpc", "ipc"] if args.device == "cuda" else ["grpc"]
        if nixl.import_error() is None:
            args.paths.append("nixl")
    if "ipc" in args.paths and args.device != "cuda":
        raise SystemExit("--paths ipc: CUDA IPC needs --device cuda")
    args.decode_device = args.decode_device or args.device
    args.label = args.model + (" (narrow: its KV layout only)" if args.narrow else "")
    if args.narrow:
        args.model = narrow_model(args.model)
    if args.kv_cache_memory is None:
        args.kv_cache_memory = 2.0 if args.device == "cuda" else 0.25
    args.port = free_port()
    from engine.loader import resolve_model

    context_len = resolve_model(args.model).config.max_position_embeddings
    max_model_len = min(context_len, max(args.input_lens) + 64)
    log = Path(args.decode_log or tempfile.mkstemp(prefix="kv-transfer-decode-", suffix=".log")[1])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    decode = [sys.executable, "-m", "decode_svc.server"]
    profile = None
    if args.profile:
        profile = kv_profile.SenderProfile(Path(tempfile.mkdtemp(prefix="kv-transfer-profile-")))
        profile.install()
        decode = [sys.executable, "-m", "bench.kv_profile", "decode", "--out", str(profile.out), "--warmup",
                  str(args.warmup), "--"]
    proc = subprocess.Popen([*decode, "--port", str(args.port), "--log-level", "WARNING",
                             *engine_flags(args, max_model_len, args.decode_device)], cwd=REPO_ROOT, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        blocks = -(-max_model_len // args.block_size) + 1 if args.random_kv else None  # one reserved prompt
        engine = LLMEngine.from_engine_args(EngineArgs(
            model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
            kv_cache_memory=None if blocks else args.kv_cache_memory, num_gpu_blocks_override=blocks,
            max_model_len=max_model_len, enforce_eager=True, enable_prefix_caching=False,
            max_num_batched_tokens=max(2048, min(max(args.input_lens), max_model_len))))
        engine.stream_text = False

        async def go():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{args.port}", options=GRPC_OPTIONS) as ch:
                return await run(args, engine, ch, proc, log, context_len, profile)

        rows, notes = asyncio.run(go())
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    sender = KvSender(engine.kv_cache, "grpc")
    layout = sender.layout
    bytes_per_token = layout.block_bytes // layout.block_size
    blocks_per_message = max(1, args.message_bytes // layout.block_bytes) if args.message_bytes else \
        sender.blocks_per_message
    print(f"\nmodel {args.label}  kv dtype {layout.dtype}  {layout.num_layers} layers x {layout.num_kv_heads} kv heads "
          f"x {layout.head_dim}  {bytes_per_token} KV bytes/token  device {args.device}"
          + (f" -> decode on {args.decode_device}" if args.decode_device != args.device else "")
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
          + f"  gRPC messages of {blocks_per_message} block(s): {blocks_per_message * layout.block_bytes >> 10} KiB")
    print("timed: open handed to gRPC -> decode's ack (decode committed); median of "
          f"{args.num_iters} after {args.warmup} warm-up" + (" (random KV, no prompt compute)" if args.random_kv
                                                              else "") + "\n")
    print(format_table(["path", "prompt tokens", "KV MB", "median ms", "min ms", "max ms", "GB/s", "tokens match",
                        "max |logprob diff|"],
                       [[r["path"], r["input_len"], r["bytes"] / 1e6, r["seconds_median"] * 1e3,
                         r["seconds_min"] * 1e3, r["seconds_max"] * 1e3, r["gb_per_s"], r["tokens_match"],
                         f"{r['logprob_max_diff']:.2g}"] for r in rows]))
    for k, v in notes.items():
        print(f"note: {k}: {v}")
    profiled = None
    if profile is not None:
        text, profiled = kv_profile.summarize(profile)
        print(text)
    two = "" if args.decode_device == args.device else f"-to-{args.decode_device.replace(':', '')}"
    out = args.json or REPO_ROOT / "bench" / "results" / f"kv_transfer-{args.device}{two}.json"
    write_json(out, dict(model=args.label, dtype=layout.dtype, device=args.device, decode_device=args.decode_device,
                         block_size=layout.block_size,
                         num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                         kv_bytes_per_token=bytes_per_token, random_kv=args.random_kv,
                         message_bytes=blocks_per_message * layout.block_bytes,
                         protobuf_messages=args.protobuf_messages, profile=profiled,
                         timed=__doc__.split("\n\n")[3].replace("\n", " "),
                         results=rows, notes=notes))
    print(f"wrote {out}")
    return 0 if rows and all(r["tokens_match"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
