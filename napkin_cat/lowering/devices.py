"""Which numba.cuda this process runs (the CUDA simulator or a GPU), and the GPU's limits.

Nothing here imports ``numba.cuda`` at module import time: the simulator is chosen once per
process, when ``numba.cuda`` is first imported (``NUMBA_ENABLE_CUDASIM=1`` must be set before
that), so importing this module must not make the choice.  Import ``numba.cuda`` through
:func:`import_cuda`, and only when a kernel is needed.

Without a GPU the limits are :data:`H100_DEFAULTS`, derived from the hardware profile
:data:`napkin_cat.core.hardware.H100` (the one place its numbers are written).

>>> H100_DEFAULTS.max_shared_per_block_optin // 1024, H100_DEFAULTS.sm_count
(227, 132)
>>> H100_DEFAULTS.max_threads_per_sm, H100_DEFAULTS.max_registers_per_sm
(2048, 65536)
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

from ..core.hardware import H100, Hardware


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

    if not simulator_active():      # kernels compile here: numba's quadratic pass made linear
        from .numba_patches import install
        install()
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
    except Exception:
        # a boundary: importing numba.cuda or asking it for a device raises whatever the
        # install is missing (ImportError, OSError, numba's CudaSupportError, driver errors);
        # any of them means there is no GPU to run on
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
    :func:`~napkin_cat.lowering.runtime.set_max_dynamic_shared`.  ``from_device`` is False
    when the numbers come from a hardware profile (:func:`limits_of`) rather than from a GPU
    (simulator, or no GPU).
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


_REGISTER_BYTES = 4   # profiles count registers in bytes, the driver in 32-bit registers


def limits_of(hw: Hardware) -> DeviceLimits:
    """The launch limits of a hardware profile, for sizing kernels without its GPU at hand.

    >>> from napkin_cat.core.hardware import A100_SXM4
    >>> limits_of(A100_SXM4).max_shared_per_block_optin // 1024
    163
    """
    return DeviceLimits(
        name=f"{hw.name} (defaults, not read from a device)",
        compute_capability=hw.compute_capability,
        sm_count=hw.sms,
        warp_size=hw.warp_size,
        max_threads_per_block=hw.max_threads_per_block,
        max_threads_per_sm=hw.max_threads_per_sm,
        max_blocks_per_sm=hw.max_blocks_per_sm,
        max_shared_per_block=hw.smem_per_block_static,
        max_shared_per_block_optin=hw.smem_per_block_optin,
        max_shared_per_sm=hw.smem_per_sm,
        reserved_shared_per_block=hw.reserved_smem_per_block,
        max_registers_per_block=hw.registers_per_block // _REGISTER_BYTES,
        max_registers_per_sm=hw.registers_per_sm // _REGISTER_BYTES,
        l2_bytes=hw.l2_bytes,
        from_device=False,
    )


H100_DEFAULTS = limits_of(H100)
"""H100 SXM limits, used under the simulator so tiles chosen on a CPU fit the target GPU."""

DEFAULT_SHARED_PER_BLOCK = H100_DEFAULTS.max_shared_per_block
"""Shared memory (static + dynamic) a block may use without the opt-in attribute (48 KB)."""

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
