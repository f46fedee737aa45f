"""Probe: forward + backward of packed-document attention through ``nc.torch_op``, the block
tables derived per launch (``lowering/tabled.py``) or passed by the user (``nc.blocked`` with
``nc.block_table`` made once), beside FlexAttention with its ``create_block_mask`` made once,
in one run.

The mask is written once, ``(doc[i] == doc[j]) & (j <= i)``, over 13 documents of random
lengths (multiples of 64) per sequence.  Every form's output and gradients are checked against
float64 on every head before it is timed (relative max error, as ``bench_fwd_bwd.py``).  Steady
times: back-to-back calls of ``torch.autograd.grad(op(...), (Q, K, V), dO)``.  The derived form
makes two tables (the forward's blocks and the backward's); it keeps them for an ids tensor it
has seen (the layers of one training step), and the second derived row passes a new tensor
each call, so it pays both tables every time.  One more row lowers the kept form with
``tma.TABLE_LOOPS`` off: the chunks a table keeps copied by ``cp.async``, not by TMA, as before
2026-12-01.
GPU only.

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/document_training.py [--n 4096] [--d 64] [--dtype f16]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from unittest import mock

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering import tma  # noqa: E402
from bench import compiled_flex, cuda_time, device_ms  # noqa: E402

TABLE = 128   # the user's table blocks (FlexAttention's default)
BEFORE = "derived tables kept, the kept chunks copied by cp.async (tma.TABLE_LOOPS off)"


def doc_ids(n: int, gen) -> torch.Tensor:
    cuts = torch.sort(torch.randperm(n // 64 - 1, generator=gen)[:12] + 1).values * 64
    ids = torch.zeros(n, dtype=torch.int64)
    ids[cuts] = 1
    return torch.cumsum(ids, 0)


def reference(Q, K, V, dO, doc):
    """float64 O, dQ, dK, dV, one head at a time."""
    outs = [[], [], [], []]
    keep = (doc[:, None] == doc[None, :]) & torch.ones(len(doc), len(doc), dtype=torch.bool, device=doc.device).tril()
    for hd in range(Q.shape[0]):
        q, k, v = (t[hd].double().requires_grad_() for t in (Q, K, V))
        s = (q @ k.T / math.sqrt(Q.shape[-1])).masked_fill(~keep, -math.inf)
        o = torch.softmax(s, -1) @ v
        grads = torch.autograd.grad(o, (q, k, v), dO[hd].double())
        for lst, t in zip(outs, (o.detach(), *grads)):
            lst.append(t)
    return [torch.stack(lst) for lst in outs]


def rel(a, b) -> float:
    return float((a.double() - b).abs().max() / b.abs().max())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dtype", default="f16", choices=("f16", "bf16"))
    args = ap.parse_args()
    N, D, H = args.n, args.d, args.heads
    dt = {"f16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    gen = torch.Generator().manual_seed(0)
    doc = doc_ids(N, gen).cuda()
    Q, K, V, dO = (torch.randn(H, N, D, generator=gen).to("cuda", dt) for _ in range(4))
    q, x, d, h = nc.axes("q x d h")
    dd = nc.aux("doc", nc.Axis("n", N))
    mask = nc.mask_mod(lambda b, hh, i, j: (dd[i] == dd[j]) & (j <= i))
    bt = nc.aux("bt", nc.Axis("rb", -(-N // TABLE)), nc.Axis("cb", -(-N // TABLE)))
    table = nc.block_table(mask, N, N, TABLE, TABLE, {"doc": doc.float()})   # float32: a mask compares it
    docs = doc.float()   # the ids: an f32 input, as nc.aux makes the values a mask compares

    def op_of(m):
        att = nc.library.attention(q=q, x=x, d=d, heads=h, mask=m)
        return nc.torch_op(att.stream(x, "s_x").tile(q, "g_q").tile(h, 1), verify=False)

    derived, given, before = op_of(mask), op_of(nc.blocked(mask, bt, TABLE, TABLE)), op_of(mask)
    flex = compiled_flex()
    from torch.nn.attention.flex_attention import create_block_mask
    bm = create_block_mask(lambda b, hh, i, j: (doc[i] == doc[j]) & (j <= i), None, None, N, N, device="cuda")
    q4, k4, v4, d4 = (t[None] for t in (Q, K, V, dO))
    forms = {
        "derived tables, kept for the ids tensor": lambda Q, K, V: derived(Q, K, V, docs),
        "derived tables, a new ids tensor each call": lambda Q, K, V: derived(Q, K, V, docs.clone()),
        BEFORE: lambda Q, K, V: before(Q, K, V, docs),
        "derived tables, int64 ids (kept; converted each call)": lambda Q, K, V: derived(Q, K, V, doc),
        f"user's table ({TABLE} x {TABLE}, made once)": lambda Q, K, V: given(Q, K, V, table, docs),
        "FlexAttention (block mask made once)": lambda Q, K, V: flex(Q[None], K[None], V[None], block_mask=bm)[0],
    }
    want = reference(Q, K, V, dO, doc)
    print(torch.cuda.get_device_name(0), torch.__version__, f"N={N} d={D} heads={H} {args.dtype}", flush=True)
    rows = []
    for name, f in forms.items():
        leaves = [t.detach().clone().requires_grad_() for t in (Q, K, V)]
        with mock.patch.object(tma, "TABLE_LOOPS", name != BEFORE):   # the kernels are lowered here, then kept
            out = f(*leaves)
            grads = torch.autograd.grad(out, leaves, dO)
        errs = [rel(a, b) for a, b in zip((out.detach(), *grads), want)]
        assert max(errs) < 5e-2, (name, errs)
        fwd = cuda_time(lambda: f(*leaves))
        step = cuda_time(lambda: torch.autograd.grad(f(*leaves), leaves, dO), inner=10)
        kernels = device_ms(lambda: torch.autograd.grad(f(*leaves), leaves, dO))   # every kernel, tables too
        rows.append((name, fwd, step, kernels, max(errs)))
        print(name, fwd, step, kernels, errs, flush=True)
    t_derive = cuda_time(lambda: nc.block_table(mask, N, N, 128, 64, {"doc": docs}))
    # host time of a derived call beside its kernel's (the forward kernel of the op, tables kept)
    import time
    # the forward's (Q, K, V and the ids; the backward's take more), or its first form where the op
    # chose between two at each call (lowering/tabled.py, TableChoice)
    tk = next(f for k in derived._cache.values() for f in getattr(k, "forms", (k,))
              if type(f).__name__ == "TabledKernel" and len(f.in_shapes) == 4)
    (tab,) = tk.derive(Q, K, V, docs)
    for what, f in (("derive (kept)", lambda: tk.derive(Q, K, V, docs)), ("inner kernel call", lambda: tk.inner(Q, K, V, docs, tab)),
                    ("tabled kernel call", lambda: tk(Q, K, V, docs))):
        f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            f()
        host = (time.perf_counter() - t0) / 200 * 1e3
        torch.cuda.synchronize()
        print(f"host per call, {what}: {host * 1e3:.1f} us", flush=True)
    from napkin_cat.lowering.table_kernel import make_table
    t_kernel = cuda_time(lambda: make_table(tk.tables[0], (Q, K, V, docs)))
    t_flex_mask = cuda_time(lambda: create_block_mask(lambda b, hh, i, j: (doc[i] == doc[j]) & (j <= i), None, None,
                                                      N, N, device="cuda"))
    flex_step, flex_kernels = rows[-1][2], rows[-1][3]
    print(f"\none table over 128 x 64 blocks: {t_derive:.3f} ms by torch operations, {t_kernel:.3f} ms by the generated "
          f"table kernel; FlexAttention's create_block_mask: {t_flex_mask:.3f} ms")
    print("\n| form | forward ms | forward + backward ms (steady) | vs Flex | kernels ms (CUPTI) | vs Flex "
          "| max rel err (O, dQ, dK, dV) |")
    print("|---|---|---|---|---|---|---|")
    for name, fwd, step, kernels, err in rows:
        print(f"| {name} | {fwd:.3f} | {step:.3f} | {flex_step / step:.2f}x | {kernels:.3f} | "
              f"{flex_kernels / kernels:.2f}x | {err:.1e} |")


if __name__ == "__main__":
    main()
