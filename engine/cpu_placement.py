"""Where an engine's compute runs on the host's CPU cores: its torch thread count and the cores its step thread is
pinned to (DeviceConfig.cpu_threads / cpu_cores, the flags --cpu-threads / --cpu-cores), and how `tandem up`
splits one host's cores between the engines it starts.

On the CPU every engine process takes torch's default, one OpenMP thread per core. Several engines on one host (a
prefill and a decode worker, or a colocated router's engine beside its HTTP server) then run more compute threads
than there are cores, and an OpenMP team whose threads are descheduled waits at every barrier: on 2 cores, 2
threads per engine made a decode step several times slower than 1 (bench/RESULTS.md, "CPU: Tandem beside vLLM").
vLLM's CPU build does the same: one compute thread pinned per core it owns, a core left to its server (`tandem up
--colocated` leaves its HTTP server that core only on hosts of three cores or more: cli/up.py).

Pinning applies to the thread that steps the engine (the first `LLMEngine.step` pins the calling thread; OpenMP
threads it starts later inherit the mask), not the whole process: a worker's gRPC and event-loop threads, and a
colocated router's HTTP server, keep every core.
"""
from __future__ import annotations

import os

import torch


def parse_cores(spec: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8] (sorted, each once); ValueError naming the spec otherwise."""
    cores: set[int] = set()
    try:
        for part in spec.split(","):
            lo, sep, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if sep else int(lo)
            if first < 0 or last < first:
                raise ValueError
            cores.update(range(first, last + 1))
    except ValueError:
        raise ValueError(f"cpu_cores={spec!r}: must be core ids and ranges such as 1 or 0-3,8") from None
    return sorted(cores)


def format_cores(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the inverse of parse_cores)."""
    runs: list[list[int]] = []
    for c in sorted(cores):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def host_cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


def apply_threads(cpu_threads: int | None, cpu_cores: str | None) -> None:
    """torch's intra-op threads for this process: cpu_threads, else one per core of cpu_cores, else unchanged."""
    threads = cpu_threads if cpu_threads is not None else len(parse_cores(cpu_cores)) if cpu_cores else None
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)


def usable_cores(cpu_cores: str | None) -> list[int] | None:
    """cpu_cores as a list, checked against the cores this process may use (a ValueError names the missing ones);
    None when not given."""
    if not cpu_cores:
        return None
    cores, allowed = parse_cores(cpu_cores), host_cores()
    if missing := [c for c in cores if c not in allowed]:
        raise ValueError(f"cpu_cores={cpu_cores!r}: core(s) {format_cores(missing)} are not among this process's "
                         f"cores ({format_cores(allowed)})")
    return cores


def pin_this_thread(cores: list[int]) -> None:
    """Pins the calling thread, and the threads it starts from now on, to `cores`."""
    os.sched_setaffinity(0, cores)  # Linux: pid 0 is the calling thread, not the process


def split_cores(cores: list[int], engines: int, reserve: int = 0) -> list[tuple[int, str]]:
    """(threads, cores) for each of `engines` compute engines sharing `cores`, after `reserve` cores are left
    to the processes that compute nothing (routers, HTTP servers): contiguous equal shares, the first engines
    taking one more core each when the count does not divide; with more engines than cores, one core each in turn
    (they share them) and one thread."""
    assert engines >= 1 and cores
    usable = cores[reserve:] if len(cores) - reserve >= engines else cores
    if engines > len(usable):
        return [(1, str(usable[k % len(usable)])) for k in range(engines)]
    share, extra = divmod(len(usable), engines)
    out, at = [], 0
    for k in range(engines):
        n = share + (k < extra)
        out.append((n, format_cores(usable[at:at + n])))
        at += n
    return out
