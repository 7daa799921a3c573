"""engine/cpu_placement.py: core lists, the split of a host's cores between engines, and the engine applying
--cpu-threads / --cpu-cores (threads at start, the pin in the thread that steps)."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.args import EngineArgs
from engine.cpu_placement import format_cores, parse_cores, split_cores


def test_parse_and_format_cores():
    assert parse_cores("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cores("1") == [1]
    assert parse_cores("3,1-2,2") == [1, 2, 3]
    assert format_cores([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    for bad in ("", "a", "3-1", "-1", "1,,2"):
        with pytest.raises(ValueError, match="cpu_cores="):
            parse_cores(bad)


def test_split_cores():
    assert split_cores([0, 1], 2) == [(1, "0"), (1, "1")]
    assert split_cores([0, 1], 1) == [(2, "0-1")]
    assert split_cores([0, 1], 1, reserve=1) == [(1, "1")]
    assert split_cores([0], 1, reserve=1) == [(1, "0")]  # nothing to leave: the one core is shared
    assert split_cores([0, 1], 3) == [(1, "0"), (1, "1"), (1, "0")]
    assert split_cores(list(range(8)), 3) == [(3, "0-2"), (3, "3-5"), (2, "6-7")]


def test_flags_are_checked():
    with pytest.raises(ValueError, match="cpu_threads=0"):
        EngineArgs(model="random:tiny", device="cpu", cpu_threads=0).create_engine_config()
    with pytest.raises(ValueError, match="cpu_cores='x'"):
        EngineArgs(model="random:tiny", device="cpu", cpu_cores="x").create_engine_config()
    absent = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=f"core\\(s\\) {absent} are not among"):
        LLMEngine(EngineArgs(model="random:tiny", device="cpu", cpu_cores=str(absent)).create_engine_config())


def test_engine_takes_its_threads_and_pins_the_stepping_thread():
    before, cores = torch.get_num_threads(), sorted(os.sched_getaffinity(0))
    one = str(cores[-1])
    try:
        engine = LLMEngine(EngineArgs(model="random:tiny", device="cpu", cpu_cores=one).create_engine_config())
        assert torch.get_num_threads() == 1  # one per core of --cpu-cores
        seen = {}

        def run():
            engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0))
            while engine.has_unfinished_requests():
                engine.step()
            seen["cores"] = sorted(os.sched_getaffinity(0))

        t = threading.Thread(target=run)
        t.start()
        t.join()
        assert seen["cores"] == [int(one)]
        assert sorted(os.sched_getaffinity(0)) == cores  # this thread (another one) keeps every core
    finally:
        torch.set_num_threads(before)
