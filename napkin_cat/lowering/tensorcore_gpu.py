"""The GPU side of :mod:`.tensorcore`: the linked PTX functions of ``tensorcore.cu`` and the
numba device functions generated kernels call (imported only on a GPU: it imports numba.cuda).

Shared-memory and global operands are passed as (array, element offset).  A shared operand's
address is the 32-bit shared-window address of the array (``shared_addr``: an address-space cast
the compiler sees through, so one per kernel) plus twice the offset; a global one is the array's
generic address (``addr_of``) plus twice the offset.  ``pin`` passes a value through an
instruction the compiler may neither hoist nor merge (:class:`.emit_mma.LdMatrix`).
"""

from __future__ import annotations

import os

from llvmlite import ir
from numba import cuda, int32, uint32, uint64

from .devices import import_cuda

CU_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tensorcore.cu")

_MMA = "UniTuple(float32, 4)(uint32, uint32, uint32, uint32, uint32, uint32, float32, float32, float32, float32)"
_MMA_TF32X3 = f"UniTuple(float32, 4)({'uint64, ' * 12}float32, float32, float32, float32)"
SIGNATURES = {
    "mma_f16": _MMA, "mma_bf16": _MMA,
    "pack_f16": "uint32(float32, float32)", "pack_bf16": "uint32(float32, float32)",
    "h2f": "float32(int16)", "bf2f": "float32(int16)", "f2h": "int16(float32)", "f2bf": "int16(float32)",
    "ldsm_x4": "UniTuple(uint32, 4)(uint32)", "ldsm_x4_t": "UniTuple(uint32, 4)(uint32)",
    "ldsm_x2": "UniTuple(uint32, 2)(uint32)", "ldsm_x2_t": "UniTuple(uint32, 2)(uint32)",
    "pin": "uint32(uint32)", "cp_async16": "int32(uint32, uint64, int32)", "cp_async_wait_all": "int32()",
    "red_add2": "int32(uint64, float32, float32)", "st_pair16": "int32(uint64, uint32)",
    "cp_async_commit": "int32()", "cp_async_wait1": "int32()", "cp_async_wait2": "int32()",
    "wgmma_fence": "int32()", "wgmma_commit": "int32()", "fence_proxy_async": "int32()",
    "bar_named": "int32(uint32, uint32)", "bar_arrive": "int32(uint32, uint32)",
    "bulk_add": "int32(uint64, uint32, uint32)", "bulk_commit": "int32()", "bulk_wait_read": "int32()",
    "bulk_wait_all": "int32()",
    "pack_tf32x3": "UniTuple(uint64, 2)(float32, float32)",
    "mma_tf32x3": _MMA_TF32X3, "mma_tf32x3s": _MMA_TF32X3,
    "mbar_init": "int32(uint32, uint32)", "mbar_fence_init": "int32()", "mbar_expect": "int32(uint32, uint32)",
    "mbar_wait": "int32(uint32, uint32)",
    **{f"tma_load{r}": f"int32(uint32, uint64, {'int32, ' * r}uint32)" for r in range(1, 6)},
}
"""The linked functions of ``tensorcore.cu`` (``nc_`` + name) and their numba signatures; the
``ldsm_*`` and ``cp_async16`` that kernels call wrap them (:mod:`.tensorcore_gpu`)."""

import_cuda()
try:  # numba-cuda's own extension API, else numba's
    from numba.cuda.extending import intrinsic
    from numba.cuda import types as _types
except ImportError:  # pragma: no cover - older layouts
    from numba.core.extending import intrinsic
    from numba.core import types as _types


@intrinsic
def addr_of(typingctx, arr):
    """The generic address (uint64) of an array's first element."""
    sig = _types.uint64(arr)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.ptrtoint(ary.data, ir.IntType(64))

    return sig, codegen


@intrinsic
def shared_addr(typingctx, arr):
    """The 32-bit shared-window address (uint32) of a shared array's first element: an LLVM
    address-space cast, which the compiler sees through (one conversion per kernel, offsets
    added in 32 bits)."""
    sig = _types.uint32(arr)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        shared = builder.addrspacecast(ary.data, ary.data.type.pointee.as_pointer(3))
        return builder.ptrtoint(shared, ir.IntType(32))

    return sig, codegen


