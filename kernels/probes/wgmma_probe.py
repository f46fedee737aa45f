"""Probe: Hopper's warpgroup MMA (``wgmma.mma_async``, sm_90a) from numba.cuda, through inline PTX
in a generated ``.cu`` (numba-cuda compiles for ``sm_90a`` on a compute-capability-9.0 device).

    NUMBA_ENABLE_CUDASIM=0 python kernels/probes/wgmma_probe.py

1. Correctness: one warpgroup multiplies A (64 x 16, registers, the mma.sync A-fragment layout per
   warp) by B (16 x N, shared memory, the no-swizzle "core matrix" layout, K-major and MN-major,
   both assignments of the descriptor's two byte offsets) against float64; prints which match.
2. Throughput: wgmma m64nNk16 (A in registers) against mma.sync m16n8k16 (B fragments in
   registers: the mma.sync ceiling), same work per block, on random operands.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from numba import cuda, float32, int16, uint32, uint64  # noqa: E402

from napkin_cat.lowering import tensorcore_gpu  # noqa: E402
from napkin_cat.lowering.tensorcore_gpu import ldsm_x2, ldsm_x4, mma_f16, shared_addr, wgmma_desc  # noqa: E402


def cu_source(n: int) -> str:
    regs = n // 2
    d = ", ".join(f"float c{i}" for i in range(regs))
    outs = ", ".join(f'"+f"(r.v[{i}])' for i in range(regs))
    dl = ",".join(f"%{i}" for i in range(regs))
    init = "".join(f"r.v[{i}] = c{i}; " for i in range(regs))
    return f"""
