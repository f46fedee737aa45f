"""Probe: the copying warpgroup of the warpgroup attention forward with its ``cp.async`` copies
replaced by the tensor memory accelerator (TMA: ``cp.async.bulk.tensor`` completing on an
``mbarrier``), the K and V chunk buffers laid out in 128-byte swizzled panels (the layout TMA
writes and ``wgmma`` reads by a descriptor with swizzle mode 1).  A measurement to decide whether
to build TMA copies into the code generator, not a feature: the generated forward's source is
rewritten here, by text, then checked against float64 and timed against the generated kernel and
FlexAttention in turns (``forward_overlap.py``'s harness).

Why (kernels/BENCHMARKS.md, "Second session of 2026-11-30"): the d = 128 forward with its copies
removed ran 0.529 ms against 0.72 with them, and FlexAttention 0.574.  The copying warpgroup's
``cp.async`` copies go through the load/store units and the MIO queue that the computing warps'
shuffles and ``wgmma`` issue share; one TMA instruction moves a whole 64 x 64 tile.

The rewrite, for the unmasked forward with three chunk buffers (``producer._ahead_copies``):

- each chunk buffer of K and V becomes ``d / 64`` panels of ``CHUNK_x`` rows of 128 bytes,
  16-byte units swizzled by the row (``unit ^ row % 8``): TMA's ``CU_TENSOR_MAP_SWIZZLE_128B``;
- one thread of the copying warpgroup arms chunk c's ``mbarrier`` with the chunk's bytes and
  issues its ``2 d / 64`` tile copies; the copying warpgroup waits on that ``mbarrier`` (parity:
  the buffer's fill count) where it waited for its ``cp.async`` groups, and hands the chunk over
  at the same named barriers as before;
- the descriptors of K (K-major) and V (MN-major, transposed) take swizzle mode 1: K's stride
  between 8-row groups 1024 bytes, a step of 16 along d 32 bytes within a panel; V's leading
  offset the panel (``CHUNK_x * 128`` bytes), its stride 1024 bytes, a step of 16 keys 2048 bytes.

The tensor maps (``cuTensorMapEncodeTiled``, through ctypes) describe the probe's own K and V
tensors; the kernel reads them from device memory at addresses written into its source, so the
rewritten kernel is only right for those tensors (the probe's check calls it on them).

It rewrites the ``cp.async`` forward, which the generator writes with ``TMA=0`` since it copies by
TMA itself (``napkin_cat/lowering/tma.py``, built after this probe's measurement):

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/tma_copies.py --case f16,4096,128,0 \\
        --form default=TMA=0 --form tma=TMA=0:tma
"""
from __future__ import annotations

import ctypes
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from forward_stages import checked, edited, forward_key, time_forwards  # noqa: E402  (which puts the project on the path)

DTYPE_ENUM = {"f16": 6, "bf16": 9}       # CUtensorMapDataType (cuda.h)
SWIZZLE_128B, L2_128B, L2_256B = 3, 2, 3


def primitives():
    """The probe's device functions (module ``tma_prims``), over the project's linked PTX
    (``napkin_cat/lowering/tensorcore.cu``): byte offsets into the shared array, a map's address
    as an integer."""
    import types

    from numba import cuda, uint32, uint64, int32

    from napkin_cat.lowering.tensorcore_gpu import _linked, shared_addr
    _init, _fence, _expect, _wait, _tma = (_linked[n] for n in ("mbar_init", "mbar_fence_init", "mbar_expect",
                                                                  "mbar_wait", "tma_load3"))

    @cuda.jit(device=True, inline=True)
    def mbar_init(smem, off, count):
        return _init(shared_addr(smem) + uint32(off), uint32(count))

    @cuda.jit(device=True, inline=True)
    def mbar_expect(smem, off, nbytes):
        return _expect(shared_addr(smem) + uint32(off), uint32(nbytes))

    @cuda.jit(device=True, inline=True)
    def mbar_wait(smem, off, parity):
        return _wait(shared_addr(smem) + uint32(off), uint32(parity))

    @cuda.jit(device=True, inline=True)
    def tma3(smem, dst, tmap, c0, c1, c2, bar):
        return _tma(shared_addr(smem) + uint32(dst), uint64(tmap), int32(c0), int32(c1), int32(c2),
                    shared_addr(smem) + uint32(bar))

    @cuda.jit
    def smem_base(out):
        smem = cuda.shared.array(0, dtype=uint32)
        smem[0] = uint32(0)
        out[0] = shared_addr(smem)

    mod = types.ModuleType("tma_prims")
    mod.__dict__.update(mbar_init=mbar_init, mbar_fence_init=_fence, mbar_expect=mbar_expect,
                        mbar_wait=mbar_wait, tma3=tma3, smem_base=smem_base)
    sys.modules["tma_prims"] = mod
    return mod


