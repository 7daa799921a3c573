"""Serving benchmark: Poisson arrivals against an OpenAI-compatible HTTP server (Tandem's router or vLLM's).

    python bench/serve.py --base-url http://127.0.0.1:8000 --model smollm2 \
        --num-prompts 64 --input-len 128 --output-len 64 --request-rate 2 --seed 0
    python bench/serve.py --model random:qwen2.5-7b --dataset-name random --input-len 512 --output-len 128 \
        --num-prompts 100 --request-rates 4,8,16,32 --idle-ttft-probes 10 --result-file disagg.json
    python bench/serve.py --compare disaggregated=disagg.json colocated=colo.json

It speaks only the OpenAI API (streaming `/v1/completions`, or `/v1/chat/completions` with --backend openai-chat),
so the same command measures a vLLM server. Prompts (--dataset-name): `words`, random English words (about one
token each with a real tokenizer; about five with a byte-level one), or `random`, exactly --input-len random token
ids in [260, 512) sent as a token-id prompt (ids every model here has: above the synthetic byte-level tokenizer's
bytes and special tokens, below the smallest preset vocabulary). Each rate of a sweep gets its own prompts, so the
prefix cache does not carry one rate's prompts into the next; --random-prefix-len puts a shared prefix (one of
--num-prefixes) before every prompt (a system prompt: what the prefix cache and the router's cache_aware policy are
for). The real prompt and output lengths come back in each stream's usage chunk and are what the throughput counts. `ignore_eos` (a vLLM extension Tandem shares) makes
every request produce --output-len tokens.

Reported per request rate: TTFT, inter-token latency (ITL: the gaps between streamed chunks; the first gap, where a
disaggregated server hands the request from prefill to decode, also apart), time per output token (TPOT: a
request's (latency - TTFT) / (output tokens - 1), the mean of its ITLs) and end-to-end latency (mean, p50, p99),
request and token throughput, and goodput.

Goodput follows DistServe (Zhong et al., OSDI '24): a request meets the SLOs when its TTFT <= --slo-ttft-ms and its
TPOT <= --slo-itl-ms (per request, the mean of its inter-token gaps, not every single gap, so one slow step does
not fail a request whose pace is right; vLLM's `--goodput tpot:` is the same test). Per rate: goodput = requests
meeting both / duration (req/s) and SLO attainment = requests meeting both / requests sent (failed ones count
against it). Across a sweep, DistServe's per-GPU goodput: the highest swept rate up to which every swept rate's
attainment is at least --slo-attainment (90 %).

--idle-ttft-probes N first sends N single requests one after another (each after the previous finished; the
warm-up sent one of the same shape before) with --idle-input-len tokens and --idle-output-len output tokens (more
than one, so that a disaggregated server takes its full path: decode reservation, prefill, KV transfer) and reports
their TTFT: the latency of an idle server.

Output: a Markdown table on stdout and JSON (with machine, commit and date) in --result-file. When the server (or
--metrics-url: Tandem's workers export their metrics on their own ports) exposes `tandem:kv_transfer_seconds`, it
also reports the mean KV transfer time (open to acknowledgement, as the prefill worker measures it) and its ratio to
the mean TTFT. The transfer overlaps the prefill compute and the first token does not wait for it, so the ratio
bounds from above the share of TTFT spent moving KV. Where the pages export `tandem:time_to_first_token_seconds`,
each role's own mean TTFT is reported beside the client's (router: validation to first delta; prefill: queueing and
prefill), which splits a TTFT into HTTP, routing and prefill. `--compare LABEL=FILE ...` prints one table from several
result files (bench/gpu_serve.sh compares the disaggregated stack with one colocated engine that way).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
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


# --dataset-name random draws token ids from here (see the module docstring).
RANDOM_TOKEN_IDS = range(260, 512)
PREFIX_SEED = 20241130  # --random-prefix-len's shared prefix: one for the whole run


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (DistServe's TPOT); None with fewer than two tokens."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass
class SLO:
    ttft_s: float
    """Time to first token, at most."""
    tpot_s: float
    """A request's mean inter-token latency (TPOT), at most."""

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO ttft_s={self.ttft_s}, tpot_s={self.tpot_s}: both must be > 0")

    def met(self, r: Result) -> bool:
        """Completed, TTFT within the SLO, and (with two or more tokens) TPOT within it."""
        return r.ok and r.ttft <= self.ttft_s and (r.tpot is None or r.tpot <= self.tpot_s)


