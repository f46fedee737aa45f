"""Probe: forward + backward of the document mask with its block table through ``nc.torch_op``,
against FlexAttention with the block mask it would use, in one run on a GPU.

    NUMBA_ENABLE_CUDASIM=0 python kernels/probes/table_fwd_bwd.py [--dtype f16] [--compare]

f16, N = 4096, d = 64, B*H = 2 x 16 (the variant table's sizes and documents: ``kernels/variants.py``),
the op's defaults (``prefetch="auto"``, the backward form the cost model picks).  The backward's
dK, dV kernel streams the queries inside key tiles and skips the query chunks the table masks.
O, dQ, dK and dV are checked first against float64 autograd on 2 heads (``err``: max abs error /
max |ref|), then forward + backward is timed (CUDA events, median) with each kernel's CUDA time
(CUPTI).  ``--compare``: also the same op built with ``emit_loads.TRANSPOSED_FLAGS = False`` (the
dK, dV kernel visits every query chunk).  Prints a table last.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering import emit_loads  # noqa: E402
from bench import compiled_flex, cuda_time, device_ms  # noqa: E402
from variants import TABLE_BLOCK, _doc_ids  # noqa: E402

N, D, B, H = 4096, 64, 2, 16


def reference(Q, K, V, dO, keep, heads=2):
    q, k, v = (t[:, :heads].detach().double().requires_grad_() for t in (Q, K, V))
    S = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~keep, float("-inf"))
    O = torch.softmax(S, -1) @ v
    return (O, *torch.autograd.grad(O, (q, k, v), dO[:, :heads].double()))


def rel(a, b):
    return float((a.double() - b).abs().max() / b.abs().max())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="f16", choices=("f16", "bf16"))
    ap.add_argument("--compare", action="store_true")
    args = ap.parse_args()
    dt = {"f16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    doc = _doc_ids(N, gen).to("cuda")
    dd = nc.aux("doc", nc.Axis("n", N))
    doc_mask = nc.mask_mod(lambda b, h, i, j: (dd[i] == dd[j]) & (j <= i))
    nb = N // TABLE_BLOCK
    bt = nc.aux("bt", nc.Axis("rb", nb), nc.Axis("cb", nb))
    table = nc.block_table(doc_mask, N, N, TABLE_BLOCK, TABLE_BLOCK, {"doc": doc.float()})
    q, x, d, h, b = nc.axes("q x d h b")
    att = nc.library.attention(q=q, x=x, d=d, heads=h, batch=b, mask=nc.blocked(doc_mask, bt, TABLE_BLOCK, TABLE_BLOCK))
    op = nc.torch_op(att.stream(x, "s_x").tile(q, "g_q").tile(h, 1).tile(b, 1), verify=False)
    Q, K, V, dO = (torch.randn(B, H, N, D, device="cuda", generator=gen).to(dt) for _ in range(4))
    Q, K, V = (t.requires_grad_() for t in (Q, K, V))
    extra = (table.to("cuda", dt), doc.to(dt))
    O = op(Q, K, V, *extra)
    grads = torch.autograd.grad(O, (Q, K, V), dO)
    i = torch.arange(N, device="cuda")[:, None]
    j = torch.arange(N, device="cuda")[None, :]
    keep = (doc[i] == doc[j]) & (j <= i)
    want = reference(Q, K, V, dO, keep)
    errs = {n: rel(g[:, :2], w) for n, g, w in zip(("O", "dQ", "dK", "dV"), (O, *grads), want)}
    print("errors", errs, "paths", op.last_path, op.last_backward_path, flush=True)
    assert max(errs.values()) < 1e-2

    def ours():
        return torch.autograd.grad(op(Q, K, V, *extra), (Q, K, V), dO)

    from torch.nn.attention.flex_attention import create_block_mask
    bm = create_block_mask(lambda b_, h_, i_, j_: (doc[i_] == doc[j_]) & (j_ <= i_), None, None, N, N, device="cuda")
    flex = compiled_flex()

    def theirs():
        return torch.autograd.grad(flex(Q, K, V, block_mask=bm), (Q, K, V), dO)

    fo = flex(Q, K, V, block_mask=bm)
    fg = torch.autograd.grad(fo, (Q, K, V), dO)
    ferrs = {n: rel(g[:, :2], w) for n, g, w in zip(("O", "dQ", "dK", "dV"), (fo, *fg), want)}
    rows = [("napkin_cat (nc.torch_op)", cuda_time(ours), device_ms(ours), max(errs.values())),
            ("FlexAttention (compiled, block mask)", cuda_time(theirs), device_ms(theirs), max(ferrs.values()))]
    if args.compare:
        emit_loads.TRANSPOSED_FLAGS = False
        try:
            off = nc.torch_op(att.stream(x, "s_x").tile(q, "g_q").tile(h, 1).tile(b, 1), verify=False)
            og = torch.autograd.grad(off(Q, K, V, *extra), (Q, K, V), dO)    # lowered here, switch off
        finally:
            emit_loads.TRANSPOSED_FLAGS = True
        oerr = max(rel(g[:, :2], w) for g, w in zip(og, want[1:]))

        def without():
            return torch.autograd.grad(off(Q, K, V, *extra), (Q, K, V), dO)
        rows.insert(1, ("napkin_cat, dK, dV visiting every query chunk", cuda_time(without), device_ms(without), oerr))
    print(f"| forward + backward, {args.dtype}, N = {N}, d = {D}, B*H = {B * H}, document mask | ms (events) | kernel ms | err |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.3f} | {r[2]:.3f} | {r[3]:.1e} |")
    print(f"| ours / Flex | {rows[-1][1] / rows[0][1]:.2f}x | {rows[-1][2] / rows[0][2]:.2f}x | |")


if __name__ == "__main__":
    main()
