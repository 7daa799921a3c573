"""Where a gRPC KV transfer's time goes (`bench/kv_transfer.py --profile`): stage timings and cProfiles of both sides.

Sender (the bench process): `SenderProfile` times the staging of blocks (CPU cache: views; CUDA: the copies to
pinned memory queued on the stream), the wait for those copies and the encoding of each message's wire bytes (in the
request serializer, where gRPC asks for them), reads the main thread's and the whole process's CPU time around each
transfer (the rest of the process is gRPC's own threads: socket writes), and keeps a cProfile of the main thread.

Receiver (the decode service, its own process): `python -m bench.kv_profile decode --out DIR --warmup N -- <decode
flags>` runs `decode_svc.server` with the same probes put around its own functions before it starts: the
deserializer (`parse_transfer_message`), each block write (`write_blocks`, on the engine thread) and each transfer
(`DecodeCore.transfer`: the loop thread's, the engine thread's and the process's CPU time, page faults); cProfiles of
the loop thread and of the engine thread while transfers are open. It also serves `/tandem.bench.Sink/Count`, which
only counts received bytes: the sender's `grpc_ceiling` streams pre-made messages of the transfer's message size to
it, the most the two processes' gRPC can move on this host. On SIGTERM it writes DIR/decode.json and DIR/*.prof.

All times are CLOCK_MONOTONIC nanoseconds, comparable across the two processes: a message's transit is the time from
the sender's serializer returning its bytes to the receiver's deserializer being called with them.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SINK_METHOD = "/tandem.bench.Sink/Count"
TOP_ENTRIES = 12


def now() -> int:
    return time.monotonic_ns()


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def is_timed(rid: str, warmup: int) -> bool:
    """kv_transfer.py's request ids end with the request's index; the first `warmup` are not timed."""
    return int(rid.rsplit("-", 1)[1]) >= warmup


def top_entries(stats: pstats.Stats | None, n: int = TOP_ENTRIES) -> str:
    if stats is None or not stats.stats:
        return "  (no samples)\n"
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats("tottime").print_stats(n)
    text = out.getvalue()
    return text[text.find("   ncalls"):] if "   ncalls" in text else text


# ---- sender (the bench process) -----------------------------------------------------------------------------------
class SenderProfile:
    def __init__(self, out: Path):
        self.out = out  # where the receiver writes its probes' results
        self.events: list[tuple[str, int, int, int]] = []  # (stage, start ns, end ns, first_block_index or -1)
        self.requests: list[dict] = []  # one per timed transfer
        self.profile = cProfile.Profile()
        self.lengths: dict[int, list[str]] = {}  # prompt length -> its timed requests' ids
        self.message_bytes = 0
        self.ceiling: dict | None = None  # grpc_ceiling's result

    def install(self) -> None:
        """Times grpc_bytes's staging and encoding of blocks (the wait for a CUDA cache's copies to the host apart)."""
        import kv_transfer.grpc_bytes as sender

        stage, encode, events = sender.stage_blocks, sender.encode_blocks, self.events

        def timed_stage(kv_cache, block_ids):
            t0 = now()
            staged = stage(kv_cache, block_ids)
            events.append(("stage", t0, now(), -1))
            return staged

        def timed_encode(first_block_index, num_blocks, staged):
            t0 = now()
            if staged.copied is not None:
                staged.copied.synchronize()
            t1 = now()
            wire = encode(first_block_index, num_blocks, staged)
            events.append(("d2h_wait", t0, t1, first_block_index))
            events.append(("encode", t1, now(), first_block_index))
            return wire

        sender.stage_blocks, sender.encode_blocks = timed_stage, timed_encode

    def serializer(self, serialize):
        """TransferKv's request serializer, noting when each KvBlocks message's bytes go to gRPC."""
        from kv_transfer.grpc_bytes import KvBlocksOut

        def timed(msg):
            wire = serialize(msg)
            if isinstance(msg, KvBlocksOut):
                self.events.append(("sent", now(), now(), msg.first_block_index))
            return wire
        return timed

    async def transfer(self, rid: str, timed: bool, call):
        """Awaits call() (one whole transfer), measured when `timed`."""
        if not timed:
            return await call()
        cpu0, thread0, faults0, t0 = time.process_time(), time.thread_time(), _faults(), now()
        self.profile.enable()
        try:
            return await call()
        finally:
            self.profile.disable()
            t1 = now()
            self.requests.append(dict(rid=rid, start=t0, end=t1, main_cpu=time.thread_time() - thread0,
                                      process_cpu=time.process_time() - cpu0, faults=_faults() - faults0))


async def grpc_ceiling(channel, message_bytes: int, total_bytes: int = 256 << 20) -> dict:
    """Pre-made messages of message_bytes on one stream to the receiver's sink: (GB/s, CPU per message of each side)."""
    call = channel.stream_unary(SINK_METHOD, request_serializer=None, response_deserializer=None)
    payload = os.urandom(message_bytes)
    count = max(32, total_bytes // message_bytes)

    async def messages(n):
        for _ in range(n):
            yield payload

    await call(messages(8))
    cpu0, t0 = time.process_time(), time.perf_counter()
    reply = json.loads(await call(messages(count)))
    seconds = time.perf_counter() - t0
    return dict(message_bytes=message_bytes, messages=count, gb_per_s=count * message_bytes / seconds / 1e9,
                sender_cpu_us=(time.process_time() - cpu0) / count * 1e6,
                receiver_loop_cpu_us=reply["loop_cpu"] / count * 1e6,
                receiver_cpu_us=reply["process_cpu"] / count * 1e6, receiver_faults=reply["faults"] / count)


# ---- receiver (the decode service's process) ----------------------------------------------------------------------
class _ReceiverProbes:
    def __init__(self, warmup: int):
        self.warmup = warmup
        self.events: list[tuple[str, int, int, int]] = []
        self.engine_cpu: list[tuple[int, float]] = []  # (start ns, CPU seconds) of each probed engine-thread call
        self.transfers: list[dict] = []
        self.loop_profile = cProfile.Profile()
        self.engine_profile = cProfile.Profile()

    def install(self) -> None:
        """Puts the probes around decode's functions (before decode_svc.server imports them)."""
        import grpc

        import decode_svc.core as core
        import decode_svc.servicer as servicer
        import kv_transfer.grpc_bytes as grpc_bytes
        import kv_transfer.receiver as receiver
        from kv_transfer.grpc_bytes import ReceivedBlocks

        parse, write, transfer, add_to_server = (receiver.parse_transfer_message, grpc_bytes.write_blocks,
                                                 core.DecodeCore.transfer, servicer.add_to_server)
        probes = self

        def timed_parse(raw):
            t0 = now()
            msg = parse(raw)
            probes.events.append(("parse", t0, now(), msg.first_block_index if isinstance(msg, ReceivedBlocks)
                                   else -1))
            return msg

        def on_engine(stage: str, fn):
            def timed(*args):  # engine thread: wall and CPU time, under the engine thread's cProfile
                t0, cpu0 = now(), time.thread_time()
                # Python >= 3.12 runs cProfile on sys.monitoring, one profiler per process: while the loop thread's
                # is on, the engine thread's cannot be (its stage times and CPU are still taken).
                try:
                    probes.engine_profile.enable()
                    on = True
                except ValueError:
                    on = False
                try:
                    return fn(*args)
                finally:
                    if on:
                        probes.engine_profile.disable()
                    probes.events.append((stage, t0, now(), -1))
                    probes.engine_cpu.append((t0, time.thread_time() - cpu0))
            return timed

        async def probed_transfer(self, messages):
            rid = []

            async def grpc_receive():  # (the time gRPC's Cython code takes to hand over a message lands here)
                async for m in messages:
                    if not rid and not isinstance(m, ReceivedBlocks) and m.HasField("open"):
                        rid.append(m.open.request_id)
                    yield m
            cpu0, thread0, faults0, t0 = time.process_time(), time.thread_time(), _faults(), now()
            try:
                probes.loop_profile.enable()
                on = True
            except ValueError:  # the engine thread's is on (one cProfile per process from Python 3.12)
                on = False
            try:
                return await transfer(self, grpc_receive())
            finally:
                if on:
                    probes.loop_profile.disable()
                probes.transfers.append(dict(rid=rid[0] if rid else "", start=t0, end=now(),
                                             loop_cpu=time.thread_time() - thread0,
                                             process_cpu=time.process_time() - cpu0, faults=_faults() - faults0))

        async def sink(request_iterator, context):
            cpu0, thread0, faults0 = time.process_time(), time.thread_time(), _faults()
            n = 0
            async for m in request_iterator:
                n += len(m)
            return json.dumps(dict(bytes=n, loop_cpu=time.thread_time() - thread0,
                                   process_cpu=time.process_time() - cpu0, faults=_faults() - faults0)).encode()

        def add_with_sink(dcore, server):
            add_to_server(dcore, server)
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("tandem.bench.Sink", {
                "Count": grpc.stream_unary_rpc_method_handler(sink)}),))

        receiver.parse_transfer_message = timed_parse
        grpc_bytes.write_blocks = on_engine("write", write)
        core.DecodeCore._commit = on_engine("commit", core.DecodeCore._commit)
        core.DecodeCore.transfer = probed_transfer
        servicer.add_to_server = add_with_sink

    def dump(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        timed = [t for t in self.transfers if t["rid"] and is_timed(t["rid"], self.warmup)]
        for name, prof in (("loop", self.loop_profile), ("engine", self.engine_profile)):
            try:
                prof.dump_stats(out / f"decode-{name}.prof")
            except TypeError:  # never enabled
                pass
        for t in timed:  # the writes and the commit queued by the transfer run on the engine thread by its end
            t["engine_cpu"] = sum(cpu for start, cpu in self.engine_cpu if t["start"] <= start <= t["end"])
        (out / "decode.json").write_text(json.dumps(dict(events=self.events, transfers=timed)))


def decode_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="decode_svc.server with kv_profile's probes")
    p.add_argument("--out", required=True)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("flags", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    flags = ns.flags[1:] if ns.flags[:1] == ["--"] else ns.flags
    probes = _ReceiverProbes(ns.warmup)
    probes.install()
    from decode_svc import server
    from kv_transfer.layout import retain_freed_memory

    retain_freed_memory()  # (as the first transfer does: the sink measured before it gets the same malloc)
    try:
        return server.main(flags)
    finally:
        probes.dump(Path(ns.out))


# ---- the summary --------------------------------------------------------------------------------------------------
def _load_stats(path: Path) -> pstats.Stats | None:
    try:
        return pstats.Stats(str(path)) if path.is_file() and path.stat().st_size else None
    except TypeError:  # a profile that never ran (Python >= 3.12: the other thread's was on) holds no stats
        return None


def summarize(sender: SenderProfile) -> tuple[str, dict]:
    """The per-stage table for each prompt length, the ceiling, and both sides' top cProfile entries; and the same
    numbers as a dict for the JSON."""
    out, lengths, message_bytes, ceiling = sender.out, sender.lengths, sender.message_bytes, sender.ceiling
    receiver = json.loads((out / "decode.json").read_text()) if (out / "decode.json").is_file() else None
    lines, result = [], {}
    sreqs = {r["rid"]: r for r in sender.requests}
    rreqs = {t["rid"]: t for t in receiver["transfers"]} if receiver else {}
    for n, rids in lengths.items():
        rows: dict[str, list[float]] = {}
        messages, transits, tails = [], [], []

        def add(key: str, value: float) -> None:
            rows.setdefault(key, []).append(value)

        for rid in rids:
            s = sreqs.get(rid)
            if s is None:
                continue
            window = lambda events: [e for e in events if s["start"] <= e[1] <= s["end"]]  # noqa: E731
            sev = window(sender.events)
            wall = (s["end"] - s["start"]) / 1e6
            add("wall", wall)
            for stage in ("stage", "d2h_wait", "encode"):
                add(f"s.{stage}", sum(e[2] - e[1] for e in sev if e[0] == stage) / 1e6)
            add("s.main_cpu", s["main_cpu"] * 1e3)
            add("s.other_cpu", (s["process_cpu"] - s["main_cpu"]) * 1e3)
            add("s.faults", s["faults"])
            sent = {e[3]: e[2] for e in sev if e[0] == "sent"}
            messages.append(len(sent))
            r = rreqs.get(rid)
            if r is None or receiver is None:
                continue
            rev = [e for e in receiver["events"] if r["start"] <= e[1] <= r["end"]]
            for stage in ("parse", "write", "commit"):
                add(f"r.{stage}", sum(e[2] - e[1] for e in rev if e[0] == stage) / 1e6)
            add("r.loop_cpu", r["loop_cpu"] * 1e3)
            add("r.engine_cpu", r.get("engine_cpu", 0.0) * 1e3)
            add("r.other_cpu", (r["process_cpu"] - r["loop_cpu"] - r.get("engine_cpu", 0.0)) * 1e3)
            add("r.faults", r["faults"])
            transits += [e[1] - sent[e[3]] for e in rev if e[0] == "parse" and e[3] in sent]
            parsed = [e[2] for e in rev if e[0] == "parse" and e[3] >= 0]
            if parsed:
                tails.append((s["end"] - max(parsed)) / 1e6)
        if not rows:
            continue
        mean = {k: statistics.fmean(v) for k, v in rows.items()}
        msgs = statistics.fmean(messages) if messages else 0
        result[n] = dict(mean_ms=mean, messages=msgs, transit_us_median=statistics.median(transits) / 1e3
                         if transits else None, tail_ms=statistics.fmean(tails) if tails else None)
        wall = mean["wall"]
        lines.append(f"\nprofile: grpc path, {n} tokens: {msgs:.0f} messages of {message_bytes / 1024:.0f} KiB per "
                     f"request; mean of {len(rows['wall'])} timed requests (cProfile on: adds Python overhead)")
        table = [("wall: open handed to gRPC -> ack", "wall"),
                 ("sender   stage blocks (CPU: views; CUDA: D2H queued)", "s.stage"),
                 ("sender   wait for the D2H copies (CUDA: serializer)", "s.d2h_wait"),
                 ("sender   encode wire bytes (CUDA: in the serializer)", "s.encode"),
                 ("sender   main thread CPU (all above + gRPC send)", "s.main_cpu"),
                 ("sender   other threads CPU (gRPC core: socket)", "s.other_cpu"),
                 ("receiver parse (deserializer, loop thread)", "r.parse"),
                 ("receiver write to the cache (engine thread)", "r.write"),
                 ("receiver commit (engine thread)", "r.commit"),
                 ("receiver loop thread CPU (gRPC receive, parse)", "r.loop_cpu"),
                 ("receiver engine thread CPU (writes, commit)", "r.engine_cpu"),
                 ("receiver other threads CPU (gRPC core: socket)", "r.other_cpu")]
        lines.append(f"  {'stage':54s} {'ms/request':>10s} {'us/message':>10s} {'% of wall':>9s}")
        for label, key in table:
            if key in mean:
                v = mean[key]
                lines.append(f"  {label:54s} {v:10.2f} {v / max(msgs, 1) * 1e3:10.1f} {v / wall * 100:9.0f}")
        lines.append(f"  page faults per message: sender {mean['s.faults'] / max(msgs, 1):.0f}"
                     + (f", receiver {mean['r.faults'] / max(msgs, 1):.0f}" if "r.faults" in mean else ""))
        if transits:
            lines.append(f"  transit (sender's serializer returned -> receiver's deserializer called), median per "
                         f"message: {result[n]['transit_us_median']:.0f} us; last message parsed -> ack: "
                         f"{result[n]['tail_ms']:.2f} ms")
        busiest = max(((label, mean[key]) for label, key in table if key.endswith("_cpu") and key in mean),
                      key=lambda x: x[1], default=None)
        if busiest:
            lines.append(f"  busiest: {busiest[0].split('(')[0].strip()} at {busiest[1] / wall * 100:.0f}% of the wall "
                         "time (near 100%: that thread caps the transfer; 'other threads' are gRPC's, together)")
    if ceiling:
        lines.append(f"\ngRPC ceiling on this host: {ceiling['messages']} pre-made "
                     f"{ceiling['message_bytes'] / 1024:.0f} KiB messages on one stream to a receiver that only "
                     f"counts them: {ceiling['gb_per_s']:.2f} GB/s")
        lines.append(f"  CPU per message: sender {ceiling['sender_cpu_us']:.0f} us, receiver "
                     f"{ceiling['receiver_cpu_us']:.0f} us (loop thread {ceiling['receiver_loop_cpu_us']:.0f} us); "
                     f"receiver page faults per message {ceiling['receiver_faults']:.0f}")
        result["ceiling"] = ceiling
    for title, stats in (("sender main thread (timed transfers)", _stats_of(sender.profile)),
                         ("receiver loop thread (all transfers)", _load_stats(out / "decode-loop.prof")),
                         ("receiver engine thread (writes and commits, all transfers)",
                          _load_stats(out / "decode-engine.prof"))):
        lines.append(f"\ncProfile, {title}, top {TOP_ENTRIES} by own time:")
        lines.append(top_entries(stats).rstrip())
    return "\n".join(lines), result


def _stats_of(profile: cProfile.Profile) -> pstats.Stats | None:
    try:
        return pstats.Stats(profile)
    except TypeError:  # no data
        return None


if __name__ == "__main__":
    if sys.argv[1:2] != ["decode"]:
        raise SystemExit("usage: python -m bench.kv_profile decode --out DIR [--warmup N] -- <decode flags>")
    raise SystemExit(decode_main(sys.argv[2:]))
