"""Argument checks shared by the Triton launchers (each error names the argument, the value and the limit), and the
device facts their launch choices read."""
from __future__ import annotations

import functools
import os

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device, default: int) -> int:
    """The streaming multiprocessors of a CUDA device (read once per device); `default` elsewhere (the interpreter:
    the count the caller's launch choices should assume there)."""
    if device.type != "cuda":
        return default
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    shape: tuple[int | None, ...] | None = None,
    last_dim_contiguous: bool = True,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda" and not interpreting():
        raise ValueError(f"{name}: on {t.device}; the Triton kernel needs a CUDA tensor (or TRITON_INTERPRET=1)")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: has {t.dim()} dims (shape {tuple(t.shape)}), expected {ndim}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype}, expected one of {[str(d) for d in dtypes]}")
    if shape is not None:
        if len(shape) != t.dim() or any(s is not None and s != ts for s, ts in zip(shape, t.shape)):
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {want}")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last-dim stride {t.stride(-1)}, the kernel needs 1 (make the last dim contiguous)")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors on different devices: {devices}")


def check_out(name: str, out: torch.Tensor, like_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """A caller-supplied output: same shape, dtype and device as the kernel would allocate, last dim contiguous."""
    check_tensor(name, out, dtypes=(dtype,), shape=tuple(like_shape))
    if out.device != device:
        raise ValueError(f"{name}: on {out.device}, expected {device}")


def check_block_k(block_k: int, group_size: int) -> None:
    """A W4A16 config's K step stays inside one quantization group (one scale and zero point per step)."""
    if group_size % block_k:
        raise ValueError(f"config: block_k={block_k} does not divide the group size {group_size}")
