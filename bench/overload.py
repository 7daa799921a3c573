"""Overload benchmark: many requests at once against an OpenAI-compatible HTTP server, each one watched until it is
served, refused, or the client gives up.

    python bench/overload.py --base-url http://127.0.0.1:8000 --model random:tiny --num-prompts 500 \
        --input-len 32 --output-len 128 --deadline 60 --metrics-url http://127.0.0.1:9101/metrics \
        --metrics-url http://127.0.0.1:9102/metrics --result-file overload.json

Every request is sent at the same moment (no arrival process: this is a burst, not a rate), over connections opened
beforehand (500 connects at once take a busy machine seconds, whatever the server), streaming `/v1/completions`
with `ignore_eos`, so each asks for exactly --output-len tokens. Each ends one of four ways:
- served: the stream completed (its first-token time is recorded too);
- refused: an HTTP error status before the stream started (429 with Retry-After is what bounded admission answers;
  the time to the refusal is recorded: a full queue should answer within milliseconds);
- failed: an error event inside a started stream, or a broken connection;
- pending: none of these within --deadline seconds (the client then cancels it).

Reported: the counts, served requests' TTFT and latency, refusal latency by status (p50, p99, max), whether
refusals carried Retry-After, and, from the --metrics-url pages (the decode workers' Prometheus pages),
`tandem:num_preemptions_total` gained during the run. Output: a Markdown table on stdout and JSON (with machine,
commit and date) in --result-file.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.common import format_table, write_json
from bench.serve import make_prompts


@dataclass
class Outcome:
    kind: str = "pending"  # served | refused | failed | pending
    status: int = 0  # HTTP status of the response (0: none came)
    seconds: float = 0.0  # to the end (served), the refusal (refused), the failure (failed)
    ttft: float | None = None
    retry_after: str | None = None
    error: str = ""


async def one(client: httpx.AsyncClient, url: str, body: dict, t0: float) -> Outcome:
    out = Outcome()
    try:
        async with client.stream("POST", url, json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.kind, out.seconds = "refused", time.perf_counter() - t0
                out.retry_after = r.headers.get("retry-after")
                out.error = (await r.aread()).decode(errors="replace")[:300]
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    out.kind, out.seconds, out.error = "failed", time.perf_counter() - t0, str(msg["error"])[:300]
                    return out
                if out.ttft is None and any(c.get("text") for c in msg.get("choices") or []):
                    out.ttft = time.perf_counter() - t0
        out.kind, out.seconds = "served", time.perf_counter() - t0
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.kind, out.seconds, out.error = "failed", time.perf_counter() - t0, f"{type(e).__name__}: {e}"
    return out


def preemptions(pages: list[str]) -> int:
    """tandem:num_preemptions_total summed over the pages' series."""
    total = 0.0
    for page in pages:
        for m in re.finditer(r"^tandem:num_preemptions_total\{[^}]*\} (\S+)$", page, re.M):
            total += float(m.group(1))
    return int(total)


async def scrape(urls: list[str]) -> list[str]:
    async with httpx.AsyncClient(timeout=10) as c:
        return [(await c.get(u)).text for u in urls]


def quantiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    v = sorted(values)
    return {"n": len(v), "p50": v[len(v) // 2], "p99": v[min(len(v) - 1, int(len(v) * 0.99))], "max": v[-1]}


async def run(args: argparse.Namespace) -> dict:
    prompts = make_prompts(args.num_prompts, args.input_len, args.seed)
    url = args.base_url.rstrip("/") + "/v1/completions"
    before = preemptions(await scrape(args.metrics_url))
    limits = httpx.Limits(max_connections=args.num_prompts + 10, max_keepalive_connections=args.num_prompts + 10)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.deadline + 30), limits=limits) as client:
        await asyncio.gather(*(client.get(args.base_url.rstrip("/") + "/health") for _ in prompts))
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(one(client, url, {
            "model": args.model, "prompt": p, "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True,
            "stream": True}, t0)) for p in prompts]
        done, pending = await asyncio.wait(tasks, timeout=args.deadline)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
    outcomes = [t.result() if t in done else Outcome() for t in tasks]
    await asyncio.sleep(args.settle)  # cancelled streams reach the workers' metrics
    after = preemptions(await scrape(args.metrics_url))
    counts = {k: sum(o.kind == k for o in outcomes) for k in ("served", "refused", "failed", "pending")}
    by_status: dict[int, list[float]] = {}
    for o in outcomes:
        if o.kind == "refused":
            by_status.setdefault(o.status, []).append(o.seconds)
    served = [o for o in outcomes if o.kind == "served"]
    return {
        "args": vars(args), "wall_s": wall, "counts": counts,
        "served_ttft_s": quantiles([o.ttft for o in served if o.ttft is not None]),
        "served_latency_s": quantiles([o.seconds for o in served]),
        "refusal_s": {str(s): quantiles(v) for s, v in sorted(by_status.items())},
        "refusals_with_retry_after": sum(o.kind == "refused" and o.retry_after is not None for o in outcomes),
        "failed_examples": [o.error for o in outcomes if o.kind == "failed"][:3],
        "refused_examples": sorted({o.error[:160] for o in outcomes if o.kind == "refused"})[:4],
        "preemptions": after - before if args.metrics_url else None,
        "outcomes": [asdict(o) for o in outcomes],
    }


def report(res: dict) -> str:
    c = res["counts"]
    rows = [["served", c["served"], res["served_ttft_s"].get("p50", "-"), res["served_ttft_s"].get("p99", "-"),
             res["served_latency_s"].get("max", "-")]]
    for status, q in res["refusal_s"].items():
        rows.append([f"refused {status}", q["n"], q["p50"], q["p99"], q["max"]])
    rows += [["failed", c["failed"], "-", "-", "-"], ["pending at deadline", c["pending"], "-", "-", "-"]]
    table = format_table(["outcome", "requests", "p50 s (TTFT / refusal)", "p99 s", "max s"], rows)
    return (f"{table}\n\nrefusals with Retry-After: {res['refusals_with_retry_after']}; "
            f"preemptions on the scraped workers: {res['preemptions']}; wall {res['wall_s']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="random:tiny")
    p.add_argument("--num-prompts", type=int, default=500)
    p.add_argument("--input-len", type=int, default=32, help="words per prompt (bench/serve.py's `words` prompts)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=60.0,
                   help="seconds after the burst at which a request that is neither served nor refused counts as "
                        "pending and is cancelled")
    p.add_argument("--settle", type=float, default=2.0, help="seconds to wait before the last metrics scrape")
    p.add_argument("--metrics-url", action="append", default=[],
                   help="a worker's Prometheus page, for its preemption count (repeatable)")
    p.add_argument("--result-file", default=None)
    args = p.parse_args(argv)
    res = asyncio.run(run(args))
    print(report(res))
    if args.result_file:
        write_json(args.result_file, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
