"""Helpers shared by the bench/ scripts: run metadata (machine, commit, date), a plain-text table, JSON output."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> dict[str, Any]:
    """The checked-out commit and whether tracked files differ from it. Outside a git checkout (the GPU machine gets a
    copy of the tree without .git): $TANDEM_COMMIT when set, else "unknown"."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return {"sha": os.environ.get("TANDEM_COMMIT", "unknown"), "dirty": None}
    return {"sha": sha, "dirty": dirty}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPU, cores, threads, GPUs, library versions."""
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else [],
    }
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def run_metadata() -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": machine_info(),
        "argv": sys.argv,
    }


def write_json(path: str | os.PathLike, results: dict[str, Any]) -> dict[str, Any]:
    """Write `results` with the run's metadata under "meta"; returns what was written."""
    payload = {"meta": run_metadata(), **results}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return payload


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table (pastes into bench/RESULTS.md as is); floats with 2 decimals."""
    def cell(v: Any) -> str:
        return f"{v:.2f}" if isinstance(v, float) else str(v)
    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda vals: "| " + " | ".join(v.rjust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def compile_in_processes(worker, items: list, workers: int) -> None:
    """Runs worker(chunk) -> [error strings] over items split across `workers` spawned processes (one process, or
    this one, for fewer): Triton kernels launched once there land in its on-disk cache, so the timed runs that
    follow compile nothing. Prints the first errors and the time taken."""
    import multiprocessing as mp
    import time
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.time()
    if workers <= 1 or len(items) <= 1:
        errors = worker(items)
    else:
        chunks = [c for c in (items[i::workers] for i in range(workers)) if c]
        with ProcessPoolExecutor(len(chunks), mp_context=mp.get_context("spawn")) as ex:
            errors = [e for errs in ex.map(worker, chunks) for e in errs]
    for e in errors[:8]:
        print("  compile error:", e, flush=True)
    print(f"compiled {len(items)} kernel variants in {time.time() - t0:.1f} s ({workers} processes)", flush=True)
