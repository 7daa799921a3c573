"""`tandem up` as a child process for the end-to-end tests: ports, readiness, its children's pids, stopping."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from ports import free_port_block

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 600  # a deadline, not a wait: a loaded 2-core machine has taken over 240 s to start a stack


class Stack:
    """`tandem up` as a child process; its output (and its children's) is kept in `lines`."""

    def __init__(self, *args: str, prefill: int = 1, decode: int = 2, scheme: str = "http",
                 env: dict[str, str] | None = None, colocated: bool = False):
        """colocated (or --colocated in args): `tandem up --colocated` (the router alone, one engine; prefill and
        decode are ignored)."""
        if "--colocated" in args:
            colocated, args = True, tuple(a for a in args if a != "--colocated")
        if colocated:
            prefill = decode = 0
        base = free_port_block(2 + 2 * max(1, prefill + decode))
        self.http = f"{scheme}://127.0.0.1:{base}"
        self.grpc = f"127.0.0.1:{base + 1}"
        self.worker_ports = {f"{role}-{i}": base + 2 + k for k, (role, i) in enumerate(
            [("prefill", i) for i in range(prefill)] + [("decode", i) for i in range(decode)])}
        self.expected = {} if colocated else {"prefill": prefill, "decode": decode}
        self.metrics_ports = [base + 2 + prefill + decode + k for k in range(max(1, prefill + decode))]
        self.argv = [sys.executable, "-m", "cli", "up", "--http-port", str(base), "--grpc-port",
                     str(base + 1), "--worker-port", str(base + 2), "--metrics-port", str(self.metrics_ports[0]),
                     *(["--colocated"] if colocated else ["--prefill", str(prefill), "--decode", str(decode)]),
                     *args]
        # (errors=: two processes' long lines can interleave mid-character; a reader that died of it would leave
        # every process blocked on a full pipe)
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="backslashreplace",
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.lines: list[str] = []
        self.ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if "tandem up: ready." in line:
                self.ready.set()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> "Stack":
        """Until `tandem up` says ready and the router has every worker in rotation. (The router is ready with one
        prefill and one decode instance healthy; a test that polls, kills or counts on a particular worker must not
        race the others' start.)"""
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.5):
            self._check_alive(deadline, "tandem up did not get ready")
        while self.expected and self.in_rotation() != self.expected:
            self._check_alive(deadline, f"the router's instances {self.in_rotation()} are not {self.expected}")
            time.sleep(0.2)
        return self

    def _check_alive(self, deadline: float, why: str) -> None:
        if self.proc.poll() is not None or time.monotonic() > deadline:
            self.stop()
            raise RuntimeError(f"{why}:\n" + "".join(self.lines[-60:]))

    def in_rotation(self) -> dict[str, int]:
        return in_rotation(self.http)

    def child_pids(self) -> dict[str, int]:
        return {m.group(1): int(m.group(2)) for line in self.lines
                if (m := re.search(r"tandem up: started (\S+) \(pid (\d+)\)", line))}

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60) -> int:
        """Stops `tandem up`; returns its exit status once `lines` holds all it wrote. (Its exit and the reader
        thread's last line race: its last words, "tandem up: stopped", are written just before it exits.)"""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        # (EOF once every writer closed the pipe: `tandem up` stops its children before it exits; one left behind
        # by a killed `tandem up` would keep the pipe open, hence the bound)
        self._reader.join(30)
        return code


def in_rotation(http: str) -> dict[str, int]:
    """The healthy instances by role that the router at `http` routes to (tandem:router_instances)."""
    # (the router's own /metrics: open with --api-key; a throwaway CA's certificate with TLS)
    text = httpx.get(f"{http}/metrics", timeout=10, verify=False).text
    return {m.group(1): int(float(m.group(2))) for m in re.finditer(
        r'^tandem:router_instances\{[^}]*instance_role="(\w+)"[^}]*state="healthy"[^}]*\} (\S+)$', text, re.M)
        if float(m.group(2)) > 0}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
