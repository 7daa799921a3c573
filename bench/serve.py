"""Serving benchmark: Poisson arrivals against an OpenAI-compatible HTTP server (Tandem's router or vLLM's).

    python bench/serve.py --base-url http://127.0.0.1:8000 --model smollm2 \
        --num-prompts 64 --input-len 128 --output-len 64 --request-rate 2 --seed 0

It speaks only the OpenAI API (streaming `/v1/completions`, or `/v1/chat/completions` with --backend openai-chat),
so the same command measures a vLLM server. Prompts are random English words (about one token each); the real
prompt and output lengths come back in each stream's usage chunk and are what the throughput counts. `ignore_eos`
(a vLLM extension Tandem shares) makes every request produce --output-len tokens.

Reported: TTFT, inter-token latency (the gaps between streamed chunks; the first gap, where a disaggregated server
hands the request from prefill to decode, also apart), time per output token and end-to-end latency (mean, p50,
p99), request and token throughput; a Markdown table on stdout and JSON (with machine, commit and date) in
--result-file. When the server (or --metrics-url: Tandem's workers export their metrics on their own ports) exposes
`tandem:kv_transfer_seconds`, it also reports the mean KV transfer time (open to acknowledgement, as the prefill
worker measures it) and its ratio to the mean TTFT. The transfer overlaps the prefill compute and the first token does
not wait for it, so the ratio bounds from above the share of TTFT spent moving KV.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.common import format_table, write_json

WORDS = ("the of and to in is was for on that with as by at from his her they this had not are but which one all "
         "were when there can been has more what will would who their about out many then them these some so time "
         "like him into has look two write go see number way could people than first water been call who oil its "
         "now find long down day did get come made may part over new sound take only little work know place year "
         "live back give most very after thing our just name good sentence man think say great where help through "
         "much before line right too mean old any same tell boy follow came want show also around form three small "
         "set put end does another well large must big even such because turn here why ask went men read need land "
         "different home us move try kind hand picture again change off play spell air away animal house point page "
         "letter mother answer found study still learn should world high every near add food between own below "
         "country plant last school father keep tree never start city earth eye light thought head under story saw "
         "left few while along might close something seem next hard open example begin life always those both paper "
         "together got group often run important until children side feet car mile night walk white sea began grow "
         "took river four carry state once book hear stop without second later miss idea enough eat face watch far "
         "real almost let above girl sometimes mountain cut young talk soon list song being leave family").split()


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0


def make_prompts(n: int, input_len: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(input_len)) for _ in range(n)]


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, prompt: str) -> Result:
    chat = args.backend == "openai-chat"
    body = {"model": args.model, "max_tokens": args.output_len, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    url = args.base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    res, chunks = Result(), 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"])
                    return res
                if msg.get("usage"):
                    res.prompt_tokens = msg["usage"]["prompt_tokens"]
                    res.output_tokens = msg["usage"]["completion_tokens"]
                for choice in msg.get("choices") or []:
                    text = choice["delta"].get("content") if chat else choice.get("text")
                    if not text:
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
        res.latency = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.ok = chunks > 0
        if not res.ok:
            res.error = "the stream carried no text"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run(args: argparse.Namespace, prompts: list[str]) -> tuple[list[Result], float]:
    rng = random.Random(args.seed + 1)
    limit = args.max_concurrency or len(prompts)
    sem = asyncio.Semaphore(limit)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                 limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit)) as client:
        async def limited(prompt: str) -> Result:
            async with sem:
                return await one_request(client, args, prompt)

        tasks = []
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.create_task(limited(prompt)))
            if args.request_rate != float("inf") and i + 1 < len(prompts):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def scrape(urls: list[str]) -> dict[str, float] | None:
    """`tandem:kv_transfer_seconds` {sum, count} over the given /metrics pages, from the sender's side
    (role="prefill") where it is exported, else from whichever role exports it; None when no page has it."""
    by_role: dict[str, dict[str, float]] = {}
    for url in urls:
        try:
            text = httpx.get(url, timeout=5).text
        except httpx.HTTPError:
            continue
        for m in re.finditer(r"^(tandem:kv_transfer_seconds_(?:sum|count))(?:\{([^}]*)\})?\s+(\S+)$", text, re.M):
            role = (re.search(r'role="([^"]*)"', m.group(2) or "") or [None, ""])[1]
            totals = by_role.setdefault(role, {})
            totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(3))
    for role in ("prefill", *sorted(by_role)):
        if role in by_role:
            return by_role[role]
    return None


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[Result], duration: float, kv: dict | None, args) -> dict:
    ok = [r for r in results if r.ok]
    ms = lambda xs: {"mean": 1e3 * sum(xs) / len(xs) if xs else float("nan"),  # noqa: E731
                     "p50": 1e3 * percentile(xs, 50), "p99": 1e3 * percentile(xs, 99)}
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tokens, in_tokens = sum(r.output_tokens for r in ok), sum(r.prompt_tokens for r in ok)
    s = {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "mean_prompt_tokens": in_tokens / len(ok) if ok else 0, "mean_output_tokens": out_tokens / len(ok) if ok else 0,
        "request_throughput_per_s": len(ok) / duration,
        "output_token_throughput_per_s": out_tokens / duration,
        "total_token_throughput_per_s": (in_tokens + out_tokens) / duration,
        "ttft_ms": ms([r.ttft for r in ok]), "tpot_ms": ms(tpot),
        "itl_ms": ms([x for r in ok for x in r.itl]), "e2e_latency_ms": ms([r.latency for r in ok]),
        # The gap between the first and second streamed chunk: in a disaggregated server, the hand-off from the
        # prefill to the decode instance (what of the KV transfer the first token did not wait for) lands here.
        "first_itl_ms": ms([r.itl[0] for r in ok if r.itl]),
    }
    if kv and kv.get("tandem:kv_transfer_seconds_count"):
        per_transfer = kv["tandem:kv_transfer_seconds_sum"] / kv["tandem:kv_transfer_seconds_count"]
        s["kv_transfer"] = {"transfers": kv["tandem:kv_transfer_seconds_count"],
                            "mean_ms": 1e3 * per_transfer,
                            "share_of_mean_ttft": per_transfer / (s["ttft_ms"]["mean"] / 1e3) if ok else None}
    return s


def print_table(s: dict, args) -> None:
    rows = [["base URL / model", f"{args.base_url} / {args.model}"],
            ["request rate (req/s) / max concurrency", f"{args.request_rate} / {args.max_concurrency or '-'}"],
            ["successful / failed requests", f"{s['completed']} / {s['failed']}"],
            ["duration (s)", f"{s['duration_s']:.2f}"],
            ["mean prompt / output tokens", f"{s['mean_prompt_tokens']:.1f} / {s['mean_output_tokens']:.1f}"],
            ["request throughput (req/s)", f"{s['request_throughput_per_s']:.3f}"],
            ["output token throughput (tok/s)", f"{s['output_token_throughput_per_s']:.2f}"],
            ["total token throughput (tok/s)", f"{s['total_token_throughput_per_s']:.2f}"]]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("first_itl_ms", "1st->2nd token"),
                       ("e2e_latency_ms", "E2E latency")):
        rows.append([f"{label} mean / p50 / p99 (ms)", " / ".join(f"{s[key][q]:.1f}" for q in ("mean", "p50", "p99"))])
    if "kv_transfer" in s:
        kv = s["kv_transfer"]
        rows.append(["KV transfers / mean open-to-ack (ms)", f"{kv['transfers']:.0f} / {kv['mean_ms']:.1f}"])
        rows.append(["KV open-to-ack / mean TTFT", f"{100 * kv['share_of_mean_ttft']:.1f}%"])
    print(format_table(["metric", "value"], rows))
    for e in s["errors"]:
        print("error:", e)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--backend", choices=("openai", "openai-chat"), default="openai",
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="prompt length in words (about one token each)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of each request")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="mean arrivals per second (Poisson); inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--metrics-url", action="append", default=None,
                   help="Prometheus pages to read tandem:kv_transfer_seconds from (default: BASE_URL/metrics)")
    p.add_argument("--result-file", "--json", default=None, help="where to write the JSON (default: none)")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1 or args.request_rate <= 0:
        p.error("--num-prompts, --input-len, --output-len and --request-rate must be > 0")

    prompts = make_prompts(args.num_prompts, args.input_len, args.seed)
    warm = asyncio.run(_warmup(args))
    if not warm.ok:
        print(f"serve.py: the warm-up request failed: {warm.error}", file=sys.stderr)
        return 1
    metrics_urls = args.metrics_url or [args.base_url.rstrip("/") + "/metrics"]
    before = scrape(metrics_urls)
    results, duration = asyncio.run(run(args, prompts))
    after = scrape(metrics_urls)
    kv = {k: after[k] - (before or {}).get(k, 0.0) for k in after} if after else None
    summary = summarize(results, duration, kv, args)
    print_table(summary, args)
    if args.result_file:
        write_json(args.result_file, {"args": {k: (str(v) if v == float("inf") else v) for k, v in vars(args).items()},
                                      "results": summary, "requests": [asdict(r) for r in results]})
        print(f"wrote {args.result_file}")
    return 0 if summary["completed"] else 1


async def _warmup(args) -> Result:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        return await one_request(client, argparse.Namespace(**{**vars(args), "output_len": 2}), "Hello")


if __name__ == "__main__":
    sys.exit(main())
