"""Outputs summed across blocks (``tile(axis, size, partial="sum")``) in a numba.cuda kernel.

The blocks of a split axis each compute a partial sum of such an output and add it with
``cuda.atomic.add`` (fp32 atomics; the simulator runs them too).  The kernel initialises
nothing itself: the launcher (:class:`~napkin_cat.lowering.runtime.Launcher`, given the
argument positions by the :class:`~napkin_cat.lowering.Kernel`) fills those outputs with
zeros before every launch.  fp32 outputs only: a 16-bit output summed across blocks is
refused with a :class:`~napkin_cat.core.errors.LoweringError` naming it and its dtype.

>>> import napkin_cat as nc
>>> a, b, c = nc.axes("a b c")
>>> split = nc.library.matmul(a=a, b=b, c=c).tile(b, 4, partial="sum").tile(a, 4)
>>> k = nc.lower(split.bind({a: 8, b: 12, c: 4}), threads=16)
>>> k.launch.grid, k.zero_args                 # 3 blocks of b x 2 of a; argument 2 (C) starts at 0
((6, 1, 1), (2,))
>>> "cuda.atomic.add(C, " in k.source
True
"""

from __future__ import annotations

import sys

from ..core.errors import LoweringError
from ..relabel.loopnest import final_form
from ..relabel.split import added_outputs, split_axes


def check_added_outputs(ff) -> dict[int, tuple[str, ...]]:
    """``{output variable: summed axes}`` of ``ff``'s outputs added across blocks; a non-fp32 one
    is refused (the atomics add fp32 values)."""
    added = added_outputs(ff)
    types = ff.diagram.var_types()
    for v, axes_ in added.items():
        arr = types[v]
        if arr.dtype.name != "f32":
            raise LoweringError(f"output {arr}: the blocks of {', '.join(axes_)} add their "
                                f"partial sums of {arr.name} with fp32 atomics, so an output summed across "
                                f"blocks must be f32; give {arr.name} dtype f32 (convert it after the kernel), "
                                f"or stream {', '.join(axes_)} instead of tiling it")
    return added


def atomic_add(out: str, index: str, value: str) -> str:
    """The statement that adds ``value`` into ``out[index]``."""
    return f"cuda.atomic.add({out}, {index}, {value})"


def atomic_add_pair(out: str, index: str, lo: str, hi: str) -> str:
    """The statement that adds ``lo`` into ``out[index]`` and ``hi`` into ``out[index + 1]``
    (``index`` even): one vector reduction on the GPU (``tensorcore.red_add2``)."""
    return f"red_add2({out}, {index}, {lo}, {hi})"


def zero_args(d) -> tuple[int, ...]:
    """Argument positions (inputs first, then outputs) of the kernel of the relabelled ``d`` that
    the launcher zero-fills."""
    if not split_axes(d):
        return ()
    ff = final_form(d)
    added = added_outputs(ff)
    return tuple(len(d.dom) + pos for pos, v in enumerate(ff.diagram.outs) if v in added)


def zero_fill(arg, stream=0) -> None:
    """Fill a kernel argument with zeros before a launch: a numpy array in place, a device array
    (numba's, or a view of a torch CUDA tensor) on the GPU, in ``stream``."""
    if hasattr(arg, "fill") and not getattr(arg, "__cuda_ndarray__", False):
        arg.fill(0)
        return
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(arg, torch.Tensor):
        arg.zero_()
        return
    setitem = getattr(arg, "setitem", None)
    if setitem is not None:   # numba DeviceNDArray: a fill kernel in the launch's stream
        setitem(slice(None), 0, stream=stream)
        return
    try:
        arg[:] = 0
    except TypeError as e:  # pragma: no cover - every argument the Kernel passes is one of the above
        raise LoweringError(f"cannot zero-fill a kernel argument of type {type(arg).__name__}: {e}") from None
