"""How a :class:`~napkin_cat.lowering.Kernel` is called: its arguments (each array's kind, the
checks, flat views converted to what the kernel reads), its outputs (allocated like the inputs;
an output the kernel adds into with padded rows, :mod:`.staged_add`, allocated padded and handed
back as the view without the padding), a launch prepared once (:class:`_Prepared`) and the fast
path of calls on torch CUDA tensors (:class:`_TorchFastPath`)."""
from __future__ import annotations

import sys

from ..core.errors import LoweringError, ShapeError
from . import io

def _kind(x) -> str:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch_cuda" if x.is_cuda else "torch_cpu"
    if getattr(x, "__cuda_ndarray__", False):
        return "device"
    if hasattr(x, "__cuda_array_interface__"):
        return "cai"
    return "numpy"


def _check_array(what: str, x, kind: str) -> None:
    """``x`` is an array the kernel can read or write: a numpy array, a torch tensor or a CUDA
    array, of a real (float or integer) dtype."""
    import numpy as np
    if kind == "numpy" and not isinstance(x, np.ndarray):
        raise ShapeError(f"{what}: expected a numpy array, a torch tensor or a CUDA device array, got "
                         f"{type(x).__name__}" + (" (convert it with np.asarray)" if isinstance(x, (list, tuple)) else ""))
    if kind in ("torch_cpu", "torch_cuda"):
        if x.is_complex() or str(x.dtype) == "torch.bool":
            raise ShapeError(f"{what}: expected a real tensor, got dtype {x.dtype}")
        return
    try:
        dk = np.dtype(str(x.dtype)).kind
    except TypeError:
        dk = "?"
    if dk not in "fiu":
        raise ShapeError(f"{what}: expected a real (float or integer) array, got dtype {x.dtype}")


def _flat_input(x, kind, sim, stream, keep, t="f32"):
    """``x`` as a flat kernel argument of dtype ``t`` (:mod:`.io`: float32, or 16-bit patterns
    as int16); a converted copy of a torch tensor is appended to ``keep`` (the numba view of a
    CUDA tensor does not keep it alive, and a copy freed before the launch could be handed to
    the outputs by torch's allocator)."""
    from .runtime import as_device_array, import_cuda
    if kind in ("torch_cuda", "torch_cpu"):
        import torch
        x = io.torch_input(x, t, torch)   # detached: the caller's tensor and graph are left alone
        keep.append(x)
        if kind != "torch_cpu":
            return as_device_array(x)
        x = x.numpy()   # already the kernel's argument (float32, or 16-bit patterns as int16)
        return x if sim else import_cuda().to_device(x)
    if kind == "device":
        want = "float32" if t == "f32" else "int16"
        if t == "f16" and str(x.dtype) == "float16":
            x = x.view("int16")
        if str(x.dtype) != want or not x.is_c_contiguous():
            raise LoweringError(f"numba device arrays for a {t} input must be C-contiguous {want}"
                                f"{' (16-bit patterns)' if t != 'f32' else ''}, got {x.dtype}")
        return _aligned(x.reshape(x.size))
    if kind == "cai":
        return _aligned(as_device_array(x).reshape(-1))
    x = io.host_input(x, t)
    if sim:
        return x
    return import_cuda().to_device(x)   # an input: no copy back


def _aligned(x):
    """A flat device array whose data starts on an ``io.ALIGN`` boundary: ``x``, or a device
    copy of it (``cp.async`` reads 16 aligned bytes; a view such as ``arr[1:]`` starts between)."""
    ptr = getattr(getattr(x, "device_ctypes_pointer", None), "value", None)
    if not ptr or ptr % io.ALIGN == 0:
        return x
    from .runtime import import_cuda
    out = import_cuda().device_array(x.shape, dtype=x.dtype)
    out.copy_to_device(x)
    return out


def _flat_output(o, kind, sim):
    from .runtime import as_device_array
    if kind == "torch_cuda":
        return as_device_array(o.reshape(-1))
    if kind == "torch_cpu":
        return as_device_array(o.numpy().reshape(-1))
    if kind == "device":
        return o.reshape(o.size)
    if kind == "cai":
        return as_device_array(o).reshape(-1)
    import numpy as np
    if not (isinstance(o, np.ndarray) and o.flags.c_contiguous):
        raise LoweringError("out= numpy arrays must be C-contiguous float32")
    return as_device_array(o.reshape(-1))


