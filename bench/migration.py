"""Migration benchmark: kill -9 a decode worker under a load of streaming requests and measure how long the streams
it served wait for their next token (issue 14: the router moves them to another decode worker, token-exact).

    python bench/migration.py --model random:tiny --num-prompts 200 --input-len 32 --output-len 64
    python bench/migration.py --model random:tiny --prefill 1 --decode 2 --result-file migration-cpu.json

It starts `tandem up` (--prefill prefill workers, --decode decode workers, OMP_NUM_THREADS=1 on the CPU), sends a
warm-up request, then --num-prompts streaming `/v1/completions` requests at once (token-id prompts of --input-len
random ids in [260, 512), as bench/serve.py's `random` dataset; ignore_eos, so each produces --output-len tokens).
Once every stream has its --kill-after-tokens-th token, it kill -9s decode-0. The router's log names each stream it
moved ("request <id>: ...: moving it"); for those the benchmark reports the time from the kill to the stream's first
migrated token (the client's view: detection, the re-issue, the re-prefill of prompt + tokens so far, the KV transfer and the
first migrated token), with the router's own view beside it (failure seen -> first token of the new attempt,
its "resumed ... after the failure" lines, which also say how many tokens the stream had before its first migrated
one). It checks that no request failed and that each got --output-len tokens.

Output: a table on stdout and JSON (with machine, commit and date) in --result-file.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.common import REPO_ROOT, write_json

MOVED = re.compile(r"request (\S+): .*: moving it \((\w+),")
RESUMED = re.compile(r"request (\S+): resumed ([\d.]+) s after the failure \(move \d+, (\d+) tokens sent before")


@dataclass
class Stream:
    """One request's stream as the client saw it."""
    rid: str = ""
    arrivals: list[float] = field(default_factory=list)  # one per token, perf_counter
    tokens: int = 0
    error: str | None = None


async def stream_one(http: httpx.AsyncClient, model: str, prompt: list[int], output_len: int,
                     started: Callable[[], None], kill_after_tokens: int) -> Stream:
    s = Stream()
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    s.error = str(event["error"])
                    continue
                s.rid = event.get("id", s.rid)
                usage = event.get("usage")
                if usage:
                    s.tokens = usage["completion_tokens"]
                for choice in event.get("choices", []):
                    if choice.get("text") or choice.get("finish_reason") is None:
                        s.arrivals.append(time.perf_counter())
                        if len(s.arrivals) == kill_after_tokens:
                            started()
    except httpx.HTTPError as e:
        s.error = f"{type(e).__name__}: {e}"
    return s


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    v = sorted(values)

    def at(q: float) -> float:
        return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]
    return {"min": v[0], "p50": at(0.5), "p90": at(0.9), "max": v[-1], "mean": sum(v) / len(v)}


