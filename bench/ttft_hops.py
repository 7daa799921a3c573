"""Where an idle disaggregated stack's time to first token goes, hop by hop.

    python bench/ttft_hops.py                                   # CPU: random:tiny, 512-token prompts
    python bench/ttft_hops.py --model random:qwen2.5-7b --dtype bfloat16 --device cuda   # H200

Starts the real stack on 127.0.0.1 (one prefill, one decode worker and the router, each the process `tandem up`
starts, with the `tandem.hops` logger at DEBUG), then sends --num-requests single requests, one at a time, through
the OpenAI HTTP API (streaming /v1/completions) and through the router's gRPC API (Generate), each a fresh prompt of
--input-len random token ids (no prefix-cache hits) with --output-len tokens (> 1: the full path, decode reservation
and KV transfer included).

Every process logs `hop <request id> <event> <CLOCK_MONOTONIC ns>` where a request passes a point (router/core.py,
router/disaggregated.py, router/http.py, prefill_svc/core.py, decode_svc/core.py; serving/hops.py:hop), and this
process notes when it sent each request and when its first token arrived on the same clock. Printed per API: TTFT
p50 and min, the named hops (p50 and min of each, in ms), and every event's p50 offset from the client's send, in time order. The
roles' own Prometheus TTFT means (router: validation to first delta; prefill: arrival to first token) are printed
beside them. --offline also times the engine alone (LLMEngine in this process, same flags, add_request + step until
the first token) between the stack's requests. JSON with machine, commit and date goes to --result-file.

--baseline DIR starts a second stack from another source tree (e.g. `git archive <commit> | tar -x -C DIR`; the
same interpreter runs it) and alternates the requests between the two, one at a time, so that both see the same
machine (a shared machine's load drifts between runs); its table is printed beside (hops only where that tree logs
them).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc
import httpx

from bench.common import REPO_ROOT, format_table, write_json

# Runs a role's module as `python -m` would, with the hop logger at DEBUG (the role's own --log-level stays INFO).
HOP_LOGGING = ("import logging, runpy, sys; logging.getLogger('tandem.hops').setLevel(logging.DEBUG); "
               "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")
HOP_LINE = re.compile(r"\bhop (\S+) (\S+) (\d+)$")
# Token ids every model here has (bench/serve.py's --dataset-name random).
TOKEN_IDS = range(260, 512)

# (name, from event, to event): the hops of a request's way to its first token. Events missing in a request (the
# gRPC API has no http.*) drop that hop for it.
HOPS = [
    ("client -> router HTTP handler", "client.send", "http.in"),
    ("HTTP body parse + validation", "http.in", "router.in"),
    ("client -> router core (gRPC)", "client.send", "router.in"),
    ("router validation + tokens", "router.in", "router.tokenized"),
    ("router: tokens -> Decode sent", "router.tokenized", "router.reserve_sent"),
    ("decode reservation round trip", "router.reserve_sent", "router.reserved"),
    ("  Decode RPC in", "router.reserve_sent", "decode.in"),
    ("  decode engine thread reserve", "decode.in", "decode.reserved"),
    ("  Reserved back to router", "decode.reserved", "router.reserved"),
    ("router: tokens -> Prefill sent", "router.tokenized", "router.prefill_sent"),
    ("Prefill RPC in", "router.prefill_sent", "prefill.in"),
    ("prefill engine queue (to add)", "prefill.in", "prefill.added"),
    ("add -> step start", "prefill.added", "prefill.step_start"),
    ("engine step (the one with the token)", "prefill.step_start", "prefill.step_end"),
    ("engine: added -> token (all steps)", "prefill.added", "prefill.step_end"),
    ("engine thread -> event loop", "prefill.step_end", "prefill.first_loop"),
    ("loop -> FirstToken yielded", "prefill.first_loop", "prefill.yield"),
    ("FirstToken back to router", "prefill.yield", "router.first_token"),
    ("router: FirstToken -> stream", "router.first_token", "router.first_out"),
    ("router stream -> SSE chunk", "router.first_out", "http.sse_first"),
    ("SSE chunk -> client", "http.sse_first", "client.first"),
    ("router stream -> client (gRPC)", "router.first_out", "client.first"),
    ("prefill: arrival -> FirstToken", "prefill.in", "prefill.yield"),
    ("TTFT (client)", "client.send", "client.first"),
]


def http_deps(env: dict) -> None:
    """The router needs fastapi and uvicorn. Where they are missing (the GPU image), installs the wheels in .whl/
    into /tmp/site as bench/gpu_serve.sh does, and puts that on the children's PYTHONPATH."""
    if all(importlib.util.find_spec(m) is not None for m in ("fastapi", "uvicorn")):
        return
    wheels = sorted(str(p) for p in (REPO_ROOT / ".whl").glob("*.whl"))
    if not wheels:
        raise SystemExit("ttft_hops: the router needs fastapi and uvicorn: install them or put their wheels in .whl/")
    site = "/tmp/site"
    if not (Path(site) / "fastapi").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", site, *wheels], check=True)
    env["PYTHONPATH"] = site + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Stack:
    """One prefill and one decode worker and the router, started as `tandem up` starts them, hop logs on."""

    def __init__(self, args: argparse.Namespace, log_dir: Path, root: Path = REPO_ROOT):
        self.ports = dict(zip(("grpc", "http", "prefill", "decode", "pm", "dm"), free_ports(6)))
        self.http = f"http://127.0.0.1:{self.ports['http']}"
        self.grpc = f"127.0.0.1:{self.ports['grpc']}"
        engine = ["--model", args.model, "--device", args.device, "--dtype", args.dtype,
                  "--kv-cache-memory", str(args.kv_cache_memory), *args.worker_flags.split()]
        model = ["--model", args.model]
        if args.max_model_len:
            engine += ["--max-model-len", str(args.max_model_len)]
            model += ["--max-model-len", str(args.max_model_len)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.setdefault("HF_HUB_OFFLINE", "1")
        http_deps(env)
        if args.device == "cpu":
            env.setdefault("OMP_NUM_THREADS", "1")
        else:
            env.setdefault("TANDEM_CACHE_DIR", "/tmp/tandem-cache")  # as bench/gpu_serve.sh
        cmds = {
            "prefill": ["prefill_svc.server", "--port", str(self.ports["prefill"]),
                        "--metrics-port", str(self.ports["pm"]), *engine],
            "decode": ["decode_svc.server", "--port", str(self.ports["decode"]),
                       "--metrics-port", str(self.ports["dm"]), *engine],
            "router": ["router.server", "--grpc-port", str(self.ports["grpc"]), "--http-port", str(self.ports["http"]),
                       "--prefill", f"127.0.0.1:{self.ports['prefill']}",
                       "--decode", f"127.0.0.1:{self.ports['decode']}", *model],
        }
        self.logs = {name: log_dir / f"{name}.log" for name in cmds}
        self.procs = {}
        for name, cmd in cmds.items():
            self.procs[name] = subprocess.Popen([sys.executable, "-c", HOP_LOGGING, *cmd], cwd=root, env=env,
                                                stdout=self.logs[name].open("w"), stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited before the stack was ready:\n{self.tail()}")
            try:
                if httpx.get(self.http + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"stack not ready after {timeout:.0f}s:\n{self.tail()}")

    def tail(self, n: int = 25) -> str:
        return "\n".join(f"== {k}\n" + "".join(v.read_text().splitlines(True)[-n:]) for k, v in self.logs.items())

    def stop(self) -> None:
        for name in ("router", "prefill", "decode"):
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGINT)
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def hops(self) -> dict[str, dict[str, int]]:
        """request id -> event -> ns, from every process's log (the first time a request passed each event)."""
        out: dict[str, dict[str, int]] = {}
        for log in self.logs.values():
            for line in log.read_text().splitlines():
                if (m := HOP_LINE.search(line)) is not None:
                    out.setdefault(m.group(1), {}).setdefault(m.group(2), int(m.group(3)))
        return out


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(TOKEN_IDS) for _ in range(n)]