def goodput(results: list[Result], duration: float, slo: SLO) -> dict:
    """Requests meeting the SLO: how many, per second of the run, and as a share of all requests sent."""
    good = sum(slo.met(r) for r in results)
    return {"good": good, "goodput_per_s": good / duration if duration > 0 else 0.0,
            "attainment": good / len(results) if results else 0.0}


def max_rate_meeting(runs: list[dict], attainment: float) -> float | None:
    """DistServe's goodput over a sweep: the highest swept request rate up to which every swept rate has an SLO
    attainment >= `attainment` (a rate that meets it above one that did not is noise, not capacity); None when
    the lowest rate misses it. Rates are taken as swept, with no interpolation between them."""
    best = None
    for run in sorted(runs, key=lambda run: run["request_rate"]):
        if run["results"]["slo"]["attainment"] < attainment:
            break
        best = run["request_rate"]
    return best


def make_prompts(n: int, input_len: int, seed: int, dataset: str = "words", prefix_len: int = 0,
                 num_prefixes: int = 1) -> list[str] | list[list[int]]:
    """n prompts of input_len random tokens (or words), each after one of num_prefixes prefixes of prefix_len
    tokens, drawn at random (vLLM's --random-prefix-len and --prefix-repetition-num-prefixes: system prompts or
    conversations that requests share; the same prefixes for every seed). Drawn, not in turn: prefix i mod N would
    line up with a round-robin router's i mod instances and hand it a perfect affinity no real traffic has."""
    rng, fixed = random.Random(seed), random.Random(PREFIX_SEED)
    if dataset == "random":
        prefixes = [[fixed.choice(RANDOM_TOKEN_IDS) for _ in range(prefix_len)] for _ in range(num_prefixes)]
        return [(rng.choice(prefixes) if prefix_len else []) + [rng.choice(RANDOM_TOKEN_IDS) for _ in range(input_len)]
                for _ in range(n)]
    prefixes = [" ".join(fixed.choice(WORDS) for _ in range(prefix_len)) for _ in range(num_prefixes)]
    return [(rng.choice(prefixes) + " " if prefix_len else "") + " ".join(rng.choice(WORDS) for _ in range(input_len))
            for _ in range(n)]


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, prompt: str | list[int],
                      output_len: int | None = None) -> Result:
    chat = args.backend == "openai-chat"
    body = {"model": args.model, "max_tokens": output_len or args.output_len, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
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


def _client(limit: int, timeout: float | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0),
                             limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit))


async def run(args: argparse.Namespace, prompts: list, rate: float) -> tuple[list[Result], float]:
    """Sends prompts at Poisson arrivals of `rate` per second (inf: all at once); results in prompt order."""
    rng = random.Random(args.seed + 1)
    limit = args.max_concurrency or len(prompts)
    sem = asyncio.Semaphore(limit)
    async with _client(limit) as client:
        async def limited(prompt) -> Result:
            async with sem:
                return await one_request(client, args, prompt)

        tasks = []
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.create_task(limited(prompt)))
            if rate != math.inf and i + 1 < len(prompts):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


async def idle_ttft(args: argparse.Namespace) -> tuple[dict, list[Result]]:
    """--idle-ttft-probes requests one at a time (the warm-up sent one of the same shape before)."""
    prompts = make_prompts(args.idle_ttft_probes, args.idle_input_len, args.seed + 7919, args.dataset_name)
    results = []
    async with _client(1) as client:
        for prompt in prompts:
            results.append(await one_request(client, args, prompt, args.idle_output_len))
    ok = [r.ttft for r in results if r.ok]
    return ({"probes": len(results), "failed": len(results) - len(ok),
             "errors": sorted({r.error for r in results if not r.ok})[:5],
             "mean_prompt_tokens": sum(r.prompt_tokens for r in results if r.ok) / len(ok) if ok else 0,
             "ttft_ms": {"mean": 1e3 * sum(ok) / len(ok) if ok else math.nan, "min": 1e3 * min(ok, default=math.nan),
                         "p50": 1e3 * percentile(ok, 50), "max": 1e3 * max(ok, default=math.nan)}},
            results)


