"""Probe: where forward + backward of packed-document attention spends its device time, kernel by
kernel (CUPTI, ``bench.kernel_ms``), for the derived-table op of ``document_training.py`` in a few
forms beside FlexAttention's kernels, in one run: the default op; its backward as two kernels
(FlashAttention-2's, no dQ atomics); the ids loaded whole into each block (``AUX_WHOLE_BYTES``
raised past them) instead of read in place; each element of a chunk testing its mask's flag
(``unswitch.UNSWITCH`` off); the rows of a warpgroup MMA's A from registers (``wgmma.SHARED_A``
off); each warpgroup contraction waited for before the next is issued (``issue_ahead.ISSUE_AHEAD``
off); a partial chunk's elements written once, comparing the block table's entry in each
(``unswitch.ATOM_VERSIONS = 0``; ``--only-tiles`` keeps these two beside the default).  Every
form is checked against float64 first.  GPU only.

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/document_breakdown.py [--n 16384] [--heads 16]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from unittest import mock

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))
sys.path.insert(0, str(ROOT / "kernels" / "probes"))

import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering import issue_ahead, unswitch, wgmma  # noqa: E402
from napkin_cat.relabel import loopnest  # noqa: E402
from bench import compiled_flex, kernel_ms, profile_once  # noqa: E402
from document_training import doc_ids, reference, rel  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tiles", nargs="*", default=[], help='more forms, the blocks given: "g_x=128,s_q=128" ...')
    ap.add_argument("--only-tiles", action="store_true",
                    help="the default form, the --tiles forms, the UNSWITCH and SHARED_A off forms and Flex only")
    ap.add_argument("--ncu", action="store_true", help="no timing: one call of each form and of Flex between "
                    "cudaProfilerStart and Stop, for `ncu --profile-from-start off`")
    args = ap.parse_args()
    N, D, H = args.n, args.d, args.heads
    gen = torch.Generator().manual_seed(0)
    doc = doc_ids(N, gen).cuda()
    Q, K, V, dO = (torch.randn(H, N, D, generator=gen).to("cuda", torch.float16) for _ in range(4))
    q, x, d, h = nc.axes("q x d h")
    dd = nc.aux("doc", nc.Axis("n", N))
    mask = nc.mask_mod(lambda b, hh, i, j: (dd[i] == dd[j]) & (j <= i))
    docs = doc.float()

    def op_of(**kw):
        att = nc.library.attention(q=q, x=x, d=d, heads=h, mask=mask)
        return nc.torch_op(att.stream(x, "s_x").tile(q, "g_q").tile(h, 1), verify=False, **kw)

    flex = compiled_flex()
    from torch.nn.attention.flex_attention import create_block_mask
    bm = create_block_mask(lambda b, hh, i, j: (doc[i] == doc[j]) & (j <= i), None, None, N, N, device="cuda")
    # each form: its op and the settings it is planned and compiled under (at its first call)
    ops = {"default (one kernel)": (op_of(), ()), "two-kernel backward": (op_of(backward="two kernels"), ()),
           "ids whole in each block": (op_of(), ((loopnest, "AUX_WHOLE_BYTES", 4 * N),)),
           "masks tested in each element (unswitch.UNSWITCH off)": (op_of(), ((unswitch, "UNSWITCH", False),)),
           "A from registers (wgmma.SHARED_A off)": (op_of(), ((wgmma, "SHARED_A", False),)),
           "each contraction waited for before the next (issue_ahead.ISSUE_AHEAD off)":
               (op_of(), ((issue_ahead, "ISSUE_AHEAD", False),)),
           "one partial version, the table compared in each element (unswitch.ATOM_VERSIONS = 0)":
               (op_of(), ((unswitch, "ATOM_VERSIONS", 0),))}
    for spec in args.tiles:      # "g_x=128,s_q=128": the backward's blocks given
        blocks = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
        ops[f"backward blocks {spec}"] = (op_of(tiles=blocks), ())
    if args.only_tiles:
        ops = {k: v for k, v in ops.items() if k.startswith(("default", "backward blocks", "each contraction", "one partial"))}
    want = reference(Q, K, V, dO, doc)
    print(torch.cuda.get_device_name(0), torch.__version__, f"N={N} d={D} heads={H} f16", flush=True)
    rows = {}
    for name, (op, settings) in ops.items():
        f = (lambda op: lambda *t: op(*t, docs))(op)
        leaves = [t.detach().clone().requires_grad_() for t in (Q, K, V)]
        with contextlib.ExitStack() as stack:
            for module, attr, value in settings:
                stack.enter_context(mock.patch.object(module, attr, value))
            out = f(*leaves)
            grads = torch.autograd.grad(out, leaves, dO)
        errs = [rel(a, b) for a, b in zip((out.detach(), *grads), want)]
        assert max(errs) < 5e-2, (name, errs)
        rows[name] = (lambda f, leaves: lambda: torch.autograd.grad(f(*leaves), leaves, dO))(f, leaves)
    leaves = [t.detach().clone().requires_grad_() for t in (Q, K, V)]
    fl = lambda *t: flex(*(a[None] for a in t), block_mask=bm)[0]
    errs = [rel(a, b) for a, b in zip((fl(*leaves).detach(), *torch.autograd.grad(fl(*leaves), leaves, dO)), want)]
    assert max(errs) < 5e-2, errs
    rows["FlexAttention"] = lambda: torch.autograd.grad(fl(*leaves), leaves, dO)
    if args.ncu:
        return profile_once(rows)
    rows = {name: kernel_ms(call) for name, call in rows.items()}
    for name, ks in rows.items():
        print(f"\n{name}: {sum(ks.values()):.3f} ms of kernels")
        for k, ms in sorted(ks.items(), key=lambda kv: -kv[1])[:8]:
            print(f"  {ms:8.3f}  {k[:110]}")


if __name__ == "__main__":
    main()
