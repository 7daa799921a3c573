"""engine/capacity.py (`tandem plan --from-bench`): from a real bench/throughput.py JSON made here (random:tiny on
the CPU, a few prompts) and from bench/serve.py's summary of measured requests, the practice's arithmetic checked by
hand from the JSON's own fields; missing fields and bad flags named."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from engine.capacity import capacity_plan, read_measurement
from engine.plan import main, plan

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def throughput_json(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    subprocess.run([sys.executable, "bench/throughput.py", "--model", "random:tiny", "--num-prompts", "4",
                    "--input-len", "24", "--output-len", "8", "--max-num-batched-tokens", "64", "--out-dir",
                    str(out)], cwd=ROOT, check=True, capture_output=True, timeout=600)
    (path,) = out.glob("throughput-tandem-*.json")
    return path


@pytest.mark.slow
def test_plan_from_a_throughput_json(throughput_json, capsys):
    d = json.loads(throughput_json.read_text())
    for f in ("output_tokens_per_s", "tpot_ms_mean", "prefill_tokens_per_s", "mean_decode_batch"):
        assert d[f] > 0, f
    assert d["mean_decode_batch"] <= 4  # the 4 prompts decode together
    assert main(["--from-bench", str(throughput_json), "--target-rps", "3", "--headroom", "0.3"]) == 0
    out = capsys.readouterr().out
    # By hand, from the JSON's fields:
    streams = d["output_tokens_per_s"] * d["tpot_ms_mean"] / 1e3 * 0.7
    prefill_cap = d["prefill_tokens_per_s"] * 0.7
    need_prompt = 3 * d["input_len"]
    need_streams = 3 * d["output_len"] * d["tpot_ms_mean"] / 1e3
    c = capacity_plan(read_measurement(throughput_json), target_rps=3, headroom=0.3)
    assert c.streams_per_decode_instance == pytest.approx(streams, rel=1e-12)
    assert c.prefill_instances == math.ceil(need_prompt / prefill_cap)
    assert c.decode_instances == math.ceil(need_streams / streams)
    assert f"{streams:,.1f} streams" in out
    assert "prefill instances" in out and f"{c.prefill_instances} = ceil({need_prompt:,.1f} / {prefill_cap:,.1f})" in out
    assert f"{c.decode_instances} = ceil({need_streams:,.1f} / {streams:,.1f})" in out
    # Without a target: the peak concurrency only.
    assert main(["--from-bench", str(throughput_json)]) == 0
    assert "decode instances" not in capsys.readouterr().out


def test_plan_from_a_serve_json(tmp_path, capsys):
    """bench/serve.py's JSON shape, its summary computed by serve.py's own summarize() from measured requests."""
    sys.path.insert(0, str(ROOT))
    from bench.serve import SLO, Result, summarize

    def res(ttft, latency, n):
        return Result(ok=True, ttft=ttft, latency=latency, itl=[(latency - ttft) / (n - 1)] * (n - 1),
                      prompt_tokens=100, output_tokens=n)

    runs = [{"request_rate": r, "results": summarize([res(0.1, 0.1 + 0.02 * 49, 50)] * k, 2.0, None, SLO(1, 1))}
            for r, k in ((2, 4), (8, 16))]
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"args": {"prefill_instances": 1, "decode_instances": 2}, "runs": runs}))
    c = capacity_plan(read_measurement(path), target_rps=20, headroom=0.3)
    best = runs[1]["results"]  # the highest output throughput
    assert c.measurement.output_tokens_per_s == pytest.approx(best["output_token_throughput_per_s"] / 2)
    assert c.measurement.tpot_s == pytest.approx(0.02)
    streams = best["output_token_throughput_per_s"] / 2 * 0.02 * 0.7  # 16 * 50 / 2 s / 2 instances = 200 tok/s
    assert c.streams_per_decode_instance == pytest.approx(streams)
    assert c.prefill_instances == math.ceil(20 * 100 / (100 * 8 * 0.7))  # 800 prompt tok/s measured
    assert c.decode_instances == math.ceil(20 * 50 * 0.02 / streams)
    assert read_measurement(path, bench_rate=2).output_tokens_per_s == pytest.approx(4 * 50 / 2.0 / 2)


def test_missing_fields_are_named(tmp_path, capsys):
    hf = tmp_path / "hf.json"
    hf.write_text(json.dumps({"backend": "hf", "output_tokens_per_s": 10.0, "input_len": 8, "output_len": 4}))
    with pytest.raises(SystemExit) as e:
        main(["--from-bench", str(hf)])
    assert e.value.code == 2
    assert "missing fields tpot_ms_mean, prefill_tokens_per_s" in capsys.readouterr().err
    serve = tmp_path / "serve.json"
    serve.write_text(json.dumps({"runs": [{"request_rate": 1, "results": {"output_token_throughput_per_s": 5}}]}))
    with pytest.raises(ValueError, match=r"runs\[0\].results.tpot_ms.mean, .*args.prefill_instances"):
        read_measurement(serve)


@pytest.mark.parametrize("flags, message", [
    (["--target-rps", "0"], "--target-rps='0': must be > 0"),
    (["--headroom", "1"], "--headroom='1': must be in [0, 1)"),
    (["--model", "random:tiny"], "--model: not used with --from-bench"),
])
def test_bad_flags_are_named(tmp_path, flags, message, capsys):
    path = tmp_path / "x.json"
    path.write_text("{}")
    with pytest.raises(SystemExit):
        main(["--from-bench", str(path), *flags])
    assert message in capsys.readouterr().err


def test_int8_kv_sizing_counts_the_scales():
    p = plan("random:qwen2.5-7b", 80 * 2**30, 4096, kv_cache_dtype="int8")
    assert p.kv_cache_dtype == "int8" and p.kv_bytes_per_token == 2 * 28 * 4 * (128 + 4)
    from engine import LLM

    llm = LLM("random:tiny", device="cpu", kv_cache_memory=0.01, max_model_len=256, kv_cache_dtype="int8")
    r = llm.engine.runner
    assert plan("random:tiny", 2**30, 256, kv_cache_dtype="int8").kv_bytes_per_token * r.block_size == \
        r.kv_bytes_per_block
