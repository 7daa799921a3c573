"""`tandem router --tokenizer DIR`, as a real process whose instances are all down: the OpenAI surface tokenizes
prompts, renders chat templates and detokenizes with DIR's tokenizer (the one the workers were given), not the
model's own, so the ids it would send are the workers' vocabulary. A directory that does not fit the model is
refused at startup, naming the flag."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120


def _router(*flags: str) -> tuple[subprocess.Popen, str]:
    http_port, grpc_port, dead = free_ports(3)
    proc = subprocess.Popen([sys.executable, "-m", "cli", "router", "--model", "random:tiny",
                             "--http-port", str(http_port), "--grpc-port", str(grpc_port),
                             "--prefill", f"127.0.0.1:{dead}", "--decode", f"127.0.0.1:{dead}", *flags],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, f"http://127.0.0.1:{http_port}"


def _wait_live(proc: subprocess.Popen, c: httpx.Client) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, f"no answer on /livez in {START_TIMEOUT_S} s"
        try:
            if c.get("/livez").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


@pytest.mark.slow
def test_the_router_tokenizes_renders_and_detokenizes_with_the_tokenizer_flag(other_tokenizer_dir):
    proc, base = _router("--tokenizer", str(other_tokenizer_dir))
    try:
        with httpx.Client(base_url=base, timeout=10) as c:
            _wait_live(proc, c)
            prompt = c.post("/tokenize", json={"prompt": "abc"})
            chat = c.post("/tokenize", json={"messages": [{"role": "user", "content": "abc"}]})
            text = c.post("/detokenize", json={"tokens": [256, 99]})
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    # random:tiny's own tokenizer makes "abc" [97, 98, 99] and has a ChatML template; DIR's merges "ab" into 256.
    assert prompt.status_code == 200 and prompt.json()["tokens"] == [256, 99], prompt.text
    assert chat.status_code == 200 and chat.json()["tokens"] == [ord(c) for c in "<user>"] + [256, 99], chat.text
    assert text.status_code == 200 and text.json()["prompt"] == "abc", text.text


@pytest.mark.slow
def test_a_tokenizer_larger_than_the_model_stops_the_router_naming_it(tmp_path):
    from engine.tokenizer import synthetic_tokenizer

    synthetic_tokenizer(600).save_pretrained(tmp_path)
    proc, _ = _router("--tokenizer", str(tmp_path))
    _, err = proc.communicate(timeout=START_TIMEOUT_S)
    assert proc.returncode == 1, err.decode()
    assert f"tandem router: tokenizer='{tmp_path}': 600 tokens, more than the vocab_size 512" in err.decode()