def _empty_like(like, shape, sim, t="f32"):
    """An output of dtype ``t`` for an input of the same type: a torch tensor on ``like``'s
    device, a device array for a device array (the simulator's own under the simulator), numpy
    otherwise (:func:`.io.numpy_output`)."""
    if like is None:
        return io.numpy_output(shape, t)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(like, torch.Tensor):
        return torch.empty(shape, dtype=io.torch_dtype(t, torch), device=like.device)
    if sim and not getattr(like, "__cuda_ndarray__", False):
        return io.numpy_output(shape, t)   # another CUDA array: the simulator has none
    from .runtime import import_cuda
    return import_cuda().device_array(shape, io.storage(t))


def padded_shape(shape, pad: int) -> tuple:
    """The shape of the array a kernel writes for an output of ``shape`` whose rows are ``pad``
    longer (:func:`.staged_add.row_pad`)."""
    return (*shape[:-1], shape[-1] + pad) if pad else tuple(shape)


def unpadded(store, width: int):
    """The view of ``store`` (numpy, torch, CUDA array) without its rows' padding."""
    return store[(slice(None),) * (len(store.shape) - 1) + (slice(0, width),)]


def padded_store(what: str, o, kind: str, pad: int, sim, t: str):
    """The padded array the kernel writes for ``out=`` array ``o`` (copied into ``o`` after the
    launch): of ``o``'s kind, on its device.  A CUDA array other than a torch tensor is refused:
    the copy into it would need a kernel of its own."""
    shape = padded_shape(tuple(o.shape), pad)
    if kind in ("torch_cpu", "torch_cuda"):
        import torch
        return torch.empty(shape, dtype=io.torch_dtype(t, torch), device=o.device)
    if kind == "numpy":
        return io.numpy_output(shape, t)
    raise ShapeError(f"{what}: this kernel adds into rows padded by {pad} words (lowering/staged_add.py) and "
                     f"copies them into out= after the launch, which it can for numpy arrays and torch tensors, "
                     f"not {type(o).__name__}; leave out= out")


def copy_into(o, view) -> None:
    """``o[...] = view``: a padded output's values into the caller's ``out=`` array."""
    if hasattr(o, "copy_"):
        o.copy_(view)
    else:
        o[...] = view


class _Prepared:
    """What :meth:`Kernel.prepare` returns: a launch on arguments converted once.  With
    ``packable`` (a GPU, the default stream, nothing to copy back) the calls after the first,
    which numba makes, go through a :class:`~.runtime.PackedLaunch` on the same addresses."""

    __slots__ = ("launcher", "args", "keep", "packed", "pointers", "after")

    def __init__(self, launcher, args, keep, packable, after=()):
        self.launcher, self.args, self.keep = launcher, args, keep   # keep: converted inputs, alive
        self.packed = None if packable else False
        self.pointers = [int(a.__cuda_array_interface__["data"][0]) for a in args] if packable else None
        self.after = tuple(after)   # (out=, padded view): copied after each launch

    def __call__(self) -> None:
        packed = self.packed
        if not (packed and packed(self.pointers)):
            self.launcher(*self.args)
            if packed is None:
                self.packed = self.launcher.pack(tuple(self.args)) or False
        for o, view in self.after:
            copy_into(o, view)


