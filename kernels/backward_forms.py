"""FlashAttention's backward: one kernel (dQ added across key tiles with fp32 atomics) against two
kernels (dK, dV with keys tiled; dQ with queries tiled), as the cost model counts them.

    NUMBA_ENABLE_CUDASIM=1 python kernels/backward_forms.py

CPU only: symbolic costs of the three relabelled diagrams from ``nc.grad_with_residuals``, then
at N = 4096, d = 64, H = 16 with 64-wide tiles and chunks; the roofline time on an H100 and an
H200.  ``proofs/test_backward_forms.py`` checks the derived numbers; nothing here is measured.
"""
import os
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sympy as sp  # noqa: E402

import napkin_cat as nc  # noqa: E402

q, x, d, h = nc.axes("q x d h")
N, D, H, BLOCK = 4096, 64, 16, 64
fwd = nc.library.attention(q=q, x=x, d=d, heads=h, logsumexp=True)
FORMS = {
    "one kernel: dQ, dK, dV (atomics)": (
        nc.grad_with_residuals(fwd, wrt=["Q", "K", "V"]).tile(x, "g_x", partial="sum").stream(q, "s_q").tile(h, 1),
        {"g_x": BLOCK, "s_q": BLOCK}),
    "kernel 1 of 2: dK, dV": (
        nc.grad_with_residuals(fwd, wrt=["K", "V"]).tile(x, "g_x").stream(q, "s_q").tile(h, 1),
        {"g_x": BLOCK, "s_q": BLOCK}),
    "kernel 2 of 2: dQ": (
        nc.grad_with_residuals(fwd, wrt=["Q"]).tile(q, "g_q").stream(x, "s_x").tile(h, 1),
        {"g_q": BLOCK, "s_x": BLOCK}),
}
SIZES = {q: N, x: N, d: D, h: H}


def _atomic_bytes(c):
    """HBM bytes of the read-modify-writes of outputs added across blocks and their zero-fill."""
    return sp.expand(sum((m.values * m.dtype.bytes for m in c.moves
                          if m.kind in ("atomic read", "atomic write", "zero-fill")), sp.Integer(0)))


def main():
    print(f"FlashAttention backward, fp32, N = {N}, d = {D}, H = {H}, tiles and chunks of {BLOCK}\n")
    rows = {}
    for name, (dia, blocks) in FORMS.items():
        c = nc.cost(dia)
        at = c.subs({**SIZES, **blocks})
        rows[name] = dict(
            tensor=sp.expand(c.flops["tensor"]), hbm=sp.expand(c.bytes("HBM")), atomics=_atomic_bytes(c),
            tflops=float(at.flops["tensor"]) / 1e9, hbm_mb=float(at.bytes("HBM")) / 2 ** 20,
            atomics_mb=float(_atomic_bytes(at)) / 2 ** 20, smem_mb=float(at.bytes("SMEM")) / 2 ** 20,
            smem_kb=float(at.memory_bytes("SMEM")) / 1024,
            h100=c.time(nc.hardware.H100, {**SIZES, **blocks}).seconds * 1e6,
            h200=c.time(nc.hardware.H200, {**SIZES, **blocks}).seconds * 1e6)
    for name, r in rows.items():
        print(f"{name}\n  tensor FLOPs     {r['tensor']}\n  HBM bytes        {r['hbm']}\n"
              f"  atomics (bytes)  {r['atomics']}")
    print("\n| form | tensor GFLOP | HBM MiB | of which atomics + zero-fill MiB | SMEM traffic MiB "
          "| SMEM per block KiB | H100 roofline us | H200 roofline us |")
    print("|---|---|---|---|---|---|---|---|")
    names = list(rows)
    two = {k: rows[names[1]][k] + rows[names[2]][k] for k in ("tflops", "hbm_mb", "atomics_mb", "smem_mb", "h100", "h200")}
    two["smem_kb"] = max(rows[names[1]]["smem_kb"], rows[names[2]]["smem_kb"])
    for name, r in [*rows.items(), ("two kernels together", two)]:
        print(f"| {name} | {r['tflops']:.1f} | {r['hbm_mb']:.0f} | {r['atomics_mb']:.0f} | {r['smem_mb']:.0f} "
              f"| {r['smem_kb']:.0f} | {r['h100']:.0f} | {r['h200']:.0f} |")
    one = rows[names[0]]
    faster = "one kernel" if one["h100"] < two["h100"] else "two kernels"
    print(f"\nPredicted: {faster} ({one['h100']:.0f} us against {two['h100']:.0f} us on an H100): both are "
          f"compute-bound, and the one kernel does {one['tflops'] / two['tflops']:.2f}x the tensor FLOPs "
          f"(10 against 14 per d q x).  Not measured here.")


if __name__ == "__main__":
    main()
