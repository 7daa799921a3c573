"""A real DNS server for the discovery tests: Debian's dnsmasq on 127.0.0.1 at a free port, answering the names under
`DOMAIN` from a hosts file only (NXDOMAIN for the others, nothing forwarded), reloaded on `set`."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest

DNSMASQ = shutil.which("dnsmasq") or ("/usr/sbin/dnsmasq" if os.path.exists("/usr/sbin/dnsmasq") else None)
DOMAIN = "tandem.test"
needs_dnsmasq = pytest.mark.skipif(DNSMASQ is None, reason="dnsmasq is not installed (apt-get install dnsmasq)")


def _free_udp_and_tcp_port() -> int:
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.bind(("127.0.0.1", 0))
            port = u.getsockname()[1]
            with socket.socket() as t:
                try:
                    t.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError("no port free for both UDP and TCP")


def _answers(port: int, name: str) -> bool:
    """Whether the server on port answers an A query for name (any answer: it is up)."""
    query = struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0) + b"".join(
        bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0" + struct.pack("!HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(0.5)
        try:
            s.sendto(query, ("127.0.0.1", port))
            return s.recv(4096)[:2] == b"\0\7"
        except OSError:
            return False


class Dnsmasq:
    """dnsmasq serving `records` (name -> IP addresses); `address` is its ip:port (`--dns-server`)."""

    def __init__(self, workdir: Path, records: dict[str, list[str]]):
        self.hosts = workdir / "dns-hosts"
        self.set(records, reload=False)
        for _ in range(5):  # a port taken between the probe and dnsmasq's bind: another one
            self.port = _free_udp_and_tcp_port()
            cmd = [DNSMASQ, "--keep-in-foreground", "--conf-file", "--no-resolv", "--no-hosts",
                   f"--addn-hosts={self.hosts}", f"--local=/{DOMAIN}/", f"--port={self.port}",
                   "--listen-address=127.0.0.1", "--bind-interfaces", "--pid-file", "--log-facility=-",
                   *(["--user=root"] if os.geteuid() == 0 else [])]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 30
            while self.proc.poll() is None and time.monotonic() < deadline:
                if _answers(self.port, f"probe.{DOMAIN}"):
                    self.address = f"127.0.0.1:{self.port}"
                    return
            err = self.stop()
            if "in use" not in err:
                raise RuntimeError(f"dnsmasq did not start: {err}")
        raise RuntimeError("dnsmasq found no free port")

    def set(self, records: dict[str, list[str]], reload: bool = True) -> None:
        """Serves `records` from now on (the hosts file rewritten, dnsmasq told to read it again: SIGHUP)."""
        tmp = self.hosts.with_suffix(".tmp")
        tmp.write_text("".join(f"{ip} {name}\n" for name, ips in records.items() for ip in ips))
        tmp.replace(self.hosts)
        if reload:
            self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> str:
        """Stops it; its stderr."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err or ""