async def one_http(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    t = {"client.send": time.monotonic_ns()}
    rid = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if rid is None and chunk.get("choices"):
                t["client.first"] = time.monotonic_ns()
                rid = chunk["id"]
    t["client.done"] = time.monotonic_ns()
    return {"rid": rid, "t": t}


async def one_grpc(stub, prompt: list[int], max_tokens: int) -> dict:
    from protos.tandem.v1 import common_pb2, generate_pb2

    req = generate_pb2.GenerateRequest(prompt_token_ids=prompt, params=common_pb2.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    t = {"client.send": time.monotonic_ns()}
    rid = None
    async for r in stub.Generate(req, timeout=120):
        if rid is None:
            t["client.first"] = time.monotonic_ns()
            rid = r.request_id
    t["client.done"] = time.monotonic_ns()
    return {"rid": rid, "t": t}


def role_ttft(url: str) -> tuple[float, int]:
    """(sum of seconds, count) of tandem:time_to_first_token_seconds on a /metrics page."""
    text = httpx.get(url, timeout=5).text
    total = sum(float(v) for v in re.findall(r"^tandem:time_to_first_token_seconds_sum\{[^}]*\} (\S+)$", text, re.M))
    count = sum(float(v) for v in re.findall(r"^tandem:time_to_first_token_seconds_count\{[^}]*\} (\S+)$", text,
                                            re.M))
    return total, int(count)


async def drive(stacks: dict[str, Stack], args: argparse.Namespace,
                offline: Offline | None) -> dict[str, dict[str, list]]:
    """label -> api -> the requests' client timestamps; the stacks (and the engine alone) take turns, one request
    at a time."""
    from protos.tandem.v1 import generate_pb2_grpc

    runs: dict = {label: {} for label in stacks}
    clients = {label: httpx.AsyncClient(base_url=st.http, timeout=120) for label, st in stacks.items()}
    channels = {label: grpc.aio.insecure_channel(st.grpc) for label, st in stacks.items()}
    try:
        model = (await next(iter(clients.values())).get("/v1/models")).json()["data"][0]["id"]
        senders = {}
        for label in stacks:
            client, stub = clients[label], generate_pb2_grpc.GenerateStub(channels[label])
            senders[label] = {
                "http": lambda p, c=client: one_http(c, model, p, args.output_len),
                "grpc": lambda p, st=stub: one_grpc(st, p, args.output_len)}
        seed = args.seed
        if offline is not None:
            runs["offline"] = []
            for _ in range(args.warmup):
                seed += 1
                offline.ttft_ms(prompt_ids(args.input_len, seed))
        for api in args.apis.split(","):
            for _ in range(args.warmup):
                for label in stacks:
                    seed += 1
                    await senders[label][api](prompt_ids(args.input_len, seed))
            metrics = {label: [st.http + "/metrics", f"http://127.0.0.1:{st.ports['pm']}/metrics"]
                       for label, st in stacks.items()}
            before = {label: [role_ttft(u) for u in urls] for label, urls in metrics.items()}
            for label in stacks:
                runs[label][api] = []
            for _ in range(args.num_requests):
                for label in stacks:
                    seed += 1
                    runs[label][api].append(await senders[label][api](prompt_ids(args.input_len, seed)))
                    await asyncio.sleep(args.gap_ms / 1000)
                if offline is not None:
                    seed += 1
                    runs["offline"].append(offline.ttft_ms(prompt_ids(args.input_len, seed)))
            for label, urls in metrics.items():
                after = [role_ttft(u) for u in urls]
                runs[label][api + ":roles"] = [
                    {"role": role, "mean_ms": (a[0] - b[0]) / max(1, a[1] - b[1]) * 1e3}
                    for role, a, b in zip(("router", "prefill"), after, before[label])]
    finally:
        for c in clients.values():
            await c.aclose()
        for ch in channels.values():
            await ch.close()
    return runs


class Offline:
    """The engine alone, in this process with the workers' flags: add_request + step() until the first token."""

    def __init__(self, args: argparse.Namespace):
        import torch

        from engine import EngineArgs, LLMEngine, SamplingParams

        if args.device == "cpu":
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # as the workers run
        self.sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
        self.engine = LLMEngine.from_engine_args(EngineArgs(
            model=args.model, device=args.device, dtype=args.dtype, kv_cache_memory=args.offline_kv_cache_memory,
            max_model_len=args.max_model_len or None))
        self.params = SamplingParams(temperature=0.0, max_tokens=1)
        self.n = 0

    def ttft_ms(self, prompt: list[int]) -> float:
        self.n += 1
        self.sync()
        t0 = time.perf_counter()
        self.engine.add_request(f"offline-{self.n}", prompt, self.params)
        while not any(o.new_token_ids for o in self.engine.step()):
            pass
        ms = (time.perf_counter() - t0) * 1e3
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return ms


def summarize(runs: list[dict], hops: dict[str, dict[str, int]]) -> tuple[list[list], list[list], dict]:
    """(hop rows, event timeline rows, numbers) over the requests of one API."""
    timelines = []
    for r in runs:
        t = {**hops.get(r["rid"], {}), **r["t"]}
        timelines.append(t)
    rows, numbers = [], {}
    for name, a, b in HOPS:
        d = [(t[b] - t[a]) / 1e6 for t in timelines if a in t and b in t]
        if not d:
            continue
        numbers[name] = {"p50_ms": statistics.median(d), "min_ms": min(d), "n": len(d)}
        rows.append([name, f"{a} -> {b}", statistics.median(d), min(d)])
    offsets: dict[str, list[float]] = {}
    for t in timelines:
        for ev, ns in t.items():
            offsets.setdefault(ev, []).append((ns - t["client.send"]) / 1e6)
    events = sorted(((statistics.median(v), ev) for ev, v in offsets.items()))
    timeline, prev = [], None
    for med, ev in events:
        timeline.append([ev, med, med - prev if prev is not None else 0.0])
        prev = med
    return rows, timeline, numbers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:tiny")
    p.add_argument("--device", default="cpu", help="the workers' device (cpu, cuda)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-memory", type=float, default=None,
                   help="GiB of KV cache per worker (default: 0.25 on cpu, 24 on cuda)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's (4096 on cuda)")
    p.add_argument("--worker-flags", default="", help="more engine flags for both workers, one string")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=4,
                   help="tokens per request; 1 leaves decode out (no reservation, no KV transfer)")
    p.add_argument("--num-requests", type=int, default=20, help="measured requests per API")
    p.add_argument("--warmup", type=int, default=3, help="requests per API before measuring")
    p.add_argument("--gap-ms", type=float, default=50.0, help="pause between requests (the stack settles)")
    p.add_argument("--apis", default="http,grpc", help="comma-separated: http, grpc")
    p.add_argument("--baseline", default=None,
                   help="a second source tree (directory) to run beside this one, requests alternating")
    p.add_argument("--offline", action="store_true", help="also time the engine alone (loads the model here)")
    p.add_argument("--offline-kv-cache-memory", type=float, default=1.0, help="GiB of KV cache for --offline")
    p.add_argument("--timeline", action="store_true", help="also print every event's offset, in time order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default=None, help="where the processes' logs go (default: a temporary directory)")
    p.add_argument("--result-file", default=None, help="JSON output")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if args.kv_cache_memory is None:
        args.kv_cache_memory = 24.0 if cuda else 0.25
    if args.max_model_len is None and cuda:
        args.max_model_len = 4096
    if args.output_len < 1:
        p.error(f"--output-len={args.output_len}: must be >= 1")
    for api in args.apis.split(","):
        if api not in ("http", "grpc"):
            p.error(f"--apis: {api!r} is not http or grpc")

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="ttft_hops-"))
    roots = {"this tree": REPO_ROOT}
    if args.baseline:
        if not (Path(args.baseline) / "router" / "server.py").is_file():
            p.error(f"--baseline={args.baseline!r}: not a Tandem source tree (no router/server.py)")
        roots["baseline"] = Path(args.baseline).resolve()
    t0 = time.monotonic()
    stacks: dict[str, Stack] = {}
    try:
        for label, root in roots.items():
            d = log_dir / label.replace(" ", "_")
            d.mkdir(parents=True, exist_ok=True)
            stacks[label] = Stack(args, d, root)
        for st in stacks.values():
            st.wait_ready(args.ready_timeout)
        print(f"ready after {time.monotonic() - t0:.1f}s (logs in {log_dir})", flush=True)
        offline = Offline(args) if args.offline else None
        runs = asyncio.run(drive(stacks, args, offline))
        del offline
    except BaseException:
        for st in stacks.values():
            st.stop()
            print(st.tail(), file=sys.stderr)
        raise
    for st in stacks.values():
        st.stop()

    results: dict = {"args": vars(args), "stacks": {}}
    print(f"\n## {args.model} on {args.device}: {args.num_requests} idle requests per API, {args.input_len} tokens "
          f"in, {args.output_len} out")
    for label, st in stacks.items():
        hops = st.hops()
        results["stacks"][label] = {"root": str(roots[label]), "apis": {}}
        for api in args.apis.split(","):
            ttfts = [(r["t"]["client.first"] - r["t"]["client.send"]) / 1e6 for r in runs[label][api]]
            rows, timeline, numbers = summarize(runs[label][api], hops)
            roles = runs[label][api + ":roles"]
            print(f"\n### {label}, {api}: TTFT p50 {statistics.median(ttfts):.2f} ms, min {min(ttfts):.2f} ms; "
                  "role TTFT means: " + ", ".join(f"{r['role']} {r['mean_ms']:.2f} ms" for r in roles))
            print(format_table(["hop", "events", "p50 ms", "min ms"], rows))
            if args.timeline:
                print(f"\n{label}, {api}: every event, p50 offset from the client's send")
                print(format_table(["event", "p50 ms", "+ms"], timeline))
            results["stacks"][label]["apis"][api] = {
                "ttft_p50_ms": statistics.median(ttfts), "ttft_min_ms": min(ttfts), "ttft_ms": ttfts,
                "hops": numbers, "roles": roles, "timeline": {ev: med for ev, med, _ in timeline}}
    if len(stacks) > 1:
        print("\n### TTFT side by side (requests alternated)")
        print(format_table(["api", *(f"{label} p50 ms" for label in stacks), *(f"{label} min ms" for label in stacks)],
                           [[api, *(results["stacks"][lb]["apis"][api]["ttft_p50_ms"] for lb in stacks),
                             *(results["stacks"][lb]["apis"][api]["ttft_min_ms"] for lb in stacks)]
                            for api in args.apis.split(",")]))
    if args.offline:
        times = runs["offline"]
        print(f"\nengine alone (LLMEngine here, between the stack's requests): TTFT p50 {statistics.median(times):.2f} ms, "
              f"min {min(times):.2f} ms")
        results["offline"] = {"ttft_p50_ms": statistics.median(times), "ttft_min_ms": min(times), "ttft_ms": times}
    main_stack = results["stacks"]["this tree"]["apis"]
    summary = [f"{api} TTFT p50 {v['ttft_p50_ms']:.2f} ms" for api, v in main_stack.items()]
    engine = [v["hops"].get("engine: added -> token (all steps)", {}).get("p50_ms") for v in main_stack.values()]
    if any(e is not None for e in engine):
        summary.append(f"prefill engine (added -> token) p50 {statistics.median(e for e in engine if e):.2f} ms")
    if "offline" in results:
        summary.append(f"engine alone p50 {results['offline']['ttft_p50_ms']:.2f} ms")
    print("\nsummary: " + "; ".join(summary))
    if args.result_file:
        write_json(args.result_file, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