def scrape(urls: list[str]) -> dict[str, dict[str, float]]:
    """role -> {`tandem:kv_transfer_seconds_sum`, `..._count`, `tandem:time_to_first_token_seconds_sum`, `..._count`,
    `tandem:prefix_cache_queries_total`, `..._hits_total`} summed over the given /metrics pages (pages that do not
    answer are skipped)."""
    by_role: dict[str, dict[str, float]] = {}
    for url in urls:
        try:
            text = httpx.get(url, timeout=5).text
        except httpx.HTTPError:
            continue
        for m in re.finditer(r"^(tandem:(?:(?:kv_transfer|time_to_first_token)_seconds_(?:sum|count)|"
                             r"prefix_cache_(?:queries|hits)_total))(?:\{([^}]*)\})?\s+(\S+)$", text, re.M):
            role = (re.search(r'role="([^"]*)"', m.group(2) or "") or [None, ""])[1]
            totals = by_role.setdefault(role, {})
            totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(3))
    return by_role


def scraped_delta(before: dict, after: dict) -> dict:
    """What the counters of `scrape` gained between two readings, by role."""
    return {role: {k: v - before.get(role, {}).get(k, 0.0) for k, v in totals.items()}
            for role, totals in after.items()}


def server_view(delta: dict) -> dict:
    """From a scraped_delta: each role's own mean TTFT (router: validation to first delta; prefill: queueing +
    prefill), the mean KV transfer time from the sender's side (role "prefill") where it is exported, and the
    prefix cache's hit rate (prompt tokens found cached / looked up) of the engines that computed prompts."""
    out: dict = {"ttft_ms_by_role": {}}
    for role in ("prefill", "colocated"):
        t = delta.get(role, {})
        if t.get("tandem:prefix_cache_queries_total"):
            out["prefix_cache_hit_rate"] = (t.get("tandem:prefix_cache_hits_total", 0.0)
                                            / t["tandem:prefix_cache_queries_total"])
    for role, t in sorted(delta.items()):
        if t.get("tandem:time_to_first_token_seconds_count"):
            out["ttft_ms_by_role"][role] = (1e3 * t["tandem:time_to_first_token_seconds_sum"]
                                            / t["tandem:time_to_first_token_seconds_count"])
    for role in ("prefill", *sorted(delta)):
        t = delta.get(role, {})
        if t.get("tandem:kv_transfer_seconds_count"):
            out["kv_transfers"] = t["tandem:kv_transfer_seconds_count"]
            out["kv_transfer_mean_ms"] = 1e3 * t["tandem:kv_transfer_seconds_sum"] / t["tandem:kv_transfer_seconds_count"]
            break
    return out


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[Result], duration: float, server: dict | None, slo: SLO) -> dict:
    ok = [r for r in results if r.ok]
    ms = lambda xs: {"mean": 1e3 * sum(xs) / len(xs) if xs else math.nan,  # noqa: E731
                     "p50": 1e3 * percentile(xs, 50), "p99": 1e3 * percentile(xs, 99)}
    tpot = [r.tpot for r in ok if r.tpot is not None]
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
        "slo": {"ttft_ms": 1e3 * slo.ttft_s, "tpot_ms": 1e3 * slo.tpot_s, **goodput(results, duration, slo)},
    }
    if server:
        s["server_ttft_ms_by_role"] = server["ttft_ms_by_role"]
        if "prefix_cache_hit_rate" in server:
            s["prefix_cache_hit_rate"] = server["prefix_cache_hit_rate"]
        if "kv_transfers" in server:
            s["kv_transfer"] = {"transfers": server["kv_transfers"], "mean_ms": server["kv_transfer_mean_ms"],
                                "share_of_mean_ttft": server["kv_transfer_mean_ms"] / s["ttft_ms"]["mean"] if ok
                                else None}
    return s


