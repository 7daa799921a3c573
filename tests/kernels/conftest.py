"""Kernel tests run on CUDA when there is one, else on the CPU under Triton's interpreter (small shapes).

TRITON_INTERPRET must be set before triton is imported (triton.jit reads it when the kernels are decorated), so it
is set here, at collection, before any test module imports `kernels`.
"""
from __future__ import annotations

import os
import sys

import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    already_compiled = os.environ.get("TRITON_INTERPRET") != "1" and "kernels" in sys.modules
    os.environ["TRITON_INTERPRET"] = "1"
    if already_compiled:
        # A test collected earlier (tests/engine, ...) imported `kernels` as compiled-kernel modules; re-run them
        # so their @triton.jit functions become interpreted ones. The package's dispatchers read the names from
        # the module dict that reload refills, so references held elsewhere stay valid (on the CPU they call the
        # references anyway).
        import importlib

        for name in ("kernels._checks", "kernels.activation", "kernels.kv_write", "kernels.norm",
                     "kernels.paged_attention", "kernels.rotary", "kernels.gemv", "kernels.quant_fp8", "kernels.w4a16",
                     "kernels.token_bitmask", "kernels"):
            if name in sys.modules:
                importlib.reload(sys.modules[name])

    import numpy as np
    import triton.runtime.interpreter as _interp

    # Triton 3.6's interpreter turns a scalar into int() of a 1-element array, which numpy >= 2.4 refuses
    # ("only 0-dimensional arrays can be converted"), so `range(lo, hi)` over runtime bounds fails. Re-patch
    # __index__ to read the one element.
    if not getattr(_interp, "_tandem_index_patch", False):
        _orig_patch_lang_tensor = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            _orig_patch_lang_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

        _interp._patch_lang_tensor = _patch_lang_tensor
        _interp._tandem_index_patch = True