async def run_load(base_url: str, kill: Callable[[], None], log_lines: Callable[[], list[str]], *,
                   num_prompts: int, input_len: int, output_len: int, kill_after_tokens: int = 4,
                   seed: int = 0, model: str = "random:tiny") -> dict:
    """Sends the load, kills (`kill()`) once every stream has kill_after_tokens tokens, and returns the summary:
    requests, failures, moved streams, kill -> next token of each moved stream (seconds), the router's own times."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(260, 512) for _ in range(input_len)] for _ in range(num_prompts)]
    all_started = asyncio.Event()
    count = [0]

    def started() -> None:
        count[0] += 1
        if count[0] == num_prompts:
            all_started.set()

    limits = httpx.Limits(max_connections=num_prompts + 8, max_keepalive_connections=num_prompts + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        tasks = [asyncio.create_task(stream_one(http, model, p, output_len, started, kill_after_tokens)) for p in prompts]
        waiter = asyncio.create_task(all_started.wait())
        await asyncio.wait([waiter, asyncio.gather(*tasks)], return_when=asyncio.FIRST_COMPLETED)
        if not all_started.is_set():
            raise RuntimeError(f"only {count[0]} of {num_prompts} streams reached token {kill_after_tokens} before "
                               "they ended: raise --output-len")
        lines_before = len(log_lines())
        t_kill = time.perf_counter()
        kill()
        streams = await asyncio.gather(*tasks)
        t_end = time.perf_counter()
    lines = log_lines()[lines_before:]
    moved = {m.group(1): m.group(2) for line in lines if (m := MOVED.search(line))}
    resumed = {m.group(1): (float(m.group(2)), int(m.group(3))) for line in lines if (m := RESUMED.search(line))}
    by_id = {s.rid: s for s in streams}
    kill_to_first = []  # the first token of the moved stream's new attempt (tokens sent before it: the log's count)
    for rid, (_, before) in resumed.items():
        s = by_id.get(rid)
        if s is not None and before < len(s.arrivals):
            kill_to_first.append(s.arrivals[before] - t_kill)
    failed = [s for s in streams if s.error is not None or s.tokens != output_len]
    return {
        "requests": num_prompts, "failed": len(failed),
        "failures": [s.error or f"{s.tokens} of {output_len} tokens" for s in failed][:10],
        "moved": len(moved), "moved_by_reason": {r: list(moved.values()).count(r) for r in set(moved.values())},
        "kill_to_first_migrated_token_s": percentiles(kill_to_first),
        "router_failure_to_resumed_s": percentiles([t for t, _ in resumed.values()]),
        "kill_to_all_done_s": t_end - t_kill,
    }


# ---- the stack --------------------------------------------------------------------------------------------------
def _free_port_block(n: int) -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65536:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no block of free ports")


class Up:
    """`tandem up` as a child process, its output (and its children's) in `lines`."""

    def __init__(self, model: str, prefill: int, decode: int, extra: list[str]):
        base = _free_port_block(2 + 2 * (prefill + decode))
        self.base_url = f"http://127.0.0.1:{base}"
        argv = [sys.executable, "-m", "cli", "up", "--model", model, "--prefill", str(prefill), "--decode",
                str(decode), "--http-port", str(base), "--grpc-port", str(base + 1), "--worker-port", str(base + 2),
                "--metrics-port", str(base + 2 + prefill + decode), *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if "tandem up: ready." in line:
                self.ready.set()

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("tandem up did not get ready:\n" + "".join(self.lines[-40:]))

    def pid(self, name: str) -> int:
        pids = {m.group(1): int(m.group(2)) for line in self.lines
                if (m := re.match(r"tandem up: started (\S+) \(pid (\d+)\)", line))}
        return pids[name]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def table(r: dict) -> str:
    def ms(p: dict | None, key: str) -> str:
        return "-" if p is None else f"{p[key] * 1000:.0f}"

    k, o = r["kill_to_first_migrated_token_s"], r["router_failure_to_resumed_s"]
    rows = [("requests / failed / moved", f"{r['requests']} / {r['failed']} / {r['moved']}"),
            ("kill -> first migrated token, ms: p50 / p90 / max",
             f"{ms(k, 'p50')} / {ms(k, 'p90')} / {ms(k, 'max')}"),
            ("router: failure seen -> resumed, ms: p50 / p90 / max", f"{ms(o, 'p50')} / {ms(o, 'p90')} / {ms(o, 'max')}"),
            ("kill -> every stream done, s", f"{r['kill_to_all_done_s']:.1f}")]
    width = max(len(a) for a, _ in rows)
    return "\n".join(f"| {a:<{width}} | {b} |" for a, b in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:tiny")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default: 1)")
    p.add_argument("--decode", type=int, default=2, help="decode workers (default: 2); decode-0 is killed")
    p.add_argument("--num-prompts", type=int, default=200, help="streams in flight at the kill (default: 200)")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (default: 32)")
    p.add_argument("--output-len", type=int, default=256, help="output tokens per request (default: 256)")
    p.add_argument("--kill-after-tokens", type=int, default=4,
                   help="kill once every stream has this many tokens (default: 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--up-args", default="", help="more `tandem up` flags, one string (e.g. \"--device cuda\")")
    p.add_argument("--result-file", default=None, help="JSON output (default: none)")
    ns = p.parse_args(argv)
    up = Up(ns.model, ns.prefill, ns.decode, ns.up_args.split())
    try:
        up.wait_ready()
        httpx.post(f"{up.base_url}/v1/completions", json={"model": ns.model, "prompt": [300] * ns.input_len,
                                                          "max_tokens": 4}, timeout=120).raise_for_status()
        victim = up.pid("decode-0")
        result = asyncio.run(run_load(up.base_url, lambda: os.kill(victim, signal.SIGKILL), lambda: up.lines,
                                      num_prompts=ns.num_prompts, input_len=ns.input_len, output_len=ns.output_len,
                                      kill_after_tokens=ns.kill_after_tokens, seed=ns.seed, model=ns.model))
    finally:
        up.stop()
    print(table(result))
    if ns.result_file:
        write_json(ns.result_file, {"args": vars(ns), "results": result})
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