def print_table(s: dict, args, rate: float) -> None:
    rows = [["base URL / model", f"{args.base_url} / {args.model}"],
            ["request rate (req/s) / max concurrency", f"{rate} / {args.max_concurrency or '-'}"],
            ["successful / failed requests", f"{s['completed']} / {s['failed']}"],
            ["duration (s)", f"{s['duration_s']:.2f}"],
            ["mean prompt / output tokens", f"{s['mean_prompt_tokens']:.1f} / {s['mean_output_tokens']:.1f}"],
            ["request throughput (req/s)", f"{s['request_throughput_per_s']:.3f}"],
            ["output token throughput (tok/s)", f"{s['output_token_throughput_per_s']:.2f}"],
            ["total token throughput (tok/s)", f"{s['total_token_throughput_per_s']:.2f}"]]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("first_itl_ms", "1st->2nd token"),
                       ("e2e_latency_ms", "E2E latency")):
        rows.append([f"{label} mean / p50 / p99 (ms)", " / ".join(f"{s[key][q]:.1f}" for q in ("mean", "p50", "p99"))])
    slo = s["slo"]
    rows.append([f"goodput (TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms)",
                 f"{slo['goodput_per_s']:.3f} req/s ({100 * slo['attainment']:.0f}% of requests)"])
    for role, mean in s.get("server_ttft_ms_by_role", {}).items():
        rows.append([f"TTFT as the {role} measures it, mean (ms)", f"{mean:.1f}"])
    if "prefix_cache_hit_rate" in s:
        rows.append(["prefix cache hit rate (prompt tokens, engines)", f"{100 * s['prefix_cache_hit_rate']:.1f}%"])
    if "kv_transfer" in s:
        kv = s["kv_transfer"]
        rows.append(["KV transfers / mean open-to-ack (ms)", f"{kv['transfers']:.0f} / {kv['mean_ms']:.1f}"])
        rows.append(["KV open-to-ack / mean TTFT", f"{100 * kv['share_of_mean_ttft']:.1f}%"])
    print(format_table(["metric", "value"], rows))
    for e in s["errors"]:
        print("error:", e)


SWEEP_HEADERS = ["rate (req/s)", "ok / failed", "TTFT p50 / p99 (ms)", "ITL p50 / p99 (ms)", "TPOT p50 / p99 (ms)",
                 "goodput (req/s)", "SLO met", "output tok/s"]


def sweep_row(run: dict) -> list[str]:
    s = run["results"]
    pair = lambda key: f"{s[key]['p50']:.1f} / {s[key]['p99']:.1f}"  # noqa: E731
    return [f"{run['request_rate']:g}", f"{s['completed']} / {s['failed']}", pair("ttft_ms"), pair("itl_ms"),
            pair("tpot_ms"), f"{s['slo']['goodput_per_s']:.2f}", f"{100 * s['slo']['attainment']:.0f}%",
            f"{s['output_token_throughput_per_s']:.0f}"]


def idle_cell(idle: dict | None) -> str:
    if not idle:
        return "-"
    t = idle["ttft_ms"]
    cell = f"p50 {t['p50']:.1f} ms (min {t['min']:.1f}, max {t['max']:.1f}; {idle['probes'] - idle['failed']} ok)"
    by_role = idle.get("server", {}).get("ttft_ms_by_role", {})
    if by_role:
        cell += "; the server's own mean: " + ", ".join(f"{role} {ms:.1f} ms" for role, ms in by_role.items())
    return cell


