"""The low-level runtime that generated numba.cuda kernels run on.

The code generator emits Python source text; this module turns that text into a launchable
kernel and launches it, on a real GPU and under numba's CUDA simulator alike:

:func:`compile_kernel`     exec generated source, return the ``cuda.jit`` dispatcher
:class:`Launcher`          a launch configuration fixed once, called many times
:func:`set_max_dynamic_shared`  opt a kernel in to > 48 KB of dynamic shared memory
:func:`kernel_function`    numba's loaded kernel (handle, attributes) for one signature
:data:`GPU_MATH`           :mod:`math` with the GPU's IEEE results, for simulated kernels

and re-exports the rest of the runtime, so ``napkin_cat.lowering.runtime`` is the one name to
import: :mod:`.devices` (:func:`simulator_active`, :func:`gpu_available`,
:func:`driver_present`, :func:`import_cuda`, :func:`ensure_numpy_compat`,
:func:`device_limits`, :data:`H100_DEFAULTS`), :mod:`.device_arrays`
(:func:`as_device_array`, :func:`copy_back`, :func:`clear_array_cache`,
:func:`stream_from_torch`).  :func:`~.typecheck.typecheck_kernel` (compiling a kernel to LLVM without a GPU) is in :mod:`.typecheck`.

Nothing here imports ``numba.cuda`` at module import time (see :mod:`.devices`).  What this
relies on in numba-cuda 0.30.4, and what was measured on a GPU, is in docs/RUNTIME_NOTES.md.
"""

from __future__ import annotations

import hashlib
import itertools
import linecache
import math
import operator
from typing import Any

from ..core.errors import LoweringError
from .device_arrays import HOST_ATTR, as_device_array, clear_array_cache, copy_back, stream_from_torch
from .devices import (DEFAULT_SHARED_PER_BLOCK, H100_DEFAULTS, DeviceLimits, device_limits, driver_present,
                      ensure_numpy_compat, gpu_available, import_cuda, limits_of, simulator_active)

__all__ = [
    "DEFAULT_SHARED_PER_BLOCK",
    "GPU_MATH",
    "H100_DEFAULTS",
    "DeviceLimits",
    "Launcher",
    "as_device_array",
    "clear_array_cache",
    "compile_kernel",
    "copy_back",
    "device_limits",
    "driver_present",
    "ensure_numpy_compat",
    "gpu_available",
    "import_cuda",
    "kernel_function",
    "limits_of",
    "set_max_dynamic_shared",
    "signature_argtypes",
    "simulator_active",
    "stream_from_torch",
]


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
    argument on an H200, almost all inside numba's own launch (see docs/RUNTIME_NOTES.md).

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
                if getattr(a, HOST_ATTR, None) is not None:
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
