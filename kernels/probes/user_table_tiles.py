"""Probe: the forward of packed-document attention with the user's block table (``nc.blocked``,
128 x 128 blocks, FlexAttention's default) at N = 16384, d = 64, 16 heads, f16, at the blocks
``nc.lower`` chooses and at three given ones; each checked against float64 on two heads first,
then timed by CUPTI (every kernel of a call).  It found the head-width bug of
``wgmma_plan.computed_axes`` (kernels/BENCHMARKS.md).  GPU only.

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/user_table_tiles.py
"""
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "kernels", ROOT / "kernels" / "probes"):
    sys.path.insert(0, str(p))

import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
from bench import kernel_ms  # noqa: E402
from document_training import doc_ids  # noqa: E402


def main():
    N, H, D, TABLE = 16384, 16, 64, 128
    gen = torch.Generator().manual_seed(0)
    doc = doc_ids(N, gen).cuda()
    Q, K, V = (torch.randn(H, N, D, generator=gen).to("cuda", torch.float16) for _ in range(3))
    q, x, d, h = nc.axes("q x d h")
    dd = nc.aux("doc", nc.Axis("n", N))
    mask = nc.mask_mod(lambda b, hh, i, j: (dd[i] == dd[j]) & (j <= i))
    bt = nc.aux("bt", nc.Axis("rb", -(-N // TABLE)), nc.Axis("cb", -(-N // TABLE)))
    table = nc.block_table(mask, N, N, TABLE, TABLE, {"doc": doc.float()})
    docs = doc.float()
    keep = (doc[:, None] == doc[None, :]).tril()
    scores = [(Q[i].double() @ K[i].double().T / math.sqrt(D)).masked_fill(~keep, -math.inf) for i in range(2)]
    want = torch.stack([torch.softmax(s, -1) @ V[i].double() for i, s in enumerate(scores)])   # two heads, float64
    forms = ((None, None), ({"g_q": 128, "s_x": 64}, 128), ({"g_q": 128, "s_x": 64}, 256),
             ({"g_q": 128, "s_x": 128}, 256))
    for tiles, threads in forms:
        att = nc.library.attention(q=q, x=x, d=d, heads=h, mask=nc.blocked(mask, bt, TABLE, TABLE))
        op = nc.torch_op(att.stream(x, "s_x").tile(q, "g_q").tile(h, 1), verify=False, tiles=tiles, threads=threads)
        out = op(Q, K, V, table, docs)
        err = float((out[:2].double() - want).abs().max() / want.abs().max())
        ks = kernel_ms(lambda: op(Q, K, V, table, docs))
        kern = next(k for k in op._cache.values() if hasattr(k, "launch"))
        notes = [n for n in kern.notes if "Block sizes" in n or "Copying" in n]
        assert err < 5e-2, (tiles, threads, err)
        print(tiles, threads, f"err {err:.1e}", f"{sum(ks.values()):.3f} ms", kern.launch, notes, flush=True)


if __name__ == "__main__":
    main()