def compare(labelled: list[str]) -> str:
    """One table from several result files: `LABEL=PATH` each; an idle-TTFT line and DistServe goodput per file."""
    rows, notes = [], []
    for item in labelled:
        label, sep, path = item.partition("=")
        if not sep:
            raise ValueError(f"--compare {item!r}: must be LABEL=PATH")
        data = json.loads(Path(path).read_text())
        runs, args = data["runs"], data["args"]
        rows += [[label, *sweep_row(run)] for run in runs]
        best = max_rate_meeting(runs, args["slo_attainment"])
        notes.append(f"{label}: idle TTFT ({args['idle_input_len']}-token prompt) {idle_cell(data.get('idle_ttft'))}; "
                     f"DistServe goodput (highest swept rate up to which >= {100 * args['slo_attainment']:.0f}% of "
                     f"requests meet TTFT <= "
                     f"{args['slo_ttft_ms']:g} ms and TPOT <= {args['slo_itl_ms']:g} ms): "
                     f"{'none' if best is None else f'{best:g} req/s'}")
    return format_table(["server", *SWEEP_HEADERS], rows) + "\n\n" + "\n".join(notes)


def _rates(value: str) -> list[float]:
    try:
        rates = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: must be comma-separated numbers (inf allowed)") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"{value!r}: each rate must be > 0")
    return rates


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--backend", choices=("openai", "openai-chat"), default="openai",
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions")
    p.add_argument("--dataset-name", choices=("words", "random"), default="words",
                   help="words: random English words; random: --input-len random token ids (exact length)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per rate")
    p.add_argument("--input-len", type=int, default=128, help="prompt length: words, or tokens with random")
    p.add_argument("--random-prefix-len", type=int, default=0,
                   help="a prefix of this many tokens (words) shared by every prompt, before its --input-len "
                        "random ones (vLLM's flag; a system prompt, for prefix caching and --policy cache_aware)")
    p.add_argument("--num-prefixes", "--prefix-repetition-num-prefixes", type=int, default=1,
                   help="with --random-prefix-len: this many different prefixes, each prompt after one drawn at "
                        "random")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of each request")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean arrivals per second (Poisson); inf sends all at once")
    p.add_argument("--request-rates", type=_rates, default=None,
                   help="a sweep, e.g. 4,8,16,32: one run of --num-prompts per rate, in this order "
                        "(replaces --request-rate)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--slo-ttft-ms", type=float, default=200.0, help="goodput: TTFT at most (default: 200)")
    p.add_argument("--slo-itl-ms", "--slo-tpot-ms", type=float, default=30.0,
                   help="goodput: a request's mean inter-token latency (TPOT) at most (default: 30)")
    p.add_argument("--slo-attainment", type=float, default=0.9,
                   help="sweep goodput: the highest rate up to which every rate has at least this share of "
                        "requests within both SLOs (default: 0.9)")
    p.add_argument("--idle-ttft-probes", type=int, default=0,
                   help="first send this many single requests one at a time and report their TTFT (default: 0)")
    p.add_argument("--idle-input-len", type=int, default=512, help="prompt length of the idle probes (default: 512)")
    p.add_argument("--idle-output-len", type=int, default=16, help="max_tokens of the idle probes (default: 16)")
    p.add_argument("--metrics-url", action="append", default=None,
                   help="Prometheus pages to read tandem:kv_transfer_seconds and each role's "
                        "tandem:time_to_first_token_seconds from (repeat for several; default: BASE_URL/metrics)")
    p.add_argument("--prefill-instances", type=int, default=1,
                   help="prefill instances behind --base-url (recorded for `tandem plan --from-bench`; default: 1)")
    p.add_argument("--decode-instances", type=int, default=1,
                   help="decode instances behind --base-url (recorded for `tandem plan --from-bench`; default: 1)")
    p.add_argument("--result-file", "--json", default=None, help="where to write the JSON (default: none)")
    p.add_argument("--compare", nargs="+", metavar="LABEL=FILE", default=None,
                   help="print one table from result files of earlier runs, then exit (no server needed)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.compare:
        try:
            print(compare(args.compare))
        except (OSError, ValueError, KeyError) as e:
            print(f"serve.py --compare: {e}", file=sys.stderr)
            return 1
        return 0
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1 or args.request_rate <= 0:
        p.error("--num-prompts, --input-len, --output-len and --request-rate must be > 0")
    if args.random_prefix_len < 0 or args.num_prefixes < 1:
        p.error(f"--random-prefix-len={args.random_prefix_len}, --num-prefixes={args.num_prefixes}: must be >= 0 "
                "and >= 1")
    if args.idle_ttft_probes < 0 or args.idle_input_len < 1 or args.idle_output_len < 1:
        p.error("--idle-ttft-probes must be >= 0, --idle-input-len and --idle-output-len >= 1")
    if not 0 < args.slo_attainment <= 1:
        p.error(f"--slo-attainment={args.slo_attainment}: must be in (0, 1]")
    if args.dataset_name == "random" and args.backend == "openai-chat":
        p.error("--dataset-name random sends token ids, which /v1/chat/completions does not take: use --backend openai")
    try:
        slo = SLO(args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3)
    except ValueError as e:
        p.error(f"--slo-ttft-ms, --slo-itl-ms: {e}")
    rates = args.request_rates or [args.request_rate]

    warm = asyncio.run(_warmup(args))
    if not warm.ok:
        print(f"serve.py: the warm-up request failed: {warm.error}", file=sys.stderr)
        return 1
    metrics_urls = args.metrics_url or [args.base_url.rstrip("/") + "/metrics"]
    idle, idle_results = (None, [])
    if args.idle_ttft_probes:
        before = scrape(metrics_urls)
        idle, idle_results = asyncio.run(idle_ttft(args))
        idle["server"] = server_view(scraped_delta(before, scrape(metrics_urls)))
        print(f"idle TTFT, {idle['mean_prompt_tokens']:.0f}-token prompts one at a time: {idle_cell(idle)}",
              flush=True)
    runs = []
    for k, rate in enumerate(rates):
        prompts = make_prompts(args.num_prompts, args.input_len, args.seed + 1000 * k, args.dataset_name,
                               args.random_prefix_len, args.num_prefixes)
        before = scrape(metrics_urls)
        results, duration = asyncio.run(run(args, prompts, rate))
        summary = summarize(results, duration, server_view(scraped_delta(before, scrape(metrics_urls))), slo)
        runs.append({"request_rate": rate, "results": summary, "requests": [asdict(r) for r in results]})
        if args.result_file:  # after every rate: a sweep cut short keeps what it measured
            write_json(args.result_file, {
                "args": {k: (str(v) if v == math.inf else v) for k, v in vars(args).items()},
                "idle_ttft": idle, "idle_requests": [asdict(r) for r in idle_results], "runs": runs})
        if len(rates) == 1:
            print_table(summary, args, rate)
        else:
            print(f"rate {rate:g} |", " | ".join(sweep_row(runs[-1])[1:]), flush=True)
            for e in summary["errors"]:
                print("error:", e)
    if len(rates) > 1:
        print(format_table(SWEEP_HEADERS, [sweep_row(run) for run in runs]))
        best = max_rate_meeting(runs, args.slo_attainment)
        print(f"DistServe goodput (highest swept rate up to which >= {100 * args.slo_attainment:.0f}% of requests "
              f"meet the SLOs): "
              f"{'none' if best is None else f'{best:g} req/s'}")
    if args.result_file:
        print(f"wrote {args.result_file}")
    return 0 if all(run["results"]["completed"] for run in runs) else 1


async def _warmup(args) -> Result:
    """One request of the sweep's shape, and one of the idle probes' shape when they differ, so that neither
    measurement meets a cold path (first compilations, connection set-up)."""
    shapes = {(args.input_len, 4)}
    if args.idle_ttft_probes:
        shapes.add((args.idle_input_len, args.idle_output_len))
    async with _client(1, timeout=600.0) as client:
        for input_len, output_len in sorted(shapes):
            res = await one_request(client, args, make_prompts(1, input_len, args.seed - 1 - input_len,
                                                               args.dataset_name)[0], output_len)
            if not res.ok:
                return res
    return res


if __name__ == "__main__":
    sys.exit(main())
