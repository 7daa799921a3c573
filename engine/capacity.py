"""`tandem plan --from-bench`: capacity planning from a measured benchmark (the JSON bench/throughput.py or
bench/serve.py wrote), the practice's rule written down:

    streams per decode instance  = output tok/s per decode instance * TPOT (s) * (1 - headroom)
                                   (output tok/s / (1 / TPOT): the concurrent streams that throughput is made of,
                                   less the headroom; peak concurrency one instance sustains)
    prefill capacity             = prompt tok/s per prefill instance * (1 - headroom)
    for a target rate R (req/s):
      prompt tok/s needed        = R * mean prompt tokens
      prefill instances          = ceil(prompt tok/s needed / prefill capacity)
      concurrent decode streams  = R * mean output tokens * TPOT (s)      (Little's law: each request decodes for
                                                                           output tokens * TPOT seconds)
      decode instances           = ceil(concurrent decode streams / streams per decode instance)

What each measurement is, per bench:
  bench/throughput.py (offline, one engine: prefill and decode share it): output_tokens_per_s; tpot_ms_mean = mean
    wall time of a pure decode step (each advances every running request by one token); prefill_tokens_per_s =
    prompt tokens / the time of the steps that carried prompt tokens; prompt and output lengths = input_len and
    output_len.
  bench/serve.py (a server under Poisson load; the run with the highest output throughput unless --bench-rate picks
    one): results.output_token_throughput_per_s / args.decode_instances; results.tpot_ms.mean; prompt tok/s per
    prefill instance = results.mean_prompt_tokens * results.request_throughput_per_s / args.prefill_instances
    (what the instances did at that rate: a capacity only when the run saturated them, a lower bound otherwise).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

DEFAULT_HEADROOM = 0.3


@dataclass(frozen=True)
class Measurement:
    source: str
    """Which bench wrote it, and which run."""
    output_tokens_per_s: float
    """Per decode instance."""
    tpot_s: float
    """Mean time per output token of one request."""
    prefill_tokens_per_s: float
    """Prompt tokens per second, per prefill instance."""
    mean_prompt_tokens: float
    mean_output_tokens: float
    fields: dict
    """Where each number came from: field name -> the JSON path it was read from."""


@dataclass(frozen=True)
class CapacityPlan:
    measurement: Measurement
    headroom: float
    streams_per_decode_instance: float
    prefill_capacity_tokens_per_s: float
    target_rps: float | None = None
    prompt_tokens_per_s_needed: float | None = None
    concurrent_decode_streams: float | None = None
    prefill_instances: int | None = None
    decode_instances: int | None = None


def _get(data: dict, path: str, missing: list[str]):
    cur = data
    for key in path.split("."):
        if not isinstance(cur, dict) or key not in cur:
            missing.append(path)
            return None
        cur = cur[key]
    if isinstance(cur, bool) or not isinstance(cur, (int, float)) or not math.isfinite(cur) or cur <= 0:
        raise ValueError(f"{path}={cur!r}: must be a number > 0")
    return float(cur)


def _require(name: str, missing: list[str], hint: str) -> None:
    if missing:
        raise ValueError(f"{name}: missing fields {', '.join(missing)} ({hint})")


def read_measurement(path: str | Path, bench_rate: float | None = None) -> Measurement:
    """The numbers the plan needs, from a bench/throughput.py or bench/serve.py JSON; raises ValueError naming the
    file and every missing field."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object (a bench/throughput.py or bench/serve.py result)")
    missing: list[str] = []
    if "runs" in data:  # bench/serve.py
        runs = data["runs"]
        if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) for r in runs):
            raise ValueError(f"{path}: runs: expected a non-empty list of runs")
        if bench_rate is not None:
            picked = [r for r in runs if r.get("request_rate") == bench_rate]
            if not picked:
                raise ValueError(f"--bench-rate={bench_rate:g}: {path} has runs at "
                                 f"{', '.join(str(r.get('request_rate')) for r in runs)}")
            run = picked[0]
        else:
            run = max(runs, key=lambda r: (r.get("results") or {}).get("output_token_throughput_per_s") or 0)
        fields = {"output_tokens_per_s": "results.output_token_throughput_per_s", "tpot_ms": "results.tpot_ms.mean",
                  "request_throughput_per_s": "results.request_throughput_per_s",
                  "mean_prompt_tokens": "results.mean_prompt_tokens",
                  "mean_output_tokens": "results.mean_output_tokens"}
        v = {k: _get(run, p, missing) for k, p in fields.items()}
        inst = {k: _get(data, f"args.{k}", missing) for k in ("prefill_instances", "decode_instances")}
        _require(str(path), [f"runs[{runs.index(run)}].{m}" if not m.startswith("args.") else m for m in missing],
                 "bench/serve.py writes them; args.prefill_instances / args.decode_instances come from its "
                 "--prefill-instances / --decode-instances")
        rate = run.get("request_rate")
        return Measurement(
            source=f"bench/serve.py {path.name}, run at {rate} req/s", tpot_s=v["tpot_ms"] / 1e3,
            output_tokens_per_s=v["output_tokens_per_s"] / inst["decode_instances"],
            prefill_tokens_per_s=v["mean_prompt_tokens"] * v["request_throughput_per_s"] / inst["prefill_instances"],
            mean_prompt_tokens=v["mean_prompt_tokens"], mean_output_tokens=v["mean_output_tokens"],
            fields={**fields, "prefill_instances": "args.prefill_instances",
                    "decode_instances": "args.decode_instances"})
    fields = {"output_tokens_per_s": "output_tokens_per_s", "tpot_ms": "tpot_ms_mean",
              "prefill_tokens_per_s": "prefill_tokens_per_s", "input_len": "input_len", "output_len": "output_len"}
    v = {k: _get(data, p, missing) for k, p in fields.items()}
    _require(str(path), missing, "bench/throughput.py --backend tandem writes them; a bench/serve.py result has "
                                 "'runs'")
    return Measurement(source=f"bench/throughput.py {path.name} ({data.get('backend', '?')} backend)",
                       output_tokens_per_s=v["output_tokens_per_s"], tpot_s=v["tpot_ms"] / 1e3,
                       prefill_tokens_per_s=v["prefill_tokens_per_s"], mean_prompt_tokens=v["input_len"],
                       mean_output_tokens=v["output_len"], fields=fields)


