"""C kernels for the CPU paths, compiled on first use by the host's gcc and loaded with ctypes.

`load_library("paged_decode_attention")` compiles kernels/csrc/paged_decode_attention.c once into
`$TANDEM_KERNEL_CACHE` (default ~/.cache/tandem/kernels) and returns the loaded library, or None when it cannot:
no gcc, a failed compile, or TANDEM_CPU_NATIVE=0. The callers then take their torch paths; the reason is logged
once. The library's file name carries a hash of everything its machine code depends on (the source, the flags,
the compiler, the CPU's model and flags), since -march=native code built on one CPU may not run on another: a
changed source or a cache directory shared with another machine builds its own file. Several processes (the
services of `tandem up`) may build at once: each compiles to a private temporary name and renames it into
place, which is atomic, so a reader sees no file or a whole one.

The libraries link libgomp by its soname; torch has already loaded its own copy under that name, so the C loops'
OpenMP threads are torch's pool, not a second one.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
CC = "gcc"
CFLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-fopenmp", "-std=gnu11")
LIBS = ("-lm",)


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_KERNEL_CACHE") or Path.home() / ".cache" / "tandem" / "kernels")


@functools.cache
def _toolchain() -> str:
    """The compiler's target and version, and the CPU's model and flags: what -march=native code depends on
    besides the source. Raises OSError without gcc."""
    target = subprocess.run([CC, "-dumpmachine"], capture_output=True, text=True, check=True).stdout.strip()
    version = subprocess.run([CC, "-dumpfullversion"], capture_output=True, text=True, check=True).stdout.strip()
    cpu: dict[str, str] = {}  # the first core's lines
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "flags"):
                    cpu.setdefault(key.strip(), value.strip())
    except OSError:  # no /proc/cpuinfo: the key has the compiler's part only
        pass
    return "\n".join([target, version, *(f"{k}: {v}" for k, v in sorted(cpu.items()))])


def library_path(name: str, source: bytes) -> Path:
    """Where the library built from `source` with this toolchain, these flags and this CPU lives."""
    key = hashlib.sha256(b"\0".join([source, " ".join(CFLAGS + LIBS).encode(), _toolchain().encode()]))
    return cache_dir() / f"{name}-{key.hexdigest()[:20]}.so"


def build(name: str) -> Path:
    """Compiles csrc/<name>.c unless its library is already in the cache; returns the library's path. Raises
    OSError (no gcc) or subprocess.CalledProcessError (the compile failed, its stderr attached)."""
    src = CSRC / f"{name}.c"
    path = library_path(name, src.read_bytes())
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([CC, *CFLAGS, str(src), "-o", tmp, *LIBS], capture_output=True, text=True, check=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.cache
def load_library(name: str) -> ctypes.CDLL | None:
    """csrc/<name>.c's library, built if need be; None (logged once) where the torch path must be used."""
    if os.environ.get("TANDEM_CPU_NATIVE", "1") == "0":
        log.info("TANDEM_CPU_NATIVE=0: the CPU kernels take their torch paths (%s)", name)
        return None
    try:
        return ctypes.CDLL(str(build(name)))
    except subprocess.CalledProcessError as e:
        log.warning("compiling %s.c failed, the CPU kernels take their torch paths:\n%s", name, e.stderr)
    except OSError as e:  # no gcc, an unwritable cache directory, a library that does not load
        log.warning("no C kernel %s (%s): the CPU kernels take their torch paths", name, e)
    return None