_linked = {name: cuda.declare_device(f"nc_{name}", sig, link=CU_FILE) for name, sig in SIGNATURES.items()}
mma_f16, mma_bf16 = _linked["mma_f16"], _linked["mma_bf16"]
pack_f16, pack_bf16 = _linked["pack_f16"], _linked["pack_bf16"]
h2f, bf2f, f2h, f2bf = _linked["h2f"], _linked["bf2f"], _linked["f2h"], _linked["f2bf"]
_ldsm_x4, _ldsm_x4_t = _linked["ldsm_x4"], _linked["ldsm_x4_t"]
_ldsm_x2, _ldsm_x2_t = _linked["ldsm_x2"], _linked["ldsm_x2_t"]
pin = _linked["pin"]
_cp16, cp_async_wait_all = _linked["cp_async16"], _linked["cp_async_wait_all"]
cp_async_commit, cp_async_wait1 = _linked["cp_async_commit"], _linked["cp_async_wait1"]
cp_async_wait2 = _linked["cp_async_wait2"]
_red2, _st2 = _linked["red_add2"], _linked["st_pair16"]
bar_named, bar_arrive = _linked["bar_named"], _linked["bar_arrive"]
_bulk_add = _linked["bulk_add"]
mma_tf32x3, mma_tf32x3s, pack_tf32x3 = _linked["mma_tf32x3"], _linked["mma_tf32x3s"], _linked["pack_tf32x3"]


@cuda.jit(device=True, inline=True)
def ldsm_x4(smem16, off):
    return _ldsm_x4(shared_addr(smem16) + uint32(off) * uint32(2))


@cuda.jit(device=True, inline=True)
def ldsm_x4_t(smem16, off):
    return _ldsm_x4_t(shared_addr(smem16) + uint32(off) * uint32(2))


@cuda.jit(device=True, inline=True)
def ldsm_x2(smem16, off):
    return _ldsm_x2(shared_addr(smem16) + uint32(off) * uint32(2))


@cuda.jit(device=True, inline=True)
def ldsm_x2_t(smem16, off):
    return _ldsm_x2_t(shared_addr(smem16) + uint32(off) * uint32(2))


@cuda.jit(device=True, inline=True)
def cp_async16(smem16, soff, src16, goff, valid):
    if valid:
        return _cp16(shared_addr(smem16) + uint32(soff) * uint32(2), addr_of(src16) + goff * 2, 16)
    return _cp16(shared_addr(smem16) + uint32(soff) * uint32(2), addr_of(src16), 0)


@cuda.jit(device=True, inline=True)
def cp_async16_f32(smem, soff, src, goff, valid):
    """16 bytes (4 fp32 words) from ``src[goff:]`` to ``smem[soff:]``; zeros where not ``valid``."""
    if valid:
        return _cp16(shared_addr(smem) + uint32(soff) * uint32(4), addr_of(src) + goff * 4, 16)
    return _cp16(shared_addr(smem) + uint32(soff) * uint32(4), addr_of(src), 0)


@cuda.jit(device=True, inline=True)
def red_add2(out, idx, a, b):
    """``out[idx] += a`` and ``out[idx + 1] += b`` (fp32, ``idx`` even), atomically, as one
    reduction of two words."""
    return _red2(addr_of(out) + uint64(idx) * uint64(4), a, b)


@cuda.jit(device=True, inline=True)
def st_pair16(out, idx, word):
    """``out[idx]``, ``out[idx + 1]`` (16-bit, ``idx`` even) = ``word``'s low and high halves: one
    32-bit store."""
    return _st2(addr_of(out) + uint64(idx) * uint64(2), word)


@cuda.jit(device=True, inline=True)
def bulk_add_f32(out, goff, smem, soff, nbytes):
    """``out[goff:] += smem[soff:]`` over ``nbytes`` bytes (fp32 words; a multiple of 16, both
    addresses 16-byte aligned), one bulk reduction issued by the calling thread (:mod:`.staged_add`)."""
    return _bulk_add(addr_of(out) + uint64(goff) * uint64(4), shared_addr(smem) + uint32(soff) * uint32(4),
                       uint32(nbytes))


@cuda.jit(device=True, inline=True)
def wgmma_desc(addr, lbo, sbo):
    """A ``wgmma`` matrix descriptor without swizzle: the shared byte address ``addr`` and the byte
    distances between core matrices adjacent along the reduced axis (``lbo``) and along the
    operand's own axis (``sbo``), each in 16-byte units (:mod:`.wgmma`)."""
    return (((addr & uint64(0x3FFFF)) >> uint64(4)) | (uint64(lbo >> 4) << uint64(16))
            | (uint64(sbo >> 4) << uint64(32)))


@cuda.jit(device=True, inline=True)
def wgmma_desc16(smem16, off, lbo, sbo):
    """The descriptor of the 16-bit shared buffer element ``off`` (the kernel adds each step's
    constant to it: :func:`.wgmma.emit_wgmma`)."""
    return wgmma_desc(uint64(shared_addr(smem16) + uint32(off) * uint32(2)), lbo, sbo)


_mbar_init, _mbar_expect, _mbar_wait = _linked["mbar_init"], _linked["mbar_expect"], _linked["mbar_wait"]


