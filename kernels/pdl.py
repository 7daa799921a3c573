"""Programmatic dependent launch (PDL, sm_90+): a kernel launched with launch_pdl may start while the kernel before
it in the stream is still running.

The life of a dependent launch:
1. The kernel before it calls `launch_dependents()` (griddepcontrol.launch_dependents) early, or reaches its end:
   from then on the dependent's programs may be scheduled.
2. The dependent (launched with `launch_kwargs(True)`) loads what no earlier kernel writes (weights), then calls
   `wait()` (griddepcontrol.wait): it returns once every earlier kernel has finished and its writes are visible.
   Only then does it read activations or touch shared workspaces (split-K counters).
Both instructions are no-ops in a launch without PDL. Under the interpreter, with a Triton that lacks them, and
with TANDEM_PDL=0 in the environment, PDL_SUPPORTED is False and the kernels take the plain path (their PDL
constexpr False).
"""
from __future__ import annotations

import dataclasses
import os

import triton

from kernels._checks import interpreting

try:  # Triton >= 3.3 (the H200 machines have 3.6)
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents as _launch_dependents_op
    from triton.language.extra.cuda import gdc_wait as _wait_op
    PDL_SUPPORTED = (not interpreting() and os.environ.get("TANDEM_PDL", "1") != "0"
                     and "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)})
except ImportError:  # pragma: no cover (an older Triton)
    _launch_dependents_op = _wait_op = None
    PDL_SUPPORTED = False


def launch_kwargs(pdl: bool) -> dict:
    """The launch option that makes a launch a programmatic dependent (empty where PDL is not supported)."""
    return {"launch_pdl": True} if pdl and PDL_SUPPORTED else {}


@triton.jit
def wait():
    """Step 2: wait for the kernels before this one (their writes visible after it)."""
    _wait_op()


@triton.jit
def launch_dependents():
    """Step 1: let the next kernel, if launched as a dependent, start now."""
    _launch_dependents_op()
