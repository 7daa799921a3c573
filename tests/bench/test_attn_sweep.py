"""bench/attn_sweep.py --smoke: the whole sweep (build, check against the reference, time, summary) on tiny shapes
under Triton's interpreter, in a subprocess (TRITON_INTERPRET must be set before triton is imported)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_smoke_runs_checks_and_prints_the_summary(tmp_path):
    out = tmp_path / "rows.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "attn_sweep.py"), "--smoke", "--json", str(out)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "WRONG" not in proc.stdout
    summary = proc.stdout.split("summary:", 1)[1]
    for case in ("('decode', '2x24', 'fp8')", "('decode', '2x24', 'bf16')", "('prefill', '2x16', 'fp8')",
                 "('prefill', '2x16', 'bf16')"):
        assert case in summary
    rows = json.loads(out.read_text())["rows"]
    assert {r["config"] for r in rows} >= {"default", "new_kv=1"}
    assert all(r["ok"] for r in rows)
    assert any(r["path"] == "words1" for r in rows if r["cache"] == "fp8")  # the word walk ran on the fp8 cache


def test_parse_case_names_the_bad_value():
    sys.path.insert(0, str(REPO_ROOT))
    import argparse

    import pytest

    from bench.attn_sweep import parse_case
    assert parse_case("980x174") == (980, 174)
    with pytest.raises(argparse.ArgumentTypeError, match="'980-174'"):
        parse_case("980-174")
