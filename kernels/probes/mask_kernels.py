"""Probe: the fp16 attention kernels of three masks at the variant table's sizes (N = 4096,
d = 64, B*H = 32, q tiles of 128, chunks of 64, 4 warps), each run a few times, for a profiler:

    NUMBA_ENABLE_CUDASIM=0 ncu --kernel-name regex:kernel_ --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python kernels/probes/mask_kernels.py window

Masks: ``window`` (causal, 256 back), ``table`` (the document mask reading its block table),
``document`` (the document mask alone).  Prints each kernel's median time (CUDA events) after a
check against float64 on 64 rows of one head.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
from bench import cuda_time, rel_err  # noqa: E402
from variants import _doc_ids, _flex_reference  # noqa: E402

N, D, B, H = 4096, 64, 2, 16


def build(name: str, gen):
    n_ax = nc.Axis("n", N)
    doc = _doc_ids(N, gen).to("cuda")
    dd = nc.aux("doc", n_ax)
    doc_mask = nc.mask_mod(lambda b, h, i, j: (dd[i] == dd[j]) & (j <= i))
    aux = {"doc": doc.float()}
    if name == "window":
        mask = nc.mask_mod(lambda b, h, i, j: (j <= i) & (i - j <= 256))
        ref = lambda b, h, i, j: (j <= i) & (i - j <= 256)
        aux = {}
    elif name == "table":
        bt = nc.aux("bt", nc.Axis("rb", N // 128), nc.Axis("cb", N // 128))
        mask = nc.blocked(doc_mask, bt, 128, 128)
        aux["bt"] = nc.block_table(doc_mask, N, N, 128, 128, {"doc": doc.float()})
        ref = lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i)
    else:
        mask = doc_mask
        ref = lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i)
    q, x, d, h, b = nc.axes("q x d h b")
    dia = nc.library.attention(q=q, x=x, d=d, heads=h, batch=b, dtype=nc.f16, mask=mask).bind(
        {q: N, x: N, d: D, h: H, b: B})
    kernel = nc.lower(dia, tiles={"q": 128, "x": 64}, threads=128, prefetch=False, verify=False)
    extra = [aux[a.name].to(torch.float16).contiguous() for a in dia.dom[3:]]
    return kernel, extra, ref


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in sys.argv[1:] or ["window", "table", "document"]:
        kernel, extra, ref = build(name, gen)
        Q, K, V = (torch.randn(B, H, N, D, device="cuda", generator=gen).half() for _ in range(3))
        O = torch.full_like(Q, float("nan"))
        run = kernel.prepare(Q, K, V, *extra, out=O)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        rows = torch.randperm(N, device="cuda", generator=gen)[:64].sort().values
        err = rel_err(O[:, :1, rows], _flex_reference(Q, K, V, None, ref, rows, 1))
        print(f"{name}: err {err:.1e}  {cuda_time(run):.3f} ms  registers {kernel.compiled_info().get('registers')}",
              flush=True)


if __name__ == "__main__":
    main()
