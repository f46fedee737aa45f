"""The low-level runtime that generated numba.cuda kernels run on.

The code generator emits Python source text; this module turns that text into a launchable
kernel and moves arrays in and out, on a real GPU and under numba's CUDA simulator alike:

:func:`compile_kernel`     exec generated source, return the ``cuda.jit`` dispatcher
:class:`Launcher`          a launch configuration fixed once, called many times
:func:`as_device_array`    numpy / torch (CPU or CUDA) / numba arrays -> kernel arguments
:func:`copy_back`          write results of :func:`as_device_array` copies back to the host
:func:`set_max_dynamic_shared`  opt a kernel in to > 48 KB of dynamic shared memory
:func:`device_limits`      SM count, shared-memory limits, ... (H100 defaults without a GPU)
:func:`typecheck_kernel`   type-check and lower to LLVM IR without a GPU (the simulator does
                           no type checking)
:func:`simulator_active`, :func:`gpu_available`, :func:`import_cuda`,
:func:`ensure_numpy_compat`, :func:`stream_from_torch`

Nothing here imports ``numba.cuda`` at module import time: the simulator is chosen once per
process, when ``numba.cuda`` is first imported (``NUMBA_ENABLE_CUDASIM=1`` must be set before
that), so importing this module must not make the choice.  Import ``numba.cuda`` through
:func:`import_cuda`, and only when a kernel is needed.

Findings about numba-cuda 0.30.4 that this module relies on (read from its source, see the
paths under ``numba_cuda/numba/cuda/``):

* **numpy 2.5.** ``np/arrayobj.py`` runs ``overload(np.row_stack)`` when the CUDA target's
  NumPy support is first loaded, i.e. at the first kernel compilation, not at import.  NumPy
  2.5 removed ``row_stack``, so that line raises ``AttributeError: module 'numpy' has no
  attribute 'row_stack'``.  Reproduced here on numpy 2.4 by deleting ``numpy.row_stack``
  before a compile; :func:`ensure_numpy_compat` (``numpy.row_stack = numpy.vstack``) fixes it.
  NumPy 2.4 still has the alias (it warns when called), so the shim only acts on >= 2.5.
* **The compiled kernel's handle.** ``dispatcher.compile(sig)`` compiles (or finds) the
  overload for one signature and returns a ``dispatcher._Kernel``;
  ``kernel._codelibrary.get_cufunc()`` (``codegen.CUDACodeLibrary``) loads it into the
  current context and returns ``cudadrv.driver.CudaPythonFunction`` with ``.handle``,
  ``.kernel`` (a ``cuda.core`` ``Kernel``), ``.attrs`` (``regs, shared, local, const,
  maxthreads``) and ``.device``.  numba-cuda 0.30.4 loads modules with the CUDA *library*
  API (``cuda.core.ObjectCode`` -> ``cuLibraryLoadData``), so ``.handle`` is a
  ``cuda.bindings.driver.CUkernel``, not a ``CUfunction``: the attribute is set with
  ``cuKernelSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes, handle,
  device_id)``, the same call numba itself uses for the shared-memory carveout
  (``CudaPythonFunction.set_shared_memory_carveout``).  The launch (``_Kernel.launch`` ->
  ``cuda.core.launch(stream, LaunchConfig(grid, block, shmem_size), cufunc.kernel, ...)``)
  uses that same ``CUkernel``, so the setting applies.  The call goes through numba's
  error-checking driver wrapper ``numba.cuda.cudadrv.driver.driver``, which raises
  ``CudaAPIError`` on failure.  Older stacks whose handle is a ``CUfunction`` get
  ``cuFuncSetAttribute`` instead.  ``cuda.core``'s ``KernelAttributes`` is read-only and
  caches values, so the value is read back with ``cuKernelGetAttribute``.
* **Dynamic shared memory** is declared in a kernel as ``cuda.shared.array(0, dtype)``; its
  size in bytes is the 4th launch parameter ``kernel[grid, block, stream, nbytes]``.  Every
  such declaration returns the *same* memory (on the GPU and in the simulator), so a kernel
  needing several dynamic buffers declares one and slices disjoint views out of it.  Without
  the opt-in attribute a launch may use at most 48 KB (static + dynamic); with it, static +
  dynamic may reach the device's ``MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`` (H100: 227 KB).
* **Launch cost.** The host side of a numba launch was reported at about 56 us per call.
  Measured in this module's check on an H200 (numba-cuda 0.30.4, cuda-core 1.2.0, numpy
  2.5.2, launches not synchronised): about 12 us for a kernel without arguments plus about
  5 us per array argument, spent in ``_Kernel.launch`` marshalling each argument
  (``_prepare_args``) and in ``cuda.core.launch``.  ``dispatcher[grid, block, stream,
  nbytes]`` itself is cheap in 0.30.4 (0.25 us: ``configure`` is memoised with an
  ``lru_cache``), so :class:`Launcher`, which builds the configured object once, saves
  little on this version; calling an overload's ``_Kernel.launch`` directly saved about 1 us
  of 30.  What remains would only go by building the kernel parameters without numba.
* **Torch tensors.** Passing a torch CUDA tensor straight to a numba kernel converts it
  through ``__cuda_array_interface__`` at every call, twice (``typeof`` for dispatch, then
  ``as_cuda_array`` for the argument).  Reported at about 140 us per tensor; measured here
  at 15-24 us per tensor per launch (3 tensors: 79-106 us a launch, against 34-36 us with
  the cached views of :func:`as_device_array`; ``cuda.as_cuda_array`` alone 12-15 us, a
  cache hit 1.6-1.8 us).  :func:`as_device_array` caches the view keyed on ``(data_ptr, shape,
  strides, dtype, device)``.
* **Simulator** (``NUMBA_ENABLE_CUDASIM=1``, ``numba/cuda/simulator/``): it runs one block at
  a time, one Python thread per CUDA thread; it does no type checking (hence
  :func:`typecheck_kernel`); it has no ``as_cuda_array`` / ``is_cuda_array`` /
  ``from_cuda_array_interface``, no warp shuffles/votes, and cannot link PTX or C++.  Static
  shared arrays are identified by the (file name, line number) of their
  ``cuda.shared.array`` call, so two declarations on one line alias, and two generated
  sources registered under one file name could alias too: :func:`compile_kernel` gives each
  source its own file name.  Its kernel object's ``__getitem__`` stores the launch
  configuration *on the kernel* and returns the kernel itself, so a cached configured
  object is not safe there; :class:`Launcher` re-applies the configuration at every call
  under the simulator.  Dynamic shared memory is one ``np.zeros(nbytes, np.byte)`` buffer per
  launch; the 48 KB limit and the opt-in are not modelled (:class:`Launcher` still checks
  requests against the H100 opt-in limit so that oversize tiles fail on a CPU too).
  Give shared arrays numba dtypes (``from numba import float32``) or ``np.dtype`` objects:
  the simulator sizes a *dynamic* array with ``dtype.itemsize``, which fails for the class
  ``np.float32`` (``TypeError: unsupported operand type(s) for //: 'int' and
  'getset_descriptor'``) and for strings, though the GPU compiler accepts both.

Checked on a GPU (an H200; no H100 was free) with numba-cuda 0.30.4, numba 0.68.0, numpy
2.5.2, cuda-core 1.2.0, cuda-bindings 13.3.1, torch 2.11.0+cu130: the tests in
``tests/test_cuda_runtime.py`` pass there, compilation works through the numpy shim, a
launch with 200 KB of dynamic shared memory fails without the opt-in (``cuda.core``
``CUDAError: CUDA_ERROR_INVALID_VALUE``) and gives the right result with it, the handle is a
``CUkernel``, and the opt-in is capped at 232448 bytes (227 KB), as on the H100.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import linecache
import math
import operator
import os
import subprocess
import sys
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import LoweringError

__all__ = [
    "DEFAULT_SHARED_PER_BLOCK",
    "H100_DEFAULTS",
    "DeviceLimits",
    "Launcher",
    "as_device_array",
    "clear_array_cache",
    "compile_kernel",
    "copy_back",
    "device_limits",
    "ensure_numpy_compat",
    "gpu_available",
    "import_cuda",
    "kernel_function",
    "set_max_dynamic_shared",
    "signature_argtypes",
    "simulator_active",
    "stream_from_torch",
    "typecheck_kernel",
]

DEFAULT_SHARED_PER_BLOCK = 48 * 1024
"""Shared memory (static + dynamic) a block may use without the opt-in attribute."""

_HOST_ATTR = "_napkin_host"  # set on device copies made by as_device_array(numpy)


# --------------------------------------------------------------------------------------------
# Which numba.cuda this process has


def _env_flag(name: str) -> bool:
    # numba reads the variable with int(); a value it cannot parse counts as 0
    try:
        return int(os.environ.get(name, "0")) != 0
    except ValueError:
        return False


def simulator_active() -> bool:
    """Whether numba.cuda is (or, once imported, will be) the CUDA simulator.

    The choice is made once per process, when ``numba.cuda`` is first imported, from
    ``NUMBA_ENABLE_CUDASIM``.  So once it is imported, the imported module decides (the
    environment may have changed since); before that, the environment does.  This function
    never imports ``numba.cuda`` itself.

    >>> isinstance(simulator_active(), bool)
    True
    """
    mod = sys.modules.get("numba.cuda")
    jit = getattr(mod, "jit", None) if mod is not None else None
    if jit is not None:
        return getattr(jit, "__module__", "").startswith("numba.cuda.simulator")
    return _env_flag("NUMBA_ENABLE_CUDASIM")


def ensure_numpy_compat() -> None:
    """Make numba-cuda 0.30.4 compile with numpy >= 2.5 (idempotent).

    numba-cuda 0.30.4 registers an overload for ``np.row_stack`` when its NumPy support
    loads at the first compilation; numpy 2.5 removed that alias of ``np.vstack``, so the
    first compile dies with ``AttributeError``.  Restoring the alias is harmless: it is
    exactly what numpy < 2.5 had.  numpy 2.4 still has it, and then nothing is touched (not
    even read: reading is fine, but calling it warns).

    >>> ensure_numpy_compat(); ensure_numpy_compat()
    >>> import numpy; hasattr(numpy, "row_stack")
    True
    """
    import numpy

    if "row_stack" not in vars(numpy):
        numpy.row_stack = numpy.vstack


def import_cuda():
    """Return ``numba.cuda`` after applying :func:`ensure_numpy_compat`.

    Use this instead of ``from numba import cuda`` so the numpy shim is in place before any
    compilation, whichever code path compiles first.
    """
    ensure_numpy_compat()
    if "numba.cuda" not in sys.modules and "NUMBA_ENABLE_CUDASIM" not in os.environ and not driver_present():
        # no driver and no explicit choice: launching could only fail, so take the simulator
        # (``NUMBA_ENABLE_CUDASIM=0`` keeps the hardware path, e.g. to compile without a GPU)
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        config = sys.modules.get("numba.cuda.core.config")
        if config is not None:
            config.ENABLE_CUDASIM = 1
        warnings.warn("no CUDA driver found: numba.cuda runs in its CUDA simulator", stacklevel=2)
    from numba import cuda

    return cuda


def driver_present() -> bool:
    """Whether a CUDA driver and a device node exist, without importing ``numba.cuda`` (that
    import fixes the process's choice of simulator or hardware)."""
    import ctypes.util
    import glob

    return bool(ctypes.util.find_library("cuda")) and bool(glob.glob("/dev/nvidia[0-9]*"))


_GPU: bool | None = None  # known once numba.cuda is imported


def gpu_available() -> bool:
    """Whether kernels run on a real CUDA GPU: a device is visible and the simulator is off.

    This imports ``numba.cuda`` (through :func:`import_cuda`) unless the simulator is
    selected, which fixes the process's choice of simulator or hardware.
    """
    global _GPU
    if _GPU is not None:
        return _GPU
    if simulator_active():
        return False
    try:
        cuda = import_cuda()
        found = (not simulator_active()) and bool(cuda.is_available())
    except Exception:  # no driver, broken install: no GPU to run on either way
        found = False
    if "numba.cuda" in sys.modules:  # the choice is fixed now, and so is the answer
        _GPU = found
    return found


# --------------------------------------------------------------------------------------------
# Device limits


@dataclass(frozen=True, slots=True)
class DeviceLimits:
    """What the code generator needs to know about the GPU to pick tiles and launches.

    ``max_shared_per_block`` is the limit without opt-in (48 KB);
    ``max_shared_per_block_optin`` the limit for static + dynamic shared memory after
    :func:`set_max_dynamic_shared`.  ``from_device`` is False when the numbers are
    :data:`H100_DEFAULTS` rather than read from a GPU (simulator, or no GPU).
    """

    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    warp_size: int
    max_threads_per_block: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    max_shared_per_block: int
    max_shared_per_block_optin: int
    max_shared_per_sm: int
    reserved_shared_per_block: int
    max_registers_per_block: int
    max_registers_per_sm: int
    l2_bytes: int
    from_device: bool


H100_DEFAULTS = DeviceLimits(
    name="NVIDIA H100 80GB HBM3 (defaults, not read from a device)",
    compute_capability=(9, 0),
    sm_count=132,
    warp_size=32,
    max_threads_per_block=1024,
    max_threads_per_sm=2048,
    max_blocks_per_sm=32,
    max_shared_per_block=DEFAULT_SHARED_PER_BLOCK,
    max_shared_per_block_optin=227 * 1024,
    max_shared_per_sm=228 * 1024,
    reserved_shared_per_block=1024,
    max_registers_per_block=65536,
    max_registers_per_sm=65536,
    l2_bytes=50 * 1024 * 1024,
    from_device=False,
)
"""H100 SXM limits, used under the simulator so tiles chosen on a CPU fit the target GPU.

>>> H100_DEFAULTS.max_shared_per_block_optin // 1024, H100_DEFAULTS.sm_count
(227, 132)
"""

_LIMITS: dict[int, DeviceLimits] = {}


def device_limits() -> DeviceLimits:
    """Limits of the current GPU, cached per device; :data:`H100_DEFAULTS` without one.

    Without a GPU (simulator, or a CPU machine) the defaults describe the H100 the kernels
    are written for, so code that sizes tiles from them behaves the same on CI and on the GPU.
    """
    if not gpu_available():
        return H100_DEFAULTS
    cuda = import_cuda()
    dev = cuda.get_current_device()
    found = _LIMITS.get(dev.id)
    if found is not None:
        return found
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    limits = DeviceLimits(
        name=name,
        compute_capability=tuple(int(c) for c in dev.compute_capability)[:2],
        sm_count=int(dev.MULTIPROCESSOR_COUNT),
        warp_size=int(dev.WARP_SIZE),
        max_threads_per_block=int(dev.MAX_THREADS_PER_BLOCK),
        max_threads_per_sm=int(dev.MAX_THREADS_PER_MULTIPROCESSOR),
        max_blocks_per_sm=int(dev.MAX_BLOCKS_PER_MULTIPROCESSOR),
        max_shared_per_block=int(dev.MAX_SHARED_MEMORY_PER_BLOCK),
        max_shared_per_block_optin=int(dev.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        max_shared_per_sm=int(dev.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
        reserved_shared_per_block=int(dev.RESERVED_SHARED_MEMORY_PER_BLOCK),
        max_registers_per_block=int(dev.MAX_REGISTERS_PER_BLOCK),
        max_registers_per_sm=int(dev.MAX_REGISTERS_PER_MULTIPROCESSOR),
        l2_bytes=int(dev.L2_CACHE_SIZE),
        from_device=True,
    )
    _LIMITS[dev.id] = limits
    return limits


# --------------------------------------------------------------------------------------------
# Arrays


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
        setattr(dev, _HOST_ATTR, host)
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
        host = getattr(a, _HOST_ATTR, None)
        if host is None:
            continue
        if _contiguous(host):
            a.copy_to_host(host, stream=stream)
        else:
            host[...] = a.copy_to_host(stream=stream)


def stream_from_torch(torch_stream: Any = None) -> Any:
    """A numba stream for a torch stream (default: torch's current one), for :class:`Launcher`.

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


# --------------------------------------------------------------------------------------------
# Compiling generated source


_KERNELS: dict[tuple[str, str, int], Any] = {}
_SERIAL = itertools.count()


def _is_dispatcher(obj: Any) -> bool:
    # the real CUDADispatcher and the simulator's FakeCUDAKernel both have these
    return hasattr(obj, "py_func") and hasattr(obj, "__getitem__") and hasattr(obj, "overloads")


class _GPUMath:
    """:mod:`math` as a GPU evaluates it, for kernels run in the simulator: where Python's
    ``math`` raises (``exp`` overflow, ``log`` or ``sqrt`` outside their domain), the IEEE
    result (inf, -inf or NaN) that the GPU returns."""

    def __getattr__(self, name):
        return getattr(math, name)

    @staticmethod
    def exp(v):
        try:
            return math.exp(v)
        except OverflowError:
            return math.inf

    @staticmethod
    def log(v):
        return math.log(v) if v > 0 else (-math.inf if v == 0 else math.nan)

    @staticmethod
    def sqrt(v):
        return math.sqrt(v) if v >= 0 else math.nan


GPU_MATH = _GPUMath()


def compile_kernel(source: str, name: str, dynamic_smem_bytes: int = 0, *,
                   cache: bool = True) -> Any:
    """Exec generated kernel source and return its ``cuda.jit`` dispatcher called ``name``.

    ``source`` is a module's text: ``from numba import cuda``, ``import math`` and the
    ``@cuda.jit`` definitions (device functions too).  It runs in a fresh namespace under
    its own file name ``<napkin-kernel NAME DIGEST-N>``, and the text is put in
    :mod:`linecache` under that name, so tracebacks and numba's error messages show the
    generated lines; a distinct name per source also keeps the simulator's shared arrays
    (keyed by file and line) from aliasing across sources.

    ``dynamic_smem_bytes`` is the kernel's default dynamic shared memory, used by a
    :class:`Launcher` that is not given one; it is checked against the opt-in limit here.
    When it exceeds 48 KB and the source gave eager signatures (``@cuda.jit("void(...)")``),
    the opt-in is set on those overloads now; otherwise the Launcher does it at the first
    launch, for the argument types of that launch.

    With ``cache`` (default) the same ``(source, name, dynamic_smem_bytes)`` returns the same
    dispatcher, so code generated twice is compiled once.  The dispatcher carries
    ``napkin_source``, ``napkin_filename`` and ``napkin_dynamic_smem_bytes``.
    """
    digest = hashlib.sha256(source.encode()).hexdigest()
    key = (digest, name, int(dynamic_smem_bytes))
    if cache and key in _KERNELS:
        return _KERNELS[key]
    _check_dynamic_smem(dynamic_smem_bytes)
    import_cuda()
    filename = f"<napkin-kernel {name} {digest[:12]}-{next(_SERIAL)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        code = compile(source, filename, "exec")
    except SyntaxError as e:
        raise LoweringError(f"generated source for kernel {name!r} does not parse: line "
                            f"{e.lineno}: {(e.text or '').strip()!r}: {e.msg}") from e
    namespace: dict[str, Any] = {"__name__": f"napkin_cat.generated.{name}"}
    exec(code, namespace)
    if simulator_active() and namespace.get("math") is math:
        namespace["math"] = GPU_MATH   # read at call time: the kernel's math behaves as on a GPU
    disp = namespace.get(name)
    if disp is None or not _is_dispatcher(disp):
        found = sorted(k for k, v in namespace.items() if _is_dispatcher(v))
        raise LoweringError(f"generated source defines no cuda.jit kernel {name!r}; "
                            f"kernels found: {found}")
    disp.napkin_source = source
    disp.napkin_filename = filename
    disp.napkin_dynamic_smem_bytes = int(dynamic_smem_bytes)
    if dynamic_smem_bytes > DEFAULT_SHARED_PER_BLOCK and gpu_available():
        for argtypes in list(disp.overloads):
            set_max_dynamic_shared(disp, argtypes, dynamic_smem_bytes)
    if cache:
        _KERNELS[key] = disp
    return disp


def _check_dynamic_smem(nbytes: int) -> None:
    limit = device_limits().max_shared_per_block_optin
    if not 0 <= nbytes <= limit:
        raise LoweringError(f"dynamic shared memory of {nbytes} bytes is outside 0..{limit} "
                            f"(the opt-in limit per block of {device_limits().name})")


# --------------------------------------------------------------------------------------------
# Kernel handles and > 48 KB of dynamic shared memory


def kernel_function(dispatcher: Any, argtypes_or_signature: Any) -> Any:
    """numba's loaded kernel for one signature: ``CudaPythonFunction`` (real GPU only).

    It has ``.handle`` (a ``CUkernel`` in numba-cuda 0.30.4), ``.attrs`` (``regs, shared,
    local, const, maxthreads``), ``.kernel`` (the ``cuda.core`` ``Kernel``) and ``.device``.
    ``argtypes_or_signature`` is anything ``dispatcher.compile`` takes: a signature string
    such as ``"void(float32[:, ::1], int32)"``, a tuple of numba types, or a ``Signature``.
    Compiles the overload if it does not exist yet.
    """
    if not gpu_available():
        raise LoweringError("kernel_function needs a real GPU (simulator active or no device)")
    kernel = dispatcher.compile(argtypes_or_signature)
    library = getattr(kernel, "library", None) or kernel._codelibrary
    return library.get_cufunc()


def set_max_dynamic_shared(dispatcher: Any, argtypes_or_signature: Any, nbytes: int) -> int:
    """Let one overload of a kernel launch with up to ``nbytes`` of dynamic shared memory.

    CUDA refuses launches whose static + dynamic shared memory exceeds 48 KB unless the
    kernel's ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` was raised first, and numba
    has no public API for it (NVIDIA/numba-cuda#94).  This compiles (or finds) the overload,
    takes its ``CUkernel`` handle via :func:`kernel_function` and calls
    ``cuKernelSetAttribute`` for the current device (``cuFuncSetAttribute`` if the handle is
    a ``CUfunction``).  The attribute is per overload: launches whose argument types select
    another overload need their own call (:class:`Launcher` does this itself).

    Returns the attribute's value read back from the driver.  Under the simulator (or with
    no GPU) it only checks ``nbytes`` against the H100 opt-in limit and returns ``nbytes``.
    Raises :class:`~napkin_cat.core.errors.LoweringError` when static + dynamic shared memory
    would exceed the device's opt-in limit.
    """
    nbytes = int(nbytes)
    limits = device_limits()
    if not gpu_available():
        _check_dynamic_smem(nbytes)
        return nbytes
    cufunc = kernel_function(dispatcher, argtypes_or_signature)
    static = int(cufunc.attrs.shared)
    if nbytes < 0 or static + nbytes > limits.max_shared_per_block_optin:
        name = getattr(dispatcher, "__name__", cufunc.name)
        raise LoweringError(f"kernel {name!r} uses {static} bytes of static shared memory; "
                            f"with {nbytes} dynamic bytes it exceeds the opt-in limit of "
                            f"{limits.max_shared_per_block_optin} bytes on {limits.name}")
    from cuda.bindings import driver as binding
    from numba.cuda.cudadrv.driver import driver

    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    handle = cufunc.handle
    if isinstance(handle, binding.CUfunction):
        driver.cuFuncSetAttribute(handle, attr, nbytes)
        value = driver.cuFuncGetAttribute(attr, handle)
    else:
        dev_id = cufunc.device.id
        driver.cuKernelSetAttribute(attr, nbytes, handle, dev_id)
        value = driver.cuKernelGetAttribute(attr, handle, dev_id)
    done = getattr(dispatcher, "napkin_smem_optin", None)
    if done is None:
        done = {}
        dispatcher.napkin_smem_optin = done
    done[tuple(signature_argtypes(argtypes_or_signature))] = int(value)
    return int(value)


def signature_argtypes(argtypes_or_signature: Any) -> tuple:
    """The normalised argument types of a signature, as keys of ``dispatcher.overloads``."""
    try:
        from numba.cuda.core import sigutils
    except ImportError:  # older numba-cuda kept it in numba.core
        from numba.core import sigutils
    args, _ = sigutils.normalize_signature(argtypes_or_signature)
    return tuple(args)


# --------------------------------------------------------------------------------------------
# Launching


def _dim3(v: Any, what: str) -> tuple[int, int, int]:
    try:  # operator.index: numpy and sympy integers are fine, floats are not
        dims = tuple(operator.index(d) for d in (v if isinstance(v, (tuple, list)) else (v,)))
    except TypeError:
        dims = ()
    if not 1 <= len(dims) <= 3 or not all(d >= 1 for d in dims):
        raise LoweringError(f"{what} must be a positive int or 1-3 positive ints, got {v!r}")
    return dims + (1,) * (3 - len(dims))


class Launcher:
    """A kernel with its launch configuration fixed: ``Launcher(k, grid, block)(*args)``.

    The configured dispatcher ``k[grid, block, stream, dynamic_smem_bytes]`` is built and
    checked once, here, so the per-call path is one call plus the write-back loop; host time
    per numba launch is reported at about 56 us and was measured at 12 us + 4-5 us per array
    argument on an H200, almost all inside numba's own launch (see the module docstring).

    ``grid`` and ``block`` are an int or 1-3 ints; ``stream`` is 0 (the legacy default
    stream, torch's default too) or a numba stream (see :func:`stream_from_torch`);
    ``dynamic_smem_bytes`` defaults to the kernel's ``napkin_dynamic_smem_bytes`` (set by
    :func:`compile_kernel`) or 0.  Block size and dynamic shared memory are checked against
    :func:`device_limits` here (H100 limits under the simulator).

    Above 48 KB of dynamic shared memory the first launch sets the opt-in attribute for the
    overload its argument types select (:func:`set_max_dynamic_shared`); should a later
    launch fail with ``CUDA_ERROR_INVALID_VALUE`` for argument types not opted in yet, it
    sets the attribute for them and retries once.  The steady state costs nothing extra.

    With ``writeback`` (default) device copies made by :func:`as_device_array` from numpy
    arrays are copied back after the launch (:func:`copy_back`); other arguments cost one
    attribute lookup each.

    Under the simulator the configuration is re-applied at every call, because the
    simulator's kernel object stores it on itself (two Launchers of one kernel would
    otherwise share the last one).
    """

    __slots__ = ("kernel", "grid", "block", "stream", "dynamic_smem_bytes", "writeback",
                 "_configured", "_simulated", "_needs_optin", "_optin_checked")

    def __init__(self, kernel: Any, grid: Any, block: Any, stream: Any = 0,
                 dynamic_smem_bytes: int | None = None, *, writeback: bool = True):
        if not _is_dispatcher(kernel):
            raise LoweringError(f"Launcher expects a cuda.jit kernel, got {type(kernel).__name__}")
        self.kernel = kernel
        self.grid = _dim3(grid, "grid")
        self.block = _dim3(block, "block")
        if dynamic_smem_bytes is None:
            dynamic_smem_bytes = getattr(kernel, "napkin_dynamic_smem_bytes", 0)
        self.dynamic_smem_bytes = int(dynamic_smem_bytes)
        self.stream = stream
        self.writeback = writeback
        limits = device_limits()
        threads = self.block[0] * self.block[1] * self.block[2]
        if threads > limits.max_threads_per_block:
            raise LoweringError(f"block {self.block} has {threads} threads; {limits.name} allows "
                                f"{limits.max_threads_per_block}")
        _check_dynamic_smem(self.dynamic_smem_bytes)
        self._simulated = simulator_active()
        self._needs_optin = (not self._simulated
                             and self.dynamic_smem_bytes > limits.max_shared_per_block)
        self._optin_checked = False
        self._configured = None if self._simulated else kernel[
            self.grid, self.block, self.stream, self.dynamic_smem_bytes]

    def __repr__(self) -> str:
        name = getattr(self.kernel, "__name__", "kernel")
        return (f"Launcher({name}, grid={self.grid}, block={self.block}, "
                f"dynamic_smem_bytes={self.dynamic_smem_bytes})")

    def __call__(self, *args: Any) -> None:
        if self._simulated:
            self.kernel[self.grid, self.block, self.stream, self.dynamic_smem_bytes](*args)
        elif self._needs_optin:
            self._launch_with_optin(args)
        else:
            self._configured(*args)
        if self.writeback:
            for a in args:
                if getattr(a, _HOST_ATTR, None) is not None:
                    copy_back(a, stream=self.stream)

    def _optin_for(self, args: tuple) -> bool:
        """Set the opt-in for the overload these args select; False if it was already set."""
        argtypes = tuple(self.kernel.typeof_pyval(a) for a in args)
        done = getattr(self.kernel, "napkin_smem_optin", {})
        if done.get(argtypes, 0) >= self.dynamic_smem_bytes:
            return False
        set_max_dynamic_shared(self.kernel, argtypes, self.dynamic_smem_bytes)
        return True

    def _launch_with_optin(self, args: tuple) -> None:
        if not self._optin_checked:  # first launch of this Launcher: no failed attempt needed
            self._optin_for(args)
            self._optin_checked = True
        try:
            self._configured(*args)
        except Exception as e:
            # cuda.core raises CUDAError("CUDA_ERROR_INVALID_VALUE: ...") for a launch that
            # asks more shared memory than the overload allows; anything else is not ours
            if "CUDA_ERROR_INVALID_VALUE" not in str(e) or not self._optin_for(args):
                raise
            self._configured(*args)


# --------------------------------------------------------------------------------------------
# Type checking without a GPU


_TYPECHECK_SCRIPT = """
import json, sys
from napkin_cat.core.errors import LoweringError
from napkin_cat.lowering.runtime import typecheck_kernel
req = json.load(sys.stdin)
try:
    ir = typecheck_kernel(req["source"], req["name"], req["signature"], cc=tuple(req["cc"]))
    out = {"ok": True, "llvm": ir}
except LoweringError as e:
    out = {"ok": False, "error": str(e)}
except Exception as e:
    out = {"ok": False, "error": type(e).__name__ + ": " + str(e)}
sys.stdout.write("\\n@@napkin@@" + json.dumps(out))
"""


def typecheck_kernel(source: str, name: str, signature: Any, *,
                     cc: tuple[int, int] = (9, 0)) -> str:
    """Type-check generated source for one signature and return the kernel's LLVM IR.

    The simulator runs kernels as plain Python and checks no types, so source that it runs
    may still be rejected by numba's compiler on the GPU.  This runs numba-cuda's front end
    (typing and lowering to LLVM IR, ``numba.cuda.compiler.compile_cuda``) for compute
    capability ``cc``; it needs no GPU and no NVRTC, but numba-cuda must find libNVVM.

    Typing needs the real ``numba.cuda``: when this process runs the simulator, the check
    runs in a subprocess with ``NUMBA_ENABLE_CUDASIM=0`` (about 2 s), and ``signature``
    must then be a string such as ``"void(float32[:, ::1], float32[::1], int32)"``.
    Raises :class:`~napkin_cat.core.errors.LoweringError` with numba's message on failure.
    """
    if simulator_active():
        if not isinstance(signature, str):
            raise LoweringError("typecheck_kernel under the simulator runs in a subprocess and "
                                "needs the signature as a string")
        return _typecheck_subprocess(source, name, signature, cc)
    import_cuda()
    from numba.cuda.compiler import compile_cuda

    disp = compile_kernel(source, name)
    argtypes = signature_argtypes(signature)
    try:
        cres = compile_cuda(disp.py_func, None, argtypes, cc=tuple(cc))
    except Exception as e:
        raise LoweringError(f"kernel {name!r} does not compile for {signature}: "
                            f"{type(e).__name__}: {e}") from e
    return cres.library.get_llvm_str()


def _typecheck_subprocess(source: str, name: str, signature: str, cc) -> str:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    request = json.dumps({"source": source, "name": name, "signature": signature,
                          "cc": list(cc)})
    proc = subprocess.run([sys.executable, "-c", _TYPECHECK_SCRIPT], input=request,
                          capture_output=True, text=True, env=env, timeout=600)
    _, sep, payload = proc.stdout.rpartition("\n@@napkin@@")
    if not sep:
        raise LoweringError(f"typecheck subprocess for kernel {name!r} failed "
                            f"(exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out = json.loads(payload)
    if not out["ok"]:
        raise LoweringError(out["error"])
    return out["llvm"]
