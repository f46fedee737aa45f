"""What a kernel's arrays hold: fp32 values, or 16-bit floats as bit patterns.

A kernel reads and writes each array in its wire's dtype (:data:`.planner.IO_DTYPES`): ``f32``
as float32, ``f16`` and ``bf16`` as ``int16`` bit patterns (torch's bfloat16 has no
``__cuda_array_interface__`` type and numpy has no bfloat16, so both travel as bits and are
reinterpreted, never converted, on the way in).  What callers pass and get back:

=========  ====================================  ==========================================
dtype      inputs (converted if they differ)     outputs (allocated like the inputs)
=========  ====================================  ==========================================
``f32``    float32                               float32
``f16``    float16 (torch or numpy)              float16 (torch or numpy)
``bf16``   torch.bfloat16; numpy floats are      torch.bfloat16; numpy: float32 holding
           rounded to bf16 (nearest even)        the bf16 values
=========  ====================================  ==========================================

>>> import numpy as np
>>> bits = bf16_bits(np.array([1.0, 1.00390625, -2.5, np.inf], np.float32))
>>> bf16_values(bits).tolist()
[1.0, 1.0, -2.5, inf]
>>> host_input(np.array([0.1, 2.0]), "f16").dtype, storage("bf16")
(dtype('int16'), <class 'numpy.int16'>)
"""

from __future__ import annotations

import numpy as np

from ..core.errors import ShapeError
from ..ops.arrays import bf16_bits, bf16_values  # noqa: F401 (bf16_values: re-exported)


def storage(io: str) -> type:
    """The numpy type of the kernel argument for an array of dtype ``io``."""
    return np.float32 if io == "f32" else np.int16


def host_input(x, io: str) -> np.ndarray:
    """A numpy input as the flat, contiguous kernel argument of dtype ``io``."""
    x = np.asarray(x)
    if io == "f32":
        return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if io == "f16":
        return np.ascontiguousarray(x, dtype=np.float16).reshape(-1).view(np.int16)
    return bf16_bits(x).reshape(-1)


def torch_dtype(io: str, torch):
    return {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[io]


ALIGN = 16
"""Bytes a kernel argument's first element is aligned to: ``cp.async`` copies 16 bytes from
a 16-byte aligned address (a view that starts elsewhere is copied first)."""


def torch_input(x, io: str, torch):
    """A torch input (detached) as a flat contiguous tensor the kernel reads: float32, or the
    16-bit tensor viewed as int16; copied when its data does not start on an :data:`ALIGN`
    boundary (a view such as ``t[1:]``)."""
    x = x.detach()
    want = torch_dtype(io, torch)
    if x.dtype != want:
        x = x.to(want)
    x = x.contiguous().reshape(-1)
    if x.data_ptr() % ALIGN:
        x = x.clone()
    return x if io == "f32" else x.view(torch.int16)


def numpy_output(shape, io: str) -> np.ndarray:
    """A numpy output the caller gets (bf16: its bits, converted by :func:`finish`)."""
    return np.empty(shape, np.float32 if io == "f32" else np.float16 if io == "f16" else np.int16)


def kernel_view(o, io: str):
    """The view of output ``o`` (numpy, torch, CUDA array) the kernel writes: bits for 16-bit."""
    if io == "f32" or str(o.dtype) in ("int16", "torch.int16"):
        return o
    import sys
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(o, torch.Tensor):
        return o.view(torch.int16)
    return o.view(np.int16)


def finish(o, io: str):
    """What the caller gets for an output the kernel wrote: numpy bf16 bits become float32."""
    if io == "bf16" and isinstance(o, np.ndarray) and o.dtype == np.int16:
        return bf16_values(o)
    return o


def check_out(what: str, o, shape, io: str, kind: str) -> None:
    """``out=`` must have the output's shape and the dtype the kernel writes."""
    want = {"f32": ("float32",), "f16": ("float16",), "bf16": ("bfloat16",)}[io]
    if kind == "numpy" and io == "bf16":
        raise ShapeError(f"{what}: numpy has no bfloat16; pass a torch.bfloat16 tensor or leave out= out")
    if tuple(o.shape) != tuple(shape) or str(o.dtype).replace("torch.", "") not in want:
        raise ShapeError(f"{what}: expected {want[0]} of shape {tuple(shape)}, got "
                         f"{o.dtype} of shape {tuple(o.shape)}")
    address = _device_address(o, kind)
    if io != "f32" and address is not None and address % OUT_ALIGN:
        raise ShapeError(f"{what}: a {io} output must start on a {OUT_ALIGN}-byte boundary (the kernel stores "
                         f"column pairs as one 32-bit word); this one starts at byte {address % OUT_ALIGN} "
                         f"of a word (a view such as t[1:]): pass a tensor of its own")


OUT_ALIGN = 4
"""Bytes a 16-bit output on a GPU starts on: tensor-core fragments store a column pair as one word
(:func:`.paired_stores.global_pair`)."""


def _device_address(o, kind: str) -> int | None:
    """The address of ``o``'s first element in device memory, where the kernel writes it in place."""
    if kind == "torch_cuda":
        return o.data_ptr()
    if kind in ("device", "cai"):
        ptr = getattr(getattr(o, "device_ctypes_pointer", None), "value", None)
        if ptr is None and hasattr(o, "__cuda_array_interface__"):
            ptr = o.__cuda_array_interface__["data"][0]
        return ptr
    return None