class _TorchFastPath:
    """A :class:`Kernel` called again on torch CUDA tensors (GPU only): the checks of the
    general path, done with a few attribute reads, and a :class:`~.runtime.PackedLaunch`.

    Each input must be a ``torch.Tensor`` (not a subclass) of the kernel's shape, contiguous, on
    the device of the first call, of its dtype (:mod:`.io`) or of another kernel dtype or int32 / int64
    (ids: converted, as the general path does; float64 is left to it); ``out=`` of its dtype and not requiring grad.  The
    tensors' addresses are read at every call: nothing about them is cached, nothing to
    invalidate; the overload, launch configuration, parameter layout and stream query depend
    only on the kernel and the device.  Anything else returns None and the call takes the
    general path, which converts what it can and raises the usual errors for what it cannot.

    It belongs to one dispatcher: a copy of the kernel given other source (and a fresh
    dispatcher, as the planted-bug tests make) never launches the original's code through
    it.  ``packed`` is None where packing does not apply; the general path then serves every
    call."""

    __slots__ = ("dispatcher", "packed", "in_shapes", "out_shapes", "device", "device_index", "tensor",
                 "in_dtypes", "out_dtypes", "empty", "zeros", "zeroed", "raw_stream", "convertible", "pads", "maps")

    def __init__(self, packed, in_shapes, out_shapes, device, torch, dispatcher=None,
                 in_io=None, out_io=None, zero_args=(), out_pads=()):
        self.dispatcher = dispatcher
        self.packed = packed
        self.maps = None   # input addresses -> their tensor maps' addresses (.tma)
        # outputs the blocks add into (fp32 atomics): zero-filled by torch on its stream before
        # the packed launch, as the Launcher does on the general path
        self.zeroed = frozenset(i - len(in_shapes) for i in zero_args)
        self.zeros = torch.zeros
        self.in_shapes = tuple(torch.Size(s) for s in in_shapes)
        self.out_shapes = tuple(torch.Size(s) for s in out_shapes)
        # outputs whose rows the kernel pads (.staged_add): allocated padded, handed back as views
        self.pads = {i: (torch.Size(padded_shape(s, p)), s[-1])
                     for i, (s, p) in enumerate(zip(out_shapes, out_pads or ())) if p}
        self.in_dtypes = tuple(io.torch_dtype(t, torch) for t in (in_io or ("f32",) * len(in_shapes)))
        self.out_dtypes = tuple(io.torch_dtype(t, torch) for t in (out_io or ("f32",) * len(out_shapes)))
        self.device = device
        self.device_index = device.index if device.index is not None else -1
        self.tensor = torch.Tensor
        self.empty = torch.empty
        self.convertible = {getattr(torch, n) for n in ("float32", "float16", "bfloat16", "int64", "int32")}
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)   # what triton launches on
        self.raw_stream = raw if raw is not None else (lambda i: torch.cuda.current_stream(i).cuda_stream)

    @classmethod
    def build(cls, kernel, launcher, args, arrays):
        """After a general call on torch CUDA tensors: the fast path for the next ones."""
        import torch
        packed = launcher.pack(tuple(args), zeroed=True)
        if packed is not None and packed.n_arrays != len(args):
            packed = None
        fast = cls(packed, kernel.in_shapes, kernel.out_shapes, arrays[0].device, torch,
                   kernel._dispatcher, kernel.in_io, kernel.out_io, kernel.zero_args, kernel.out_pads)
        if kernel.tma:   # the tensor maps of the inputs TMA copies, by their addresses (.tma)
            from .tma import map_pointers
            fast.maps = lambda pointers: map_pointers(kernel, pointers)
        return fast

    def _fits(self, t, shape, dtype) -> bool:
        return (type(t) is self.tensor and t.dtype is dtype and t.get_device() == self.device_index
                and t.shape == shape and t.is_contiguous())

    def __call__(self, arrays, out):
        if len(arrays) != len(self.in_shapes):
            return None
        pointers, keep = [], []
        for t, shape, dtype in zip(arrays, self.in_shapes, self.in_dtypes):
            if not self._fits(t, shape, dtype):   # another real dtype (integer ids): converted, as the general path does
                if not (t.dtype in self.convertible and self._fits(t, shape, t.dtype)):
                    return None
                t = t.to(dtype)
                keep.append(t)   # freed in stream order, after the launch on torch's stream
            ptr = t.data_ptr()
            if ptr % io.ALIGN:      # the general path copies a view that starts off the boundary
                return None
            pointers.append(ptr)
        pads = self.pads
        if out is None:
            outs = [(self.zeros if i in self.zeroed else self.empty)(pads[i][0] if i in pads else shape,
                                                                     dtype=dtype, device=self.device)
                    for i, (shape, dtype) in enumerate(zip(self.out_shapes, self.out_dtypes))]
        else:
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            if len(outs) != len(self.out_shapes) or pads:   # out= of padded rows: the general path copies
                return None
            for o, shape, dtype in zip(outs, self.out_shapes, self.out_dtypes):
                if not self._fits(o, shape, dtype) or o.requires_grad or o.data_ptr() % io.OUT_ALIGN:
                    return None   # the general path refuses a 16-bit out= off a word (io.check_out)
            for i in self.zeroed:
                outs[i].zero_()
        pointers += [o.data_ptr() for o in outs]
        if self.maps is not None:
            pointers += self.maps(pointers)
        if not self.packed(pointers, self.raw_stream(self.device_index)):
            return None
        for i, (_, width) in pads.items():
            outs[i] = outs[i][..., :width]
        return outs[0] if len(outs) == 1 else tuple(outs)
