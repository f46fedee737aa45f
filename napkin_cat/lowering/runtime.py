"""The low-level runtime that generated numba.cuda kernels run on.

The code generator emits Python source text; this module turns that text into a launchable
kernel and launches it, on a real GPU and under numba's CUDA simulator alike:

:func:`compile_kernel`     exec generated source, return the ``cuda.jit`` dispatcher
:class:`Launcher`          a launch configuration fixed once, called many times
:class:`PackedLaunch`      one overload's parameters packed once, launched by the driver
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

import ctypes
import hashlib
import itertools
import linecache
import math
import operator
import threading
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
    "PackedLaunch",
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


def _inf_on_overflow(f):
    """``f`` giving inf where Python's ``math`` raises OverflowError (the GPU's IEEE result)."""
    def g(v):
        try:
            return f(v)
        except OverflowError:
            return math.inf
    return staticmethod(g)


class _GPUMath:
    """:mod:`math` as a GPU evaluates it, for kernels run in the simulator: where Python's
    ``math`` raises (``exp`` / ``exp2`` overflow, ``log`` or ``sqrt`` outside their domain), the IEEE
    result (inf, -inf or NaN) that the GPU returns."""

    def __getattr__(self, name):
        return getattr(math, name)

    exp = _inf_on_overflow(math.exp)
    exp2 = _inf_on_overflow(math.exp2)

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

    ``zero_args``: positions of arguments filled with zeros before every launch (outputs that
    the blocks add into with atomics: :mod:`.atomics`); such a launch is never packed.
    """

    __slots__ = ("kernel", "grid", "block", "stream", "dynamic_smem_bytes", "writeback", "zero_args",
                 "_configured", "_simulated", "_needs_optin", "_optin_checked")

    def __init__(self, kernel: Any, grid: Any, block: Any, stream: Any = 0,
                 dynamic_smem_bytes: int | None = None, *, writeback: bool = True, zero_args: tuple = ()):
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
        self.zero_args = tuple(zero_args)
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
        if self.zero_args:
            from .atomics import zero_fill
            for i in self.zero_args:
                zero_fill(args[i], self.stream)
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

    def pack(self, args: tuple, zeroed: bool = False) -> "PackedLaunch | None":
        """A :class:`PackedLaunch` of this configuration for arguments laid out like ``args``,
        which this Launcher has launched with already (so their overload is compiled, loaded
        and opted in to its shared memory); None where packing does not apply.  ``zeroed``: the
        caller zero-fills the ``zero_args`` itself before every packed launch."""
        return PackedLaunch.of(self, args, zeroed)


# --------------------------------------------------------------------------------------------
# Launching without numba's per-call work


