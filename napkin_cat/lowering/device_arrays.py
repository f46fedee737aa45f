"""Arrays as kernel arguments: numpy, torch (CPU or CUDA) and numba arrays, without a copy
whenever the data is already on the GPU; copies back to the host after a launch.

:func:`as_device_array` is the entry point, :func:`copy_back` writes its copies back,
:func:`stream_from_torch` orders a launch after torch's work on a side stream.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any

from ..core.errors import LoweringError
from .devices import import_cuda, simulator_active

HOST_ATTR = "_napkin_host"  # set on device copies made by as_device_array(numpy)


def _is_torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")  # never import torch just to ask
    return torch is not None and isinstance(x, torch.Tensor)


_TORCH_WRAPPERS: OrderedDict[tuple, Any] = OrderedDict()
_TORCH_WRAPPERS_MAX = 256


def clear_array_cache() -> None:
    """Forget the cached numba views of torch CUDA tensors (see :func:`as_device_array`)."""
    _TORCH_WRAPPERS.clear()


def _torch_cuda_view(cuda, t):
    # Converting a torch CUDA tensor at every call (interface dict, a new DeviceNDArray, a
    # stream sync) was reported at about 140 us and measured at 15-24 us per tensor per
    # launch on an H200; a kernel called in a loop pays it for every tensor every time.  The
    # view depends only on (address, shape, strides, dtype, device), so it is cached under
    # that key.  It is built with owner=None: the cache must not keep tensors alive, and a
    # key that matches means a live tensor with exactly this layout sits at this address,
    # which is all the view describes.  sync=False: numba launches on the legacy default
    # stream, which is torch's default stream too, so stream order already puts the kernel
    # after torch's pending work; with a side stream, pass stream_from_torch() to the
    # Launcher.
    key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.get_device())
    view = _TORCH_WRAPPERS.get(key)
    if view is None:
        try:
            interface = t.detach().__cuda_array_interface__
        except (TypeError, AttributeError, RuntimeError) as e:
            raise LoweringError(f"torch tensor of dtype {t.dtype} cannot be passed to a numba "
                                f"kernel: {e}") from None
        view = cuda.from_cuda_array_interface(interface, owner=None, sync=False)
        _TORCH_WRAPPERS[key] = view
        if len(_TORCH_WRAPPERS) > _TORCH_WRAPPERS_MAX:
            _TORCH_WRAPPERS.popitem(last=False)
    return view


def _torch_cpu_numpy(t):
    try:
        return t.detach().numpy()  # shares memory with the tensor: results land in it
    except (TypeError, RuntimeError) as e:
        raise LoweringError(f"CPU torch tensor of dtype {t.dtype} has no numpy view: {e}") from None


def as_device_array(x: Any, *, stream: Any = 0) -> Any:
    """Turn an array into a kernel argument, without copying whenever the data is on the GPU.

    ======================================  ===================================================
    input                                   result (real GPU)
    ======================================  ===================================================
    numba device array                      itself
    torch CUDA tensor                       zero-copy numba view, cached (see below)
    other ``__cuda_array_interface__``      ``cuda.as_cuda_array(x)`` (zero-copy, not cached)
    numpy array                             a device copy marked for :func:`copy_back`
    CPU torch tensor                        as its numpy view (so results land in the tensor)
    ======================================  ===================================================

    Under the simulator numpy arrays (and numpy views of CPU torch tensors) are returned as
    they are: the simulator copies them in and out around the launch itself.

    The numba view of a torch CUDA tensor is cached on ``(data_ptr, shape, strides, dtype,
    device)`` because converting through ``__cuda_array_interface__`` at every call costs
    (reported) about 140 us, (measured on an H200) 15-24 us per tensor per launch; a cache
    hit costs about 1.7 us.  The view does not keep the tensor alive: keep the tensor
    referenced while a kernel uses it.  It is ordered after torch's work by stream order
    only (torch's default stream is numba's stream 0); torch dtypes without a
    ``__cuda_array_interface__`` (bfloat16) are refused with a LoweringError.
    """
    if getattr(x, "__cuda_ndarray__", False):  # numba (or simulator) device array
        return x
    sim = simulator_active()
    if _is_torch_tensor(x):
        if x.is_cuda:
            if sim:
                raise LoweringError("the CUDA simulator cannot run on torch CUDA tensors; "
                                    "pass CPU tensors or numpy arrays")
            return _torch_cuda_view(import_cuda(), x)
        x = _torch_cpu_numpy(x)
    import numpy as np

    if isinstance(x, np.ndarray):
        if sim:
            return x
        cuda = import_cuda()
        host = x
        dev = cuda.to_device(np.ascontiguousarray(x) if not _contiguous(x) else x, stream=stream)
        setattr(dev, HOST_ATTR, host)
        return dev
    if hasattr(x, "__cuda_array_interface__") and not sim:
        return import_cuda().as_cuda_array(x)
    raise LoweringError(f"as_device_array expects a numpy array, a torch tensor or a CUDA "
                        f"array, got {type(x).__name__}")


def _contiguous(a) -> bool:
    return a.flags.c_contiguous or a.flags.f_contiguous


def copy_back(*arrays: Any, stream: Any = 0) -> None:
    """Copy device copies made by :func:`as_device_array` back into their host arrays.

    Arguments that are not such copies are skipped, so the argument list of a launch can be
    passed as it is.  With the default ``stream=0`` the copy is complete on return; with
    another stream it is queued on it.  A no-op under the simulator (it copies back itself).
    """
    for a in arrays:
        host = getattr(a, HOST_ATTR, None)
        if host is None:
            continue
        if _contiguous(host):
            a.copy_to_host(host, stream=stream)
        else:
            host[...] = a.copy_to_host(stream=stream)


def stream_from_torch(torch_stream: Any = None) -> Any:
    """A numba stream for a torch stream (default: torch's current one), for
    :class:`~napkin_cat.lowering.runtime.Launcher`.

    torch's default stream is the legacy default stream, which is numba's stream 0, so that
    case returns ``0``; under the simulator streams mean nothing and ``0`` is returned too.
    """
    if simulator_active():
        return 0
    import torch

    s = torch_stream if torch_stream is not None else torch.cuda.current_stream()
    ptr = int(s.cuda_stream)
    if ptr == 0:
        return 0
    return import_cuda().external_stream(ptr)