@cuda.jit(device=True, inline=True)
def mbar_init(smem, word, count):
    """Initialise the ``mbarrier`` at word ``word`` of shared array ``smem`` for ``count`` arrivals (:mod:`.tma`)."""
    return _mbar_init(shared_addr(smem) + uint32(word) * uint32(4), uint32(count))


@cuda.jit(device=True, inline=True)
def mbar_expect(smem, word, nbytes):
    return _mbar_expect(shared_addr(smem) + uint32(word) * uint32(4), uint32(nbytes))


@cuda.jit(device=True, inline=True)
def mbar_wait(smem, word, parity):
    return _mbar_wait(shared_addr(smem) + uint32(word) * uint32(4), uint32(parity))


mbar_fence_init = _linked["mbar_fence_init"]

_TMA_WRAPPER = """
@cuda.jit(device=True, inline=True)
def tma_load(smem16, dst, arr, tmap, {coords}, smem, bar):
    return linked(shared_addr(smem16) + uint32(dst) * uint32(2), addr_of(tmap), {ints},
                  shared_addr(smem) + uint32(bar) * uint32(4))
"""
"""``tma_load{r}``: ``arr`` (the input the map describes) names it for the simulated twin only."""


def _tma_load(r: int):
    coords = ", ".join(f"c{i}" for i in range(r))
    ns = {"cuda": cuda, "uint32": uint32, "int32": int32, "linked": _linked[f"tma_load{r}"],
          "shared_addr": shared_addr, "addr_of": addr_of}
    exec(compile(_TMA_WRAPPER.format(coords=coords, ints=", ".join(f"int32(c{i})" for i in range(r))),
                 f"<tma_load{r}>", "exec"), ns)
    return ns["tma_load"]


_WGMMA_WRAPPER = """
@cuda.jit(device=True, inline=True)
def wgmma(smem16, desc, trans, a0, a1, a2, a3{acc}):
    return linked(a0, a1, a2, a3, uint64(desc), int32(trans){acc})
"""
"""``smem16`` is the simulated twin's (which has no shared window to address); here the
descriptor alone names the operand."""

_WGMMA_SS_WRAPPER = """
@cuda.jit(device=True, inline=True)
def wgmma(smem16, adesc, desc, trans{acc}):
    return linked(uint64(adesc), uint64(desc), int32(trans){acc})
"""
"""The SS form (:func:`.wgmma.shared_a`): A by descriptor too."""


def _wgmma_file(n: int) -> str:
    """The generated PTX wrappers of width ``n`` (:func:`.wgmma.cu_source`), written once."""
    from .wgmma import cu_source
    return _cu_file(f"wgmma_n{n}", cu_source(n))


def _cu_file(stem: str, text: str) -> str:
    """``text`` in a ``.cu`` file named by ``stem`` and its hash, written once."""
    import hashlib
    import tempfile
    folder = os.path.join(tempfile.gettempdir(), "napkin_cat_wgmma")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{stem}_{hashlib.sha1(text.encode()).hexdigest()[:12]}.cu")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    return path


def wgmma_primitive(name: str):
    """The device function behind warpgroup primitive ``name`` (:mod:`.wgmma`; cached by
    :func:`.tensorcore.wgmma_primitive`)."""
    from .wgmma import FIXED, SETMAXNREG, parse, setmaxnreg_source, shared_a
    if SETMAXNREG.match(name):
        return cuda.declare_device(f"nc_{name}", "int32()", link=_cu_file(name, setmaxnreg_source(name)))
    if name == "wgmma_desc16":
        return wgmma_desc16
    if name == "bulk_add_f32":
        return bulk_add_f32
    if name.startswith("tma_load"):
        return _tma_load(int(name[len("tma_load"):]))
    if name in ("mbar_init", "mbar_expect", "mbar_wait", "mbar_fence_init"):
        return globals()[name]
    if name in FIXED or name in _linked:
        return _linked[name]
    hit = parse(name)
    if hit is None:
        raise AttributeError(name)
    dt, n, extra = hit
    acc = f"UniTuple(float32, {n // 2})"
    if dt is None:
        return cuda.declare_device(f"nc_wgmma_wait{extra or ''}_n{n}", f"{acc}({acc})", link=_wgmma_file(n))
    ss = shared_a(name)
    args = f"{'uint64' if ss else 'uint32, uint32, uint32, uint32'}, uint64, int32{'' if extra else ', ' + acc}"
    linked = cuda.declare_device(f"nc_{name}", f"{acc}({args})", link=_wgmma_file(n))
    ns = {"cuda": cuda, "uint64": uint64, "int32": int32, "linked": linked}
    wrapper = _WGMMA_SS_WRAPPER if ss else _WGMMA_WRAPPER
    exec(compile(wrapper.format(acc="" if extra else ", acc"), f"<wgmma {name}>", "exec"), ns)
    return ns["wgmma"]