def tensor_map(t, dtype: str, box_rows: int, promotion: int):
    """A device tensor holding the TMA map of ``t`` ``[bh, n, d]`` (16-bit, contiguous): three
    dimensions (d, n, bh), boxes of 64 x ``box_rows`` x 1, 128-byte swizzle, zeros out of bounds."""
    import torch
    bh, n, d = t.shape
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    raw = (ctypes.c_uint8 * 256)()
    at = (ctypes.addressof(raw) + 63) // 64 * 64
    dims = (ctypes.c_uint64 * 3)(d, n, bh)
    strides = (ctypes.c_uint64 * 2)(d * 2, n * d * 2)
    box = (ctypes.c_uint32 * 3)(64, box_rows, 1)
    ones = (ctypes.c_uint32 * 3)(1, 1, 1)
    rc = fn(ctypes.c_void_p(at), DTYPE_ENUM[dtype], 3, ctypes.c_void_p(t.data_ptr()), dims, strides, box, ones,
            0, SWIZZLE_128B, promotion, 0)
    assert rc == 0, f"cuTensorMapEncodeTiled: CUresult {rc}"
    return torch.frombuffer(bytearray(ctypes.string_at(at, 128)), dtype=torch.uint8).to("cuda")


def _one(pattern: str, text: str, flags=re.M) -> re.Match:
    found = list(re.finditer(pattern, text, flags))
    assert len(found) == 1, f"{pattern!r}: {len(found)} matches, expected 1"
    return found[0]


def tma_source(source: str, smem_bytes: int, map_k: int, map_v: int) -> tuple[str, int]:
    """``source`` with TMA copies and swizzled K / V panels; the extra shared bytes (mbarriers)."""
    chunk = int(_one(r"^CHUNK_x = uint32\((\d+)\)", source).group(1))
    d = int(_one(r"^N_d = uint32\((\d+)\)", source).group(1))
    assert "(3 chunk buffers)" in source and d % 64 == 0, "not the three-buffer forward this probe rewrites"
    panels, panel_bytes = d // 64, chunk * 128
    bh = _one(r"cp_async16\(smem16, K_s_fill3 \* U2 \+ .*?, K, \((.+?) \* N_x \+ \(x_ahead", source).group(1)
    start = _one(r"^    if tid >= NTHREADS:  # the copying warpgroup.*?\n", source).start()
    end = _one(r"^        return\n", source).end()
    old = source[start:end]
    arrivals = re.findall(r"^ +bar_arrive\(U\d+ \+ \(\(pland_x \+ U1\) % U2\) \* U\d+, U\d+\).*\n", old, re.M)
    release = _one(r"^ +bar_named\(U\d+ \+ \(\(pbuf_x \+ U2\) % U3\), U\d+\).*\n", old).group(0).strip()
    end_x = _one(r"^        for x0 in range\(U0, (\w+), CHUNK_x\):\n", old).group(1)
    prelude = old[_one(r"^        ptid = tid - NTHREADS\n", old).end():_one(r"^        pbuf_x = U0\n", old).start()]
    after = "        cuda.syncthreads()  # a barrier of the multiplying warps after the loop\n"
    assert old.count(after) <= 1
    mbar = (smem_bytes + 7) // 8 * 8
    issue = "\n".join(
        f"{{ind}}tma3(smem, ({{k}} + ({{buf}}) * STRIDE_K_s) * U4 + uint32({p * panel_bytes}), TMAP_K, {p * 64}, {{x}}, bh, MBAR + ({{buf}}) * U8)\n"
        f"{{ind}}tma3(smem, ({{v}} + ({{buf}}) * STRIDE_V_s) * U4 + uint32({p * panel_bytes}), TMAP_V, {p * 64}, {{x}}, bh, MBAR + ({{buf}}) * U8)"
        for p in range(panels))

    def chunk_copy(ind: str, buf: str, x: str) -> str:
        return (f"{ind}mbar_expect(smem, MBAR + ({buf}) * U8, uint32({2 * chunk * d * 2}))\n"
                + issue.format(ind=ind, k="K_s", v="V_s", buf=buf, x=x) + "\n")

    new = ("    if tid >= NTHREADS:  # the copying warpgroup: TMA copies (probe: kernels/probes/tma_copies.py)\n"
           "        setmaxnreg_dec_24()\n"
           "        ptid = tid - NTHREADS\n"
           f"        bh = {bh}\n"
           + prelude
           + "        if ptid == U0:\n"
           "            for s in range(3):\n"
           "                mbar_init(smem, MBAR + uint32(s) * U8, U1)\n"
           "            mbar_fence_init()\n"
           "        bar_named(uint32(15), NPRODUCER)  # the mbarriers are initialised before any thread waits there\n"
           "        if ptid == U0:\n"
           + chunk_copy("            ", "U0", "U0")
           + f"            if CHUNK_x < {end_x}:\n"
           + chunk_copy("                ", "U1", "CHUNK_x")
           + "        mbar_wait(smem, MBAR, U0)\n"
           "        cuda.syncthreads()  # chunk 0 has landed\n"
           "        pbuf_x = U0\n"
           "        pland_x = U0\n"
           f"        for x0 in range(U0, {end_x}, CHUNK_x):\n"
           "            x_ahead = x0 + U2 * CHUNK_x\n"
           "            if x0 > U0:\n"
           f"                {release}\n"
           f"            if x_ahead < {end_x} and ptid == U0:\n"
           + chunk_copy("                ", "(pbuf_x + U2) % U3", "x_ahead")
           + "            x_next2 = x0 + CHUNK_x\n"
           f"            if x_next2 < {end_x}:\n"
           "                mbar_wait(smem, MBAR + ((pbuf_x + U1) % U3) * U8, (x_next2 // CHUNK_x // U3) % U2)\n"
           + "".join(arrivals)
           + "            pbuf_x = (pbuf_x + U1) % U3\n"
           "            pland_x = U1 - pland_x\n"
           + (after if after in old else "")
           + "        return\n")
    source = source[:start] + new + source[end:]
    # the descriptors: swizzle mode 1 (bits 62-63), K-major K, MN-major V
    source, n = re.subn(r"K_s_desc = wgmma_desc16\(smem16, K_s_cur \* U2, U\d+, U\d+\)",
                        "K_s_desc = wgmma_desc16(smem16, K_s_cur * U2, U16, U1024) | SW128", source)
    source, m = re.subn(r"V_s_desc = wgmma_desc16\(smem16, V_s_cur \* U2, U\d+, U\d+\)",
                        f"V_s_desc = wgmma_desc16(smem16, V_s_cur * U2, uint32({panel_bytes}), U1024) | SW128", source)
    assert n == m == 1, "the forward's descriptors are not the expected ones"
    kstep = min(int(v) for v in re.findall(r"K_s_desc \+ U(\d+)", source))
    vstep = min(int(v) for v in re.findall(r"V_s_desc \+ U(\d+)", source))

    def k_step(m):
        k = int(m.group(1)) // kstep
        return f"K_s_desc + uint64({(k // 4) * (panel_bytes // 16) + (k % 4) * 2})"

    def v_step(m):
        return f"V_s_desc + uint64({int(m.group(1)) // vstep * 128})"

    source, nk = re.subn(r"K_s_desc \+ U(\d+)", k_step, source)
    source, nv = re.subn(r"V_s_desc \+ U(\d+)", v_step, source)
    assert nk == d // 16 - 1 and nv == chunk // 16 - 1, (nk, nv)
    header = (f"\nfrom tma_prims import mbar_init, mbar_fence_init, mbar_expect, mbar_wait, tma3  # noqa: E402\n"
              f"SW128 = uint64(1 << 62)  # wgmma descriptor: 128-byte swizzle\n"
              f"TMAP_K = uint64({map_k})  # device address of K's tensor map\n"
              f"TMAP_V = uint64({map_v})\n"
              f"MBAR = uint32({mbar})  # shared byte offset of the three chunk mbarriers\n"
              f"U1024 = uint32(1024)\n")
    at = _one(r"^NPRODUCER = .*\n", source).end()
    source = source[:at] + header + source[at:]
    return source, mbar + 24 - smem_bytes