struct nc_acc{n} {{ float v[{regs}]; }};
extern "C" __device__ int nc_wgmma_ss_n{n}(nc_acc{n}* ret, unsigned long long adesc, unsigned long long desc, {d}) {{
  nc_acc{n} r; {init}
  asm volatile("{{\\nwgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {{{dl}}}, %{regs}, %{regs+1}, 1, 1, 1, 0, 0;\\n}}\\n"
               : {outs} : "l"(adesc), "l"(desc));
  *ret = r;
  return 0;
}}
extern "C" __device__ int nc_wgmma_rs_n{n}(nc_acc{n}* ret, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned long long desc, int tb, {d}) {{
  nc_acc{n} r; {init}
  if (tb) {{
  asm volatile("{{\\nwgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {{{dl}}}, {{%{regs},%{regs+1},%{regs+2},%{regs+3}}}, %{regs+4}, 1, 1, 1, 1;\\n}}\\n"
               : {outs} : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  }} else {{
  asm volatile("{{\\nwgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {{{dl}}}, {{%{regs},%{regs+1},%{regs+2},%{regs+3}}}, %{regs+4}, 1, 1, 1, 0;\\n}}\\n"
               : {outs} : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  }}
  *ret = r;
  return 0;
}}
extern "C" __device__ int nc_wgmma_wait_n{n}(nc_acc{n}* ret, {d}) {{
  nc_acc{n} r; {init}
  asm volatile("wgmma.wait_group.sync.aligned 0;\\n" : {outs} :: "memory");
  *ret = r;
  return 0;
}}
"""


COMMON = ""   # the fences are tensorcore.cu's (linked with the primitives imported below)

N = 64
CU = Path(tempfile.mkdtemp()) / "wgmma_probe.cu"
CU.write_text(COMMON + cu_source(N))
ACC = f"UniTuple(float32, {N // 2})"
FL = ", ".join(["float32"] * (N // 2))
wg_rs = cuda.declare_device(f"nc_wgmma_rs_n{N}", f"{ACC}(uint32, uint32, uint32, uint32, uint64, int32, {ACC})", link=str(CU))
wg_ss = cuda.declare_device(f"nc_wgmma_ss_n{N}", f"{ACC}(uint64, uint64, {ACC})", link=str(CU))
wg_wait = cuda.declare_device(f"nc_wgmma_wait_n{N}", f"{ACC}({ACC})", link=str(CU))
wg_fence, wg_commit = tensorcore_gpu.wgmma_primitive("wgmma_fence"), tensorcore_gpu.wgmma_primitive("wgmma_commit")
fence_proxy = tensorcore_gpu.wgmma_primitive("fence_proxy_async")

R = N // 2
ARGS = "acc"
ZERO = " + ".join("(" + ", ".join(["float32(0)"] * 16) + ",)" for _ in range(R // 16))


def build():
    ns = {"cuda": cuda, "uint32": uint32, "uint64": uint64, "int16": int16, "float32": float32,
          "wg_rs": wg_rs, "wg_wait": wg_wait, "wg_fence": wg_fence, "wg_commit": wg_commit,
          "fence_proxy": fence_proxy, "shared_addr": shared_addr, "mma_f16": mma_f16, "np": np,
          "wg_ss": wg_ss, "ldsm_x4": ldsm_x4, "ldsm_x2": ldsm_x2, "wgmma_desc": wgmma_desc}
    src = f'''
@cuda.jit(device=True, inline=True)
def acc_total(acc):
    # every accumulator of a warpgroup MMA, summed (what a speed kernel writes, so nothing is dead)
    tot = float32(0)
    for i in range({R}):
        tot += acc[i]
    return tot


@cuda.jit(device=True, inline=True)
def frag_zero(acc):
    for i in range(8):
        for j in range(4):
            acc[i, j] = float32(0)


@cuda.jit(device=True, inline=True)
def frag_total(acc):
    # every accumulator of the mma.sync fragments, summed
    tot = float32(0)
    for i in range(8):
        for j in range(4):
            tot += acc[i, j]
    return tot

@cuda.jit
def wg_check(A, B, D, kmajor, lbo, sbo, lay_lbo, lay_sbo):
    # A: [64, 16] f16 bits; B: [16, N] f16 bits; D: [64, N] f32
    tid = uint32(cuda.threadIdx.x)
    sm = cuda.shared.array(4096, dtype=int16)
    for e in range(tid, 16 * {N}, 128):
        k = e // {N}
        n = e % {N}
        if kmajor:   # core matrix: 8 n-rows x 8 k (16 B), n-adjacent at lay_sbo, k-adjacent at lay_lbo
            off = (n // 8) * lay_sbo + (k // 8) * lay_lbo + (n % 8) * 16 + (k % 8) * 2
        else:        # core matrix: 8 k-rows x 8 n (16 B), n-adjacent at lay_sbo, k-adjacent at lay_lbo
            off = (n // 8) * lay_sbo + (k // 8) * lay_lbo + (k % 8) * 16 + (n % 8) * 2
        sm[off // 2] = B[k, n]
    fence_proxy()
    cuda.syncthreads()
    w = tid // 32
    l = tid % 32
    g = l // 4
    t = l % 4
    r0 = 16 * w + g
    a0 = (uint32(A[r0, 2 * t]) & uint32(0xFFFF)) | ((uint32(A[r0, 2 * t + 1]) & uint32(0xFFFF)) << uint32(16))
    a1 = (uint32(A[r0 + 8, 2 * t]) & uint32(0xFFFF)) | ((uint32(A[r0 + 8, 2 * t + 1]) & uint32(0xFFFF)) << uint32(16))
    a2 = (uint32(A[r0, 2 * t + 8]) & uint32(0xFFFF)) | ((uint32(A[r0, 2 * t + 9]) & uint32(0xFFFF)) << uint32(16))
    a3 = (uint32(A[r0 + 8, 2 * t + 8]) & uint32(0xFFFF)) | ((uint32(A[r0 + 8, 2 * t + 9]) & uint32(0xFFFF)) << uint32(16))
    addr = uint64(shared_addr(sm))
    desc = wgmma_desc(addr, lbo, sbo)
    acc = {ZERO}
    wg_fence()
    tb = 1 - kmajor
    acc = wg_rs(a0, a1, a2, a3, desc, tb, {ARGS})
    wg_commit()
    acc = wg_wait(acc)
    for nt in range({N // 8}):
        c = 8 * nt + 2 * t
        D[r0, c] = acc[4 * nt]
        D[r0, c + 1] = acc[4 * nt + 1]
        D[r0 + 8, c] = acc[4 * nt + 2]
        D[r0 + 8, c + 1] = acc[4 * nt + 3]


@cuda.jit
def wg_speed(seed, iters, out):
    # B: [K = 64, N] K-major, in shared memory; A: 4 k-steps of register fragments
    tid = uint32(cuda.threadIdx.x)
    sm = cuda.shared.array(4096, dtype=int16)
    for e in range(tid, 64 * {N}, 128):
        sm[e] = int16(((e * 7 + seed) % 61) * 16 + 13312)   # f16 values near 0.25..1
    fence_proxy()
    cuda.syncthreads()
    x = uint32(seed + tid) * uint32(2654435761)
    a = cuda.local.array(16, uint32)
    for i in range(16):
        a[i] = (x >> uint32(i)) & uint32(0x3BFF3BFF)
    addr = uint64(shared_addr(sm))
    acc = {ZERO}
    # K-major, core matrices: n-adjacent 256 B apart (2 k-groups of 128 B ... ), k-adjacent 128 B
    for it in range(iters):
        wg_fence()
        for s in range(4):
            start = addr + uint64(s * 2 * 128 * {N // 8})
            desc = wgmma_desc(start, {N // 8 * 128}, 128)
            acc = wg_rs(a[4 * s], a[4 * s + 1], a[4 * s + 2], a[4 * s + 3], desc, 0, {ARGS})
        wg_commit()
        acc = wg_wait(acc)
    out[cuda.blockIdx.x * 128 + tid] = acc_total(acc)


@cuda.jit
def wg_variants(seed, iters, mode, out):
    # mode 0: A by ldmatrix before each wgmma (B K-major); 1: A by descriptor (SS); 2: B MN-major (trans)
    tid = uint32(cuda.threadIdx.x)
    sm = cuda.shared.array(4096, dtype=int16)
    sa = cuda.shared.array(4608, dtype=int16)
    for e in range(tid, 64 * {N}, 128):
        sm[e] = int16(((e * 7 + seed) % 61) * 16 + 13312)
    for e in range(tid, 4608, 128):
        sa[e] = int16(((e * 5 + seed) % 53) * 16 + 13312)
    fence_proxy()
    cuda.syncthreads()
    addr = uint64(shared_addr(sm))
    aaddr = uint64(shared_addr(sa))
    w = tid // 32
    l = tid % 32
    tb = 0
    if mode == 2:
        tb = 1
    acc = {ZERO}
    for it in range(iters):
        wg_fence()
        for s in range(4):
            start = addr + uint64(s * 2 * 128 * {N // 8})
            if mode == 2:
                desc = wgmma_desc(start, {N // 8 * 128}, 128)
            else:
                desc = wgmma_desc(start, 128, {N // 8 * 128})
            if mode == 1:
                astart = aaddr + uint64(s * 256)
                adesc = wgmma_desc(astart, 128, 1024)
                acc = wg_ss(adesc, desc, acc)
            else:
                a0, a1, a2, a3 = ldsm_x4(sa, (16 * w + l % 16) * 72 + l // 16 * 8 + s * 16)
                acc = wg_rs(a0, a1, a2, a3, desc, tb, acc)
        wg_commit()
        acc = wg_wait(acc)
    out[cuda.blockIdx.x * 128 + tid] = acc_total(acc)


@cuda.jit
def mma_ldsm_speed(seed, iters, out):
    tid = uint32(cuda.threadIdx.x)
    sm = cuda.shared.array(4608, dtype=int16)
    sa = cuda.shared.array(4608, dtype=int16)
    for e in range(tid, 4608, 128):
        sm[e] = int16(((e * 7 + seed) % 61) * 16 + 13312)
        sa[e] = int16(((e * 5 + seed) % 53) * 16 + 13312)
    cuda.syncthreads()
    w = tid // 32
    l = tid % 32
    acc = cuda.local.array((8, 4), float32)
    frag_zero(acc)
    for it in range(iters):
        for s in range(4):
            a0, a1, a2, a3 = ldsm_x4(sa, (16 * w + l % 16) * 72 + l // 16 * 8 + s * 16)
            for nt in range({N // 8}):
                b0, b1 = ldsm_x2(sm, (8 * nt + l % 8) * 72 + (l // 8) % 2 * 8 + s * 16)
                acc[nt, 0], acc[nt, 1], acc[nt, 2], acc[nt, 3] = mma_f16(a0, a1, a2, a3, b0, b1, acc[nt, 0], acc[nt, 1], acc[nt, 2], acc[nt, 3])
    out[cuda.blockIdx.x * 128 + tid] = frag_total(acc)


@cuda.jit
def mma_speed(seed, iters, out):
    tid = uint32(cuda.threadIdx.x)
    x = uint32(seed + tid) * uint32(2654435761)
    a = cuda.local.array(16, uint32)
    b = cuda.local.array(64, uint32)
    for i in range(16):
        a[i] = (x >> uint32(i)) & uint32(0x3BFF3BFF)
    for i in range(64):
        b[i] = (x >> uint32(i % 13)) & uint32(0x3BFF3BFF)
    acc = cuda.local.array((8, 4), float32)
    frag_zero(acc)
    for it in range(iters):
        for s in range(4):
            for nt in range({N // 8}):
                acc[nt, 0], acc[nt, 1], acc[nt, 2], acc[nt, 3] = mma_f16(a[4 * s], a[4 * s + 1], a[4 * s + 2], a[4 * s + 3], b[16 * s + 2 * nt], b[16 * s + 2 * nt + 1], acc[nt, 0], acc[nt, 1], acc[nt, 2], acc[nt, 3])
    out[cuda.blockIdx.x * 128 + tid] = frag_total(acc)
'''
    exec(compile(src, "<wgmma_probe>", "exec"), ns)
    return ns["wg_check"], ns["wg_speed"], ns["mma_speed"], ns["wg_variants"], ns["mma_ldsm_speed"]


def main():
    wg_check, wg_speed, mma_speed, wg_variants, mma_ldsm_speed = build()
    rng = np.random.default_rng(0)
    A = rng.standard_normal((64, 16)).astype(np.float16)
    B = rng.standard_normal((16, N)).astype(np.float16)
    ref = A.astype(np.float64) @ B.astype(np.float64)
    rows = []
    for kmajor in (1, 0):
        if kmajor:
            lay_lbo, lay_sbo = 128, 256          # k-adjacent core matrices 128 B apart, n-adjacent 256 B
        else:
            lay_lbo, lay_sbo = 128 * (N // 8), 128   # n-adjacent 128 B apart, k-adjacent N/8 * 128 B
        for name, (lbo, sbo) in (("lbo=k-stride sbo=mn-stride", (lay_lbo, lay_sbo)),
                                 ("lbo=mn-stride sbo=k-stride", (lay_sbo, lay_lbo))):
            D = cuda.to_device(np.full((64, N), np.nan, np.float32))
            wg_check[1, 128](cuda.to_device(A.view(np.int16)), cuda.to_device(B.view(np.int16)), D,
                             kmajor, lbo, sbo, lay_lbo, lay_sbo)
            got = D.copy_to_host()
            err = float(np.nanmax(np.abs(got - ref)) / np.abs(ref).max()) if not np.isnan(got).all() else float("nan")
            rows.append(("K-major" if kmajor else "MN-major", name, err, bool(np.isnan(got).any())))
    for r in rows:
        print(f"check {r[0]:9s} {r[1]:28s} rel err {r[2]:.3e} nan {r[3]}")
    iters = 2000
    runs = [("wgmma m64n64k16 (A regs)", wg_speed, ()), ("mma.sync m16n8k16 (B regs)", mma_speed, ()),
            ("wgmma, A by ldmatrix", wg_variants, (0,)), ("wgmma SS (A by descriptor)", wg_variants, (1,)),
            ("wgmma, B MN-major", wg_variants, (2,)), ("mma.sync, A and B by ldmatrix", mma_ldsm_speed, ())]
    for blocks in (132 * 8, 132 * 2, 132):
        out = cuda.device_array(blocks * 128, np.float32)
        flops = 2 * 64 * 64 * N * iters * blocks
        for name, k, extra in runs:
            k[blocks, 128](1, 10, *extra, out)
            cuda.synchronize()
            s, e = cuda.event(), cuda.event()
            ts = []
            for _ in range(5):
                s.record(); k[blocks, 128](1, iters, *extra, out); e.record(); e.synchronize()
                ts.append(cuda.event_elapsed_time(s, e))
            ms = sorted(ts)[2]
            print(f"speed {blocks // 132} blocks/SM  {name:32s} {ms:8.3f} ms {flops / ms / 1e9:8.1f} TFLOP/s")
    try:
        sass = wg_speed.inspect_sass()
        sass = sass if isinstance(sass, str) else "\n".join(sass.values())
        print("HGMMA in SASS:", sass.count("HGMMA"), " HMMA:", sass.count("HMMA"))
    except Exception as exc:  # noqa: BLE001
        print("sass:", exc)


if __name__ == "__main__":
    main()
