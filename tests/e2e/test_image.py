"""The image's install steps work: scripts/image-install (what the Dockerfile runs) into a fresh venv, then that venv's
`tandem up` serves a request from the default model, converting its GGUF on the way, from a directory outside the
repository (so nothing is imported from the source tree). No Docker engine runs here; the venv stands in for the
image. Only the CPU torch wheel is installed first (the image gets the CUDA one from the same `pip install`)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from ports import free_port_block

ROOT = Path(__file__).resolve().parents[2]
TORCH_CPU = "torch==2.13.0"  # scripts/bootstrap's pin: an unpinned torch would pull a multi-GB CUDA build


def test_dockerfile_runs_the_install_script_and_keeps_models_on_a_volume():
    dockerfile = (ROOT / "Dockerfile").read_text()
    runs = [line for line in dockerfile.splitlines() if line.startswith("RUN ")]
    assert "RUN bash scripts/image-install" in runs
    assert not any("pip install" in line for line in runs), "every pip step belongs in scripts/image-install"
    (cache,) = re.findall(r"^ENV TANDEM_CACHE_DIR=(\S+)$", dockerfile, re.M)
    assert f"VOLUME {cache}" in dockerfile.splitlines()
    import yaml
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for name, svc in compose["services"].items():
        if "profiles" not in svc:
            assert any(v.split(":")[1] == cache for v in svc["volumes"]), name


def _run(cmd: list[str], **kwargs) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert r.returncode == 0, f"{cmd} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


@pytest.mark.slow
def test_image_install_steps_serve_the_default_model(tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pip", "install", "-q", TORCH_CPU], timeout=900)
    _run(["bash", str(ROOT / "scripts" / "image-install")], env={**os.environ, "PYTHON": python}, timeout=900)

    base = free_port_block(6)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"TANDEM_CACHE_DIR": str(tmp_path / "models"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([str(venv / "bin" / "tandem"), "up", "--http-port", str(base), "--grpc-port",
                             str(base + 1), "--worker-port", str(base + 2), "--metrics-port", str(base + 4)],
                            cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "tandem up: ready." in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 600
        while not ready.wait(0.5):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-60:])
        r = httpx.post(f"http://127.0.0.1:{base}/v1/completions", timeout=120,
                       json={"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8,
                             "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["text"].strip()
        # The installed package served it, not the source tree.
        site = subprocess.run([python, "-c", "import engine; print(engine.__file__)"], cwd=work, env=env,
                              capture_output=True, text=True).stdout
        assert str(venv) in site and str(ROOT) not in site
        assert any((tmp_path / "models").iterdir()), "the GGUF was converted into TANDEM_CACHE_DIR"
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