class PackedLaunch:
    """One overload of a kernel, its launch configuration and its parameters, packed once:
    a call writes the data pointers of the array arguments into the packed parameters and
    calls the driver's ``cuLaunchKernel``; nothing else is computed per call.

    numba spends 12 us plus 4-5 us per array argument on the host for every launch (typing
    the arguments, selecting the overload, marshalling each array, building a cuda.core
    launch configuration: docs/RUNTIME_NOTES.md).  A generated kernel's arguments keep their
    types and shapes from call to call, only the addresses move, so all of that is done once
    here.  The parameters follow numba's ABI for an array argument (numba-cuda 0.30.4,
    ``_Kernel._prepare_args``): ``meminfo, parent, nitems, itemsize, data, shape[ndim],
    strides[ndim]``, each pointer-sized.

    ``packed(pointers, stream)`` launches with the data pointers of the array arguments, in
    order, on ``stream`` (a raw ``CUstream`` handle, 0 for the legacy default stream).  The
    caller guarantees that the arrays have exactly the packed dtypes, shapes and strides
    (:class:`~napkin_cat.lowering.Kernel` checks them before each call).  It returns False,
    having launched nothing, when the driver refuses the launch (a thread where no context
    is current, for one): the caller then launches through numba, which says why in its
    own words.  Calls from several threads are serialised around the shared parameter
    buffer (the driver copies the parameters before ``cuLaunchKernel`` returns).

    :meth:`of` builds one from a launch numba made (:meth:`Launcher.pack`), or returns None
    where packing does not apply: under the simulator, for an argument that is not a device
    array, or an overload with argument extensions, debug checks, cooperative launch or a
    launch-config-sensitive body.
    """

    __slots__ = ("func", "grid", "block", "dynamic_smem_bytes", "n_arrays", "_driver_launch",
                 "_values", "_pointers", "_params", "_slots", "_lock")

    ARRAY_FIELDS = ("meminfo", "parent", "nitems", "itemsize", "data")  # then shape, strides

    def __init__(self, func: Any, grid: tuple, block: tuple, dynamic_smem_bytes: int,
                 layouts: list[tuple[int, int, tuple, tuple]], driver_launch: Any):
        self.func = func
        self.grid = tuple(grid)
        self.block = tuple(block)
        self.dynamic_smem_bytes = int(dynamic_smem_bytes)
        self.n_arrays = len(layouts)
        values, slots = [], []
        for nitems, itemsize, shape, strides in layouts:
            if len(shape) != len(strides):
                raise LoweringError(f"PackedLaunch: shape {shape} and strides {strides} differ in rank")
            slots.append(len(values) + 4)   # where the data pointer goes
            values += [0, 0, int(nitems), int(itemsize), 0, *map(int, shape), *map(int, strides)]
        n = len(values)
        self._values = (ctypes.c_int64 * n)(*values)
        base, size = ctypes.addressof(self._values), ctypes.sizeof(ctypes.c_int64)
        self._pointers = (ctypes.c_void_p * max(n, 1))(*(base + i * size for i in range(n)))
        self._params = ctypes.addressof(self._pointers) if n else 0
        self._slots = tuple(slots)
        self._driver_launch = driver_launch
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"PackedLaunch(grid={self.grid}, block={self.block}, "
                f"dynamic_smem_bytes={self.dynamic_smem_bytes}, arrays={self.n_arrays})")

    def parameters(self) -> list[int]:
        """The packed parameter values, in order (for tests and debugging)."""
        return list(self._values)

    def __call__(self, pointers: Any, stream: int = 0) -> bool:
        (gx, gy, gz), (bx, by, bz) = self.grid, self.block
        with self._lock:
            values = self._values
            for slot, ptr in zip(self._slots, pointers):
                values[slot] = ptr
            err = self._driver_launch(self.func, gx, gy, gz, bx, by, bz, self.dynamic_smem_bytes,
                                      stream, self._params, 0)[0]
        return err == 0   # CUresult.CUDA_SUCCESS (an int enum)

    @classmethod
    def of(cls, launcher: "Launcher", args: tuple, zeroed: bool = False) -> "PackedLaunch | None":
        """Pack ``launcher``'s configuration for arguments laid out like ``args`` (see above);
        a launcher with zero-filled outputs only for a caller that fills them (``zeroed``)."""
        if launcher._simulated or not args or (launcher.zero_args and not zeroed):   # see Launcher
            return None
        if not all(getattr(a, "__cuda_ndarray__", False) for a in args):
            return None
        dispatcher = launcher.kernel
        if getattr(dispatcher, "_launch_config_sensitive", False):
            return None
        try:
            argtypes = tuple(dispatcher.typeof_pyval(a) for a in args)
            overload = dispatcher.overloads.get(argtypes)
        except Exception:  # noqa: BLE001 -- anything numba cannot type here is left to numba
            return None
        if (overload is None or getattr(overload, "extensions", None) or getattr(overload, "debug", False)
                or getattr(overload, "cooperative", False)
                or getattr(overload, "launch_config_sensitive", False)):
            return None
        layouts = []
        for a in args:
            itemsize = int(a.dtype.itemsize)
            strides = tuple(a.strides) if len(a.strides) == len(a.shape) else None
            if strides is None:
                return None
            layouts.append((int(a.size), itemsize, tuple(a.shape), strides))
        from cuda.bindings import driver as binding

        library = getattr(overload, "library", None) or overload._codelibrary
        handle = library.get_cufunc().handle   # a CUkernel (library API) or a CUfunction
        return cls(handle, launcher.grid, launcher.block, launcher.dynamic_smem_bytes, layouts,
                   binding.cuLaunchKernel)