def capacity_plan(m: Measurement, target_rps: float | None = None,
                  headroom: float = DEFAULT_HEADROOM) -> CapacityPlan:
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"headroom={headroom}: must be in [0, 1), e.g. 0.3 for 30%")
    if target_rps is not None and not (math.isfinite(target_rps) and target_rps > 0):
        raise ValueError(f"target_rps={target_rps}: must be a number > 0")
    keep = 1.0 - headroom
    streams = m.output_tokens_per_s * m.tpot_s * keep
    prefill_cap = m.prefill_tokens_per_s * keep
    if target_rps is None:
        return CapacityPlan(m, headroom, streams, prefill_cap)
    need_prompt = target_rps * m.mean_prompt_tokens
    need_streams = target_rps * m.mean_output_tokens * m.tpot_s
    return CapacityPlan(m, headroom, streams, prefill_cap, target_rps, need_prompt, need_streams,
                        prefill_instances=math.ceil(need_prompt / prefill_cap),
                        decode_instances=math.ceil(need_streams / streams))


def format_capacity(c: CapacityPlan) -> str:
    m, keep = c.measurement, 1.0 - c.headroom
    f = m.fields
    rows = [
        ("measured", m.source),
        ("output tok/s per decode instance", f"{m.output_tokens_per_s:,.1f}  ({f['output_tokens_per_s']})"),
        ("TPOT", f"{1e3 * m.tpot_s:,.2f} ms  ({f['tpot_ms']})"),
        ("prompt tok/s per prefill instance", f"{m.prefill_tokens_per_s:,.1f}"),
        ("mean prompt / output tokens", f"{m.mean_prompt_tokens:,.1f} / {m.mean_output_tokens:,.1f}"),
        (f"peak concurrency per instance ({100 * c.headroom:g}% headroom)",
         f"{c.streams_per_decode_instance:,.1f} streams = {m.output_tokens_per_s:,.1f} tok/s x "
         f"{m.tpot_s:.4f} s x {keep:g}"),
        ("prefill capacity per instance", f"{c.prefill_capacity_tokens_per_s:,.1f} tok/s = "
                                          f"{m.prefill_tokens_per_s:,.1f} x {keep:g}"),
    ]
    if c.target_rps is not None:
        rows += [
            (f"target {c.target_rps:g} req/s: prompt tok/s", f"{c.prompt_tokens_per_s_needed:,.1f} = "
                                                            f"{c.target_rps:g} x {m.mean_prompt_tokens:,.1f}"),
            ("prefill instances", f"{c.prefill_instances} = ceil({c.prompt_tokens_per_s_needed:,.1f} / "
                                  f"{c.prefill_capacity_tokens_per_s:,.1f})"),
            ("concurrent decode streams", f"{c.concurrent_decode_streams:,.1f} = {c.target_rps:g} x "
                                          f"{m.mean_output_tokens:,.1f} x {m.tpot_s:.4f} s"),
            ("decode instances", f"{c.decode_instances} = ceil({c.concurrent_decode_streams:,.1f} / "
                                 f"{c.streams_per_decode_instance:,.1f})"),
        ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
