"""kv_transfer/layout.py: runs of consecutive block ids, the layout check's message, and the malloc setting both sides'
processes take, which keeps message buffers off the page-fault path. (The bytes of block runs: test_grpc_bytes.py.)"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import torch

from kv_transfer.layout import id_runs, layout_mismatch, layout_of

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_id_runs():
    assert id_runs([5]) == [(0, 5, 1)]
    assert id_runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert id_runs([7, 6]) == [(0, 7, 1), (1, 6, 1)]


def test_a_layout_mismatch_quotes_the_peers_value_in_short():
    mine = layout_of(torch.zeros(2, 2, 2, 4, 2, 8))
    theirs = type(mine)()
    theirs.CopyFrom(mine)
    theirs.dtype = "\U0001F600" * 1_000_000  # (the message goes back as a status and into the log)
    msg = layout_mismatch(mine, theirs)
    assert msg.startswith("layout.dtype='\U0001F600") and msg.endswith(
        "... (1000000 characters): this decode instance's KV cache has dtype='float32'"), msg[-120:]
    assert len(msg) < 200


_CHURN = """
import resource, sys
from kv_transfer.layout import retain_freed_memory
if sys.argv[1] == "tuned":
    assert retain_freed_memory() and retain_freed_memory()
def cycle():  # what a transfer does to the heap: many message-sized buffers, filled, then freed
    held = [bytearray(b"\\x01") * (900 << 10) for _ in range(24)]
    del held
cycle()
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    cycle()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_retain_freed_memory_stops_the_page_faults_of_message_buffers():
    """Freed message-sized buffers are reused, not handed back to the OS and faulted in again (a fresh process each:
    the setting is process-wide)."""
    faults = {mode: float(subprocess.run([sys.executable, "-c", _CHURN, mode], capture_output=True, text=True,
                                         check=True, cwd=REPO_ROOT).stdout) for mode in ("default", "tuned")}
    pages = 24 * (900 << 10) / 4096
    assert faults["default"] > pages / 2, faults  # glibc's defaults give the freed top of the heap back each cycle
    assert faults["tuned"] < pages / 20, faults