def main():
    import torch

    from numba import cuda

    from op_forms import build, case_args, case_tensors
    ap = case_args(rounds=7)
    ap.add_argument("--form", action="append", default=[], help="NAME=SPEC[:tma|tma256]")
    args = ap.parse_args()
    causal, Q, K, V, dO, want = case_tensors(args)
    mod = primitives()
    base = cuda.device_array(1, dtype="uint32")
    mod.smem_base[1, 32, 0, 1024](base)
    print(f"dynamic shared memory starts at shared address {int(base.copy_to_host()[0])}", flush=True)
    dt = args.case.split(",")[0]
    ops, keep = {}, []
    for form in args.form or ["default=", "tma=:tma"]:
        name, spec = form.split("=", 1)
        spec, _, mode = spec.partition(":")
        op, _, _ = build(spec, causal, Q, K, V, dO)
        if mode in ("tma", "tma256"):
            key = forward_key(op)
            kern = op._cache[key]
            promo = L2_256B if mode == "tma256" else L2_128B
            chunk = int(_one(r"^CHUNK_x = uint32\((\d+)\)", kern.source).group(1))
            mk, mv = (tensor_map(t.detach(), dt, chunk, promo) for t in (K, V))
            keep += [mk, mv]
            src, extra = tma_source(kern.source, kern.launch.dynamic_smem_bytes, mk.data_ptr(), mv.data_ptr())
            op._cache[key] = edited(kern, src, extra)
        ops[name] = checked(f"{name} ({spec or 'defaults'}{', ' + mode if mode else ''})", op, Q, K, V, dO, want)
    del want
    time_forwards(ops, args, Q, K, V, dO, causal, kernels=1)


if __name__ == "__main__":
    main()
