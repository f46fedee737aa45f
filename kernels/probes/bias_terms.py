"""Probe: what the relative bias's per-score instructions cost in the 16-bit forward (issue 11).

FlexAttention's relative bias ``s + (i - j) * 0.01`` costs it 6% over its dense kernel; the
generated d = 64 forward paid 17% (0.41 against 0.35 ms on an H200).  Per score the generated
kernel runs ``S * scale`` (FMUL), ``f_row - f_col`` (FADD) and ``* 0.01 +`` (FFMA) where the dense
kernel folds the scale into the exponent.  This probe edits the generated forward's text (a
measurement, not the generator) into two cheaper forms and times them beside the bias as written
(``row_terms.SWITCH = False``), the generator's form, the dense kernel and FlexAttention, in the
same run, each checked against float64 first:

- ``hoisted``: the bias split into its row and column terms, ``i * 0.01`` once per row and
  ``j * 0.01`` once per column (``(i - j) c = i c - j c``, a rounding change only): FADD + FFMA a score;
- ``rowless``: the row term dropped (softmax over j does not see a term of i alone: O is
  unchanged, the logsumexp would carry ``i * 0.01``): one FFMA a score.  Measured 0.376 against
  0.408 ms; the generator now derives this form (``relabel/row_terms.py``).

``--fwd-bwd``: forward + backward of the relative bias through ``nc.torch_op`` (f16, N = 4096,
d = 64, 32 heads), its row term dropped by the generator (``relabel/row_terms.py``) and computed as
written (``row_terms.SWITCH = False``), beside FlexAttention with the same ``score_mod``; O, dQ,
dK, dV checked against float64 first.

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/bias_terms.py [--fwd-bwd]
"""
from __future__ import annotations

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
import variants  # noqa: E402
from bench_fwd_bwd import rel  # noqa: E402
from napkin_cat.relabel import row_terms  # noqa: E402
from probes.forward_stages import edited  # noqa: E402
from probes.op_forms import case_args, timed_table  # noqa: E402

BIAS_LINE = "S_5 = S_4 + ((f_row - float32(uint32(x0 + i_x2))) * F_0_01)"
EDITS = {
    "hoisted": "S_5 = S_regs[i, j] * C_SCALE + (f_row * F_0_01 - float32(uint32(x0 + i_x2)) * F_0_01)",
    "rowless": "S_5 = S_regs[i, j] * C_SCALE - float32(uint32(x0 + i_x2)) * F_0_01",
}


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    specs = variants.flex_variants(gen)
    lower, rows = nc.lower, []
    forms = [("dense", "dense", True, None), ("relative_bias (generated: row term dropped)", "relative_bias", True, None),
             ("relative_bias (as written)", "relative_bias", False, None),
             *((f"relative_bias (as written, {e})", "relative_bias", False, e) for e in EDITS)]
    for label, name, switch, edit in forms:
        def patched(*a, **k):
            kernel = lower(*a, **k)
            if edit is None:
                return kernel
            assert kernel.source.count(BIAS_LINE) == 1, "the generated bias line"
            return edited(kernel, kernel.source.replace(BIAS_LINE, EDITS[edit]))
        nc.lower, row_terms.SWITCH = patched, switch
        try:
            r = variants.flex_variant(name, specs[name], gen, dt="f16")
        finally:
            nc.lower, row_terms.SWITCH = lower, True
        rows.append((label, r))
        print(label, r["kernel_ms"], r["flex_kernel_ms"], r["rel_err"], flush=True)
    print("\n| form | blocks | kernel ms | Flex kernel ms | vs Flex | error |")
    print("|---|---|---|---|---|---|")
    for label, r in rows:
        print(f"| {label} | {r['tiles']['q']} x {r['tiles']['x']}, {r['threads']} | {r['kernel_ms']:.3f} | "
              f"{r['flex_kernel_ms']:.3f} | {r['flex_kernel_ms'] / r['kernel_ms']:.2f}x | {r['rel_err']:.1e} |")


def rel_bias(s, b, h, i, j):
    return s + (i - j) * 0.01


def _reference(Q, K, V, dO, chunk=4):
    """float64 O, dQ, dK, dV of the relative bias's attention, ``chunk`` heads at a time."""
    outs = [[], [], [], []]
    n = Q.shape[-2]
    bias = (torch.arange(n, device="cuda")[:, None] - torch.arange(n, device="cuda")[None, :]).double() * 0.01
    for s in range(0, Q.shape[0], chunk):
        q, k, v = (t[s:s + chunk].detach().double().requires_grad_() for t in (Q, K, V))
        o = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(Q.shape[-1]) + bias, -1) @ v
        for lst, t in zip(outs, (o.detach(),) + torch.autograd.grad(o, (q, k, v), dO[s:s + chunk].double())):
            lst.append(t)
    return [torch.cat(o) for o in outs]


def fwd_bwd(args):
    from torch.nn.attention.flex_attention import flex_attention
    torch._dynamo.config.cache_size_limit = 256
    g = torch.Generator(device="cuda").manual_seed(0)
    Q, K, V, dO = (torch.randn(args.bh, 4096, 64, device="cuda", generator=g).half() for _ in range(4))
    Q, K, V = (t.requires_grad_() for t in (Q, K, V))
    want = _reference(Q, K, V, dO)
    q, x, d, h = nc.axes("q x d h")
    flash = nc.library.attention(q=q, x=x, d=d, heads=h, score_mod=rel_bias).stream(x, "s_x").tile(q, "g_q").tile(h, 1)
    fns = {}
    for name, switch in (("row term dropped", True), ("as written", False)):
        row_terms.SWITCH = switch    # read where the op is made and where its kernels are lowered (first call)
        try:
            op = nc.torch_op(flash, verify=False)
            O = op(Q, K, V)
            err = max(rel(a, b) for a, b in zip((O.detach(),) + torch.autograd.grad(O, (Q, K, V), dO), want))
        finally:
            row_terms.SWITCH = True
        print(f"{name}: {len(op.rewrites)} rewrite(s); error against float64 {err:.2e}", flush=True)
        for k in op._cache.values():   # registers and spills of each kernel the op lowered
            if hasattr(k, "compiled_info"):
                print(f"  {getattr(k, 'name', type(k).__name__)}: {k.compiled_info()}", flush=True)
        assert err < 5e-3, (name, err)
        fns[name] = lambda op=op: torch.autograd.grad(op(Q, K, V), (Q, K, V), dO)
    flex = torch.compile(flex_attention, dynamic=False)
    q4, k4, v4 = (t.detach().unsqueeze(0).requires_grad_() for t in (Q, K, V))
    fo = flex(q4, k4, v4, score_mod=rel_bias)
    print(f"FlexAttention: error against float64 {rel(fo[0].detach(), want[0]):.2e}", flush=True)
    fns["FlexAttention"] = lambda: torch.autograd.grad(flex(q4, k4, v4, score_mod=rel_bias), (q4, k4, v4), dO.unsqueeze(0))
    del want
    timed_table(fns, args, f"\nrelative bias, f16, N = 4096, d = 64, B*H = {args.bh}, forward + backward, {args.rounds} "
                           f"rounds in turns, {args.steady} calls each, median ms; then the three longest kernels (CUPTI):")

if __name__ == "__main__":
    ap = case_args(rounds=9)
    ap.add_argument("--fwd-bwd", action="store_true")
    a = ap.parse_args()
    fwd_bwd(a) if a.fwd_bwd else main()
