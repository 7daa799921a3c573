"""`tandem up --colocated`: one router process running one engine for prefill and decode, behind the same OpenAI
HTTP API as the disaggregated stack (the baseline bench/gpu_serve.sh measures against). A real process on loopback;
greedy outputs are compared with the offline engine (engine.LLM) on random:tiny, token for token."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine import LLM, SamplingParams
from ports import free_port_block

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Once upon a time", "Hello, my name is", "The capital of France is"]
MAX_TOKENS = 12
IDS = {"logprobs": 0, "return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def colocated():
    """`tandem up --colocated --model random:tiny`, once ready: (base URL, process, its output lines)."""
    base = free_port_block(2)
    proc = subprocess.Popen([sys.executable, "-m", "cli", "up", "--colocated", "--model", "random:tiny",
                             "--http-port", str(base), "--grpc-port", str(base + 1)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "tandem up: ready." in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 240
    while not ready.wait(0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("tandem up --colocated did not get ready:\n" + "".join(lines[-40:]))
    yield f"http://127.0.0.1:{base}", proc, lines
    proc.send_signal(2)  # SIGINT, as Ctrl-C
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def client(colocated):
    with httpx.Client(base_url=colocated[0], timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM("random:tiny", device="cpu", kv_cache_memory=0.05)


def ids_of(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_one_process_serves_health_and_models(colocated, client):
    _, proc, lines = colocated
    started = [line for line in lines if line.startswith("tandem up: started")]
    assert len(started) == 1 and "tandem router --colocated" in started[0], started
    assert "one colocated engine" in "".join(lines)
    assert client.get("/health").status_code == 200
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["random:tiny"]


def test_greedy_completions_equal_offline_engine(client, tiny_llm):
    expected = tiny_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    for prompt, exp in zip(PROMPTS, expected):
        r = client.post("/v1/completions", json={"model": "random:tiny", "prompt": prompt, "temperature": 0,
                                                 "max_tokens": MAX_TOKENS, **IDS})
        assert r.status_code == 200, r.text
        body = r.json()
        (choice,) = body["choices"]
        assert ids_of(choice["logprobs"]["tokens"]) == exp.outputs[0].token_ids, prompt
        if "\ufffd" not in exp.outputs[0].text:
            assert choice["text"] == exp.outputs[0].text
        assert choice["finish_reason"] == exp.outputs[0].finish_reason
        assert body["usage"]["prompt_tokens"] == len(exp.prompt_token_ids)
        assert body["usage"]["completion_tokens"] == len(exp.outputs[0].token_ids)


def test_streamed_greedy_tokens_equal_offline_engine(client, tiny_llm):
    (exp,) = tiny_llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    body = {"model": "random:tiny", "prompt": PROMPTS[0], "temperature": 0, "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **IDS}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = [json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]"
                  for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == MAX_TOKENS
    chunks = events[:-2]
    assert len(chunks) > 1  # streamed token by token, not in one piece
    assert ids_of([t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]) == exp.outputs[0].token_ids
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_n2_seeded_sampling_and_a_bad_request(client):
    body = {"model": "random:tiny", "prompt": PROMPTS[2], "n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 8,
            "ignore_eos": True}
    a, b = client.post("/v1/completions", json=body).json(), client.post("/v1/completions", json=body).json()
    assert sorted(c["index"] for c in a["choices"]) == [0, 1]
    assert a["usage"]["completion_tokens"] == 16
    assert sorted(c["text"] for c in a["choices"]) == sorted(c["text"] for c in b["choices"])  # seeded: repeatable
    r = client.post("/v1/completions", json={"model": "random:tiny", "prompt": "x", "max_tokens": 10 ** 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert client.get("/health").status_code == 200


def test_concurrent_streams_finish_and_nothing_stays_running(client):
    import concurrent.futures

    def one(i: int) -> int:
        r = client.post("/v1/completions", json={"model": "random:tiny", "prompt": f"{i} bottles", "max_tokens": 6,
                                                 "ignore_eos": True, "temperature": 0})
        return r.json()["usage"]["completion_tokens"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(16))) == [6] * 16
    metrics = client.get("/metrics").text
    running = re.search(r'^tandem:num_requests_running\{[^}]*role="router"[^}]*\} (\S+)$', metrics, re.M)
    assert running is not None and float(running.group(1)) == 0.0

    def engine(name: str) -> float:  # the colocated engine's own series (its step stats)
        m = re.search(rf'^tandem:{name}\{{[^}}]*role="colocated"[^}}]*\}} (\S+)$', metrics, re.M)
        assert m is not None, name
        return float(m.group(1))

    assert engine("prefix_cache_queries_total") >= 16  # in tokens: every prompt was looked up
    assert engine("num_requests_running") == 0.0 and engine("num_requests_waiting") == 0.0
    assert engine("kv_cache_usage_perc") == 0.0  # every block freed (cached blocks count as free)


def test_serve_bench_sweeps_rates_and_probes_idle_ttft(colocated, tmp_path, capsys):
    from bench.serve import main as serve_main

    out = tmp_path / "colocated.json"
    assert serve_main(["--base-url", colocated[0], "--model", "random:tiny", "--dataset-name", "random",
                       "--input-len", "48", "--output-len", "6", "--num-prompts", "4", "--request-rates", "20,40",
                       "--idle-ttft-probes", "2", "--idle-input-len", "32", "--result-file", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["idle_ttft"]["probes"] == 2 and data["idle_ttft"]["failed"] == 0
    assert [r["prompt_tokens"] for r in data["idle_requests"]] == [32, 32]  # token-id prompts: exact lengths
    assert "router" in data["idle_ttft"]["server"]["ttft_ms_by_role"]
    assert [run["request_rate"] for run in data["runs"]] == [20.0, 40.0]
    for run in data["runs"]:
        s = run["results"]
        assert (s["completed"], s["failed"], s["mean_prompt_tokens"], s["mean_output_tokens"]) == (4, 0, 48, 6)
        assert 0 <= s["slo"]["good"] <= 4 and s["ttft_ms"]["p99"] >= s["ttft_ms"]["p50"] > 0
    assert "DistServe goodput" in capsys.readouterr().out
