"""The kernel fuzzer, continued: generator paths that only diagrams of their own reach.

The families of :mod:`test_kernel_fuzz` do not build these, so each has one here, run the same
way (random relabelling, ragged sizes of several chunks, non-power-of-two blocks where the rules
allow them, ``threads``, a data regime; a ``LoweringError`` is counted, a wrong kernel fails)
and asserted by name to reach its path (:func:`test_kernel_fuzz._features`):

* ``reindex``: convolutions (1-d, 2-d; stride, padding, dilation, groups, transposed, batch),
  the flat-head GQA attention (a split and a merge of the head axis) and a slice / pad / rename /
  split / merge chain, read through their index maps inside the consumer kernel
  (:mod:`napkin_cat.lowering.reindex`: ``reindex``, ``reindex-predicate`` where the map can leave
  the input); or, lowered for a device whose block holds less shared memory than the input,
  cut into kernels (:mod:`napkin_cat.lowering.multi`) where the unfolds become a ``gather-kernel``
  (:mod:`napkin_cat.lowering.gather`);
* ``split_reduction``: ``tile(axis, size, partial="sum")`` of split-K matmul, of a summing
  reduction and of the one-kernel attention backward: blocks add their partial sums with
  ``atomic`` adds (:mod:`napkin_cat.lowering.atomics`);
* ``logsumexp``: attention with its logsumexp output, streamed with the scores in registers:
  the logsumexp is read from the online softmax's row statistics (``lse-from-stats``,
  :attr:`napkin_cat.lowering.plan.AccPlan.stats_of`);
* ``sixteen_bit``: f16 / bf16 FlashAttention-2 backward parts and MLPs on simulated tensor
  cores, whose dS or hidden layer is a ``16-bit-operand`` shared buffer read by ldmatrix
  (:mod:`napkin_cat.lowering.sixteen_bit`); backward inputs are residuals the forward produced;
  a document mask with its block table, whose partial chunks are written once per value of the
  table entry they read where the block lies inside one table block (``table-versions``,
  :func:`napkin_cat.lowering.unswitch._by_value`);
  the backward's ``dP`` (and ``P``) read by dS's epilogue from registers (``register-copy``,
  :mod:`napkin_cat.lowering.register_copies`); ``P`` and ``dS`` read by the dV, dK and dQ updates
  as tensor-core A fragments from the registers that computed them (``frag-operand``,
  :mod:`napkin_cat.lowering.frag_operands`), and the one-kernel backward, whose dQ reads dS
  transposed from its 16-bit buffer; the fp32 ``L`` and ``D`` copied by ``cp.async`` beside the
  16-bit inputs (``cp.async-f32``), with or without ``prefetch="auto"``'s double buffers; the one
  kernel's dQ fragments added across key tiles two adjacent words per reduction (``paired-atomic``,
  ``tensorcore.red_add2``); ``L`` and ``D`` read once per fragment column where queries are the
  columns (``column-values``, :func:`napkin_cat.lowering.column_values.column_value`); 16-bit
  intermediates stored a fragment column pair per word (``paired-store``,
  :mod:`napkin_cat.lowering.paired_stores`), and 16-bit outputs to global memory alike
  (``paired-global``, :func:`napkin_cat.lowering.paired_stores.global_pair`);
* ``tf32x3``: fp32 backward parts on 3xTF32 fragments (``tf32x3``), the one kernel with its dQ
  atomics among them (``tf32x3-atomic``), with or without ``prefetch="auto"``'s double buffers
  (``double-buffered``: staged through registers where an fp32 input's rows are not whole 16-byte
  groups, else by ``cp.async``, ``cp.async-f32``); ``column-values`` as above.
* ``table_reads``: a document mask reading the user's block table, whose tiles and chunks lie
  inside one table block, span a few read one by one (``table-entries``), span blocks that each
  warp's rows or columns lie inside (``warp-entries``, :func:`napkin_cat.lowering.unswitch._warp_entries`)
  or span blocks read in loops (``table-loops``), :mod:`napkin_cat.lowering.emit_tables`; the
  forward, or the backward's dK, dV part (the fragments' rows the mask's columns);
* ``derived_table``: masks that read data with no table of the user's, their block tables derived
  from the inputs at each launch (``derived-table``, :mod:`napkin_cat.lowering.tabled`), a table
  of each sequence read where a block holds one (``batch-table``);
* ``copying``: the f16 / bf16 one-kernel backward on two warpgroups with a copying warpgroup
  (:mod:`napkin_cat.lowering.producer`), each example lowered with chunks handed over by named
  barriers and by block barriers (``named-hand-over``, ``block-hand-over``), dS published among
  the computing threads alone (``computing-barrier``); the same backward and the forward under a
  block table of random entries, whose masked chunks both sides skip (``copying-table``);
* ``copying_forward``: the forward with a copying warpgroup over three chunk buffers
  (``three-buffers``), with a block table or without (``three-buffers-table``);
* ``copying_tma``: that forward at head widths of 64 and 128, its chunks copied by the tensor
  memory accelerator into swizzled panels (``tma``, :mod:`napkin_cat.lowering.tma`), also those a
  block table keeps (``tma-table``).

``HYPOTHESIS_PROFILE`` selects the budget as in :mod:`test_kernel_fuzz`.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from typing import Callable, NamedTuple

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import assume, given, note, settings, strategies as st  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.core import Axis  # noqa: E402
from napkin_cat.ops import Builder, merge_box, slice_box, split_box  # noqa: E402
from napkin_cat.verify import kernelcheck  # noqa: E402
from napkin_cat.lowering import column_values, staged_add  # noqa: E402
from napkin_cat.verify.check import REGIMES  # noqa: E402
from test_kernel_fuzz import (FUZZ_EXAMPLES, MICRO, PREFETCH, REGIME_NAMES, SETTINGS, THREADS,  # noqa: E402
                              _features, _unary_chain, hand_over, module_setting, planner_switches)

q, x, d, e, g, h, bb = nc.axes("q x d e g h bb")
a, b, c, r, t, f = nc.axes("a b c r t f")
L = nc.library


class Case(NamedTuple):
    """One drawn example: ``base`` relabelled by ``steps`` (``("split", axis, size)`` is
    ``tile(axis, size, partial="sum")``), both bound at ``sizes``; ``oracle`` (unbound) is what
    the kernel must compute; ``options`` go to ``nc.lower``; ``inputs(rng, regime)`` draws the
    oracle's inputs where the regime's generator alone would not do (residuals), in one of
    ``regimes``."""
    label: str
    base: nc.Diagram
    steps: tuple
    sizes: dict
    oracle: nc.Diagram
    options: dict
    inputs: Callable | None = None
    regimes: tuple = REGIME_NAMES


# the regimes of backward and 16-bit examples.  Larger data is left out: in a backward's
# dS = P * (dP - D) with one key (x = 1) dP and D are the same sum, which NumPy's fp32 evaluation
# cancels exactly and a kernel summing in another order may not: on 'jumps', one ulp of dP
# (2e-6) times K / sqrt(d) (23) is more than the check allows next to an fp32 oracle of exactly
# 0 (a rounding, not a wrong kernel).  A 16-bit kernel's products must also stay in its range.
SMALL_DATA = ("normal", "repeated")


def _ragged(draw, label: str, block: int | None, top: int = 9) -> int:
    """A size that is often not a multiple of ``block``, and often several blocks."""
    if block is None:
        return draw(st.integers(1, top), label=label)
    top = max(top, min(6 * block - 1, 20))
    return draw(st.one_of(st.integers(1, top), st.integers(min(3 * block + 1, top), top)), label=label)


def _apply(diagram, steps):
    for op, what, arg in steps:
        diagram = diagram.tile(what, arg, partial="sum") if op == "split" else getattr(diagram, op)(what, arg)
    return diagram


def _blocks(draw, dt, top: int) -> tuple[int, int, dict]:
    """(query tile, key chunk, ``lower`` options): fp32 tiles and chunks of 1 to ``top`` with
    drawn threads, micro-tiles and prefetch; 16-bit ones of 16 (tensor cores) on 32 or 64 threads."""
    if dt == nc.f32:
        tq, tx = (draw(st.integers(1, top), label=lbl) for lbl in ("tile q", "chunk x"))
        return tq, tx, _fp32_options(draw)
    return 16, 16, {"threads": draw(st.sampled_from((32, 64)), label="threads")}


def _fp32_options(draw) -> dict:
    return {"threads": draw(st.sampled_from(THREADS), label="threads"),
            "micro": draw(st.sampled_from(MICRO), label="micro"),
            "prefetch": draw(st.sampled_from(PREFETCH), label="prefetch")}


# --------------------------------------------------------------------------- index maps, gathers

TIGHT_SMEM = (1024, 1536, 2048)   # bytes per block of a device on which a whole input does not fit


@st.composite
def _conv(draw, tight: bool):
    """A convolution with every size concrete; ``tight``: an input of more than 2 KB."""
    dim = draw(st.sampled_from((1, 2)))
    transposed = draw(st.booleans())
    groups = draw(st.sampled_from((1, 1, 2)))
    ci, co = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    k = draw(st.integers(1, 3))
    stride, dilation = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    padding = draw(st.integers(0, 1 if transposed else 2))
    op = draw(st.integers(0, max(stride, dilation) - 1)) if transposed else 0
    low = max(1, dilation * (k - 1) + 1 - 2 * padding)
    per = 2048 // (4 * ci) + 1     # positions per channel for an input over the largest TIGHT_SMEM
    if not tight:
        spatial = [draw(st.integers(low, 11 if dim == 1 else 7)) for _ in range(dim)]
    elif dim == 1:
        spatial = [draw(st.integers(max(low, per), per + 30))]
    else:
        w = draw(st.integers(max(low, 7), 12))
        spatial = [max(draw(st.integers(max(low, 7), 12)), -(-per // w)), w]
    kw = dict(stride=stride, dilation=dilation, padding=padding, groups=groups, transposed=transposed,
              output_padding=op, bias=draw(st.booleans()))
    if not tight and draw(st.integers(0, 3)) == 0:
        kw["batch"] = Axis("n", draw(st.integers(1, 3)))
    label = f"conv{dim}d({ci}, {co}, {spatial}, {k}, {kw})"
    try:
        diagram = L.conv1d(ci, co, spatial[0], k, **kw) if dim == 1 else L.conv2d(ci, co, *spatial, k, **kw)
    except nc.NapkinError:
        assume(False)
    # with groups, o is merged from (g, og) after the contraction, and c split (reindexed) before it
    tileable = [ax.name for ax in diagram.cod[0].axes if groups == 1 or ax.name != "o"]
    streamable = ([] if groups > 1 else ["c"]) + (["k"] if dim == 1 else ["kh", "kw"])
    return label, diagram, tileable, streamable


def _flat_gqa(nq, nx, nd, nkh, ng):
    """Attention with the query heads flat (``hq = kh * g``): a split before, a merge after."""
    from napkin_cat.library.compose import call
    qq, xx, dd, kh, gg, hq = (Axis("q", nq), Axis("x", nx), Axis("d", nd), Axis("kh", nkh), Axis("g", ng),
                              Axis("hq", nkh * ng))
    att = L.attention(q=qq, x=xx, d=dd, heads=kh, groups=gg)
    bld = Builder()
    Q, K, V = bld.input("Q", hq, qq, dd), bld.input("K", kh, xx, dd), bld.input("V", kh, xx, dd)
    (O,) = call(bld, att, bld.box(split_box(bld.ty(Q), hq, kh, gg), Q), K, V)
    return bld.diagram(bld.box(merge_box(bld.ty(O), kh, gg, hq), O), names=["O"])


def _reshapes(na, nb, nc_, lo, hi, before):
    """Slice rows ``lo..hi-1``, pad ``b`` (``before`` zeros in front), rename, split and merge
    its padded axis, then contract."""
    nbb = nb + before + 1
    inner = next(m for m in (3, 2, 1) if nbb % m == 0)
    aa, bx, cc, a2, b2, bbb, hi_, lo_ = (Axis("a", na), Axis("b", nb), Axis("c", nc_), Axis("a2", hi - lo),
                                         Axis("b2", nbb), Axis("bb", nbb), Axis("hi", nbb // inner),
                                         Axis("lo", inner))
    bld = Builder()
    X, W = bld.input("X", aa, bx), bld.input("W", bbb, cc)
    S = bld.box(slice_box(bld.ty(X), aa, lo, hi, a2), X)
    P = bld.unfold(S, bx, b2, offset=-before)
    R = bld.rename(P, b2, bbb)
    T = bld.box(split_box(bld.ty(R), bbb, hi_, lo_), R)
    M = bld.box(merge_box(bld.ty(T), hi_, lo_, bbb), T)
    return bld.diagram(bld.contract(M, W, out=(a2, cc), name="Y"))


@st.composite
def reindex_family(draw):
    """Reindexings in front of a contraction, in one kernel (relabelled: output axes tiled, a
    summed axis streamed) or, on a device with little shared memory, as the cut finds them."""
    kind = draw(st.sampled_from(("conv", "conv", "conv", "flat_gqa", "reshapes")))
    tight = draw(st.booleans())
    if kind == "conv":
        label, diagram, tileable, streamable = draw(_conv(tight))
    elif kind == "flat_gqa":
        sizes = [draw(st.integers(1, n), label=name) for n, name in ((9, "q"), (9, "x"), (4, "d"), (2, "kh"),
                                                                      (3, "g"))]
        label, diagram = f"flat-head gqa({sizes})", _flat_gqa(*sizes)
        tileable, streamable = ["q"], ["x"]   # hq is merged after the attention, d is also contracted
    else:
        na, nb = draw(st.integers(2, 40 if tight else 9)), draw(st.integers(1, 40 if tight else 9))
        lo = draw(st.integers(0, na - 1))
        hi = draw(st.integers(lo + 1, na))
        before = draw(st.integers(0, 3))
        args = (na, nb, draw(st.integers(1, 5)), lo, hi, before)
        label, diagram = f"reshapes{args}", _reshapes(*args)
        tileable, streamable = ["a2", "c"], []   # bb, the contracted axis, is reindexed
    options = {"threads": draw(st.sampled_from(THREADS), label="threads")}
    if tight:
        smem = draw(st.sampled_from(TIGHT_SMEM), label="smem")
        options["hw"] = dataclasses.replace(nc.hardware.H100, smem_per_block_optin=smem)
        return Case(f"{label} with {smem} B of shared memory", diagram, (), {}, diagram, options)
    size = {ax.name: ax.size for ax in diagram.axes}
    steps = [("tile", n, draw(st.integers(1, min(7, size[n])))) for n in tileable if draw(st.booleans())]
    if streamable and draw(st.booleans()):
        n = draw(st.sampled_from(streamable))
        steps.append(("stream", n, draw(st.integers(1, min(5, size[n])))))
    options.update(micro=draw(st.sampled_from(MICRO), label="micro"),
                   prefetch=draw(st.sampled_from(PREFETCH), label="prefetch"))
    return Case(label, diagram, tuple(steps), {}, diagram, options)


# --------------------------------------------------------------------------- split reductions

def _padding_shows(draw, bld, w):
    """``w`` through random elementwise maps, most often ending in one that is not 0 at 0: the
    zero padding of a ragged tile then has values that a sum must leave out."""
    w = _unary_chain(draw, bld, w)
    last = draw(st.sampled_from(("shift", "sigmoid", None)))
    return w if last is None else bld.map(last, w, c=1.5 if last == "shift" else None)


@st.composite
def split_reduction_family(draw):
    """An axis the diagram sums over tiled with ``partial="sum"``: each block adds its partial
    sum into the zero-filled output with fp32 atomics."""
    kind = draw(st.sampled_from(("matmul", "reduce", "attention backward")))
    if kind == "matmul":
        # a second summed axis f: the sum over both is one loop of lanes
        two = draw(st.booleans())
        bld = Builder(nc.f32)
        A, B = bld.input("A", a, b, *((f,) if two else ())), bld.input("B", b, *((f,) if two else ()), c)
        A, B = _padding_shows(draw, bld, A), _padding_shows(draw, bld, B)
        mm = bld.diagram(bld.contract(A, B, out=(a, c), name="C"), names=["C"])
        gb = draw(st.integers(1, 7))
        steps = [("split", "b", gb)] + [("tile", n, draw(st.integers(1, 7))) for n in ("a", "c") if draw(st.booleans())]
        blocks = {n: s for _, n, s in steps}
        sizes = {ax: _ragged(draw, ax.name, blocks.get(ax.name)) for ax in (a, b, c)}
        if two:
            sizes[f] = draw(st.integers(1, 4), label="f")
        return Case(f"split-K matmul(summed over {'b, f' if two else 'b'})", mm, tuple(steps), sizes, mm,
                    _fp32_options(draw))
    if kind == "reduce":
        bld = Builder(nc.f32)
        X = _padding_shows(draw, bld, bld.input("X", r, c))
        red = bld.diagram(bld.reduce("sum", X, c, name="Y"), names=["Y"])
        gc = draw(st.integers(1, 7))
        steps = [("split", "c", gc)] + ([("tile", "r", draw(st.integers(1, 5)))] if draw(st.booleans()) else [])
        sizes = {r: _ragged(draw, "r", dict((n, s) for _, n, s in steps).get("r")), c: _ragged(draw, "c", gc)}
        return Case("split sum", red, tuple(steps), sizes, red, _fp32_options(draw))
    causal = draw(st.booleans())
    weave = draw(st.sampled_from(("heads", "gqa")))
    kw = {"heads": h, **({"groups": g} if weave == "gqa" else {})}
    fwd = L.attention(q=q, x=x, d=d, causal=causal, logsumexp=True, **kw)
    bwd = nc.grad_with_residuals(fwd, wrt=["Q", "K", "V"])
    gx, sq = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    sizes = {q: _ragged(draw, "q", sq, 7), x: _ragged(draw, "x", gx, 7), d: draw(st.integers(1, 3), label="d"),
             h: draw(st.integers(1, 2), label="h")}
    if weave == "gqa":
        sizes[g] = draw(st.integers(1, 2), label="g")
    label = f"one-kernel attention backward({weave}, causal={causal})"
    return Case(label, bwd, (("split", "x", gx), ("stream", "q", sq)), sizes, bwd,
                {"threads": draw(st.sampled_from((16, 32)), label="threads")},
                _residuals(fwd, sizes), SMALL_DATA)


def _residuals(fwd, sizes, part=None):
    """Inputs of the backward of ``fwd``: its inputs and the cotangent from the regime, ``O`` and
    ``L`` computed by the forward from them (the logsumexp its scores produce); for a backward
    ``part``, the arrays it reads by name, ``D = rowsum(dO O)`` among them."""
    bound = fwd.bind(sizes)

    def inputs(rng, regime):
        ins = [REGIMES[regime][0](rng, tuple(ax.size for ax in arr.axes)) for arr in bound.dom]
        outs = nc.evaluate(bound, *ins)
        got = [*ins, *outs, REGIMES[regime][0](rng, outs[0].shape)]
        if part is None:
            return got
        named = dict(zip([a.name for a in (*bound.dom, *bound.cod)] + ["dO"], got))
        named["D"] = (named["dO"] * named["O"]).sum(-1)
        return [named[a.name] for a in part.dom]
    return inputs


# --------------------------------------------------------------------------- logsumexp from statistics

@st.composite
def logsumexp_family(draw):
    """Attention with its logsumexp output, streamed with the scores in registers (chunks and
    tiles of 4 or 8, d = 4), relabelled or through ``tiles=``; at times any other chunking (the
    logsumexp then has an accumulator of its own)."""
    causal = draw(st.booleans())
    window = draw(st.sampled_from((None, None, 2)))
    bias = draw(st.sampled_from((None, "input", nc.alibi(0.5))))
    weave = draw(st.sampled_from(("none", "heads", "batch", "gqa")))
    dv = draw(st.booleans())
    kw = dict(causal=causal, window_size=window, bias=bias, dv=e if dv else None, logsumexp=True)
    kw.update({"heads": dict(heads=h), "batch": dict(heads=h, batch=bb), "gqa": dict(groups=g, heads=h)}.get(weave, {}))
    att = L.attention(q=q, x=x, d=d, **kw)
    how = draw(st.sampled_from(("relabel", "relabel", "tiles", "any")))
    sx, gq = draw(st.sampled_from((4, 8))), draw(st.sampled_from((4, 8)))
    options = {"threads": draw(st.sampled_from((16, 32) if how != "tiles" else (32, 64)), label="threads"),
               "prefetch": draw(st.sampled_from(PREFETCH), label="prefetch")}
    if how == "relabel":
        steps = (("stream", "x", sx), ("tile", "q", gq), ("place", "O", "registers"))
    elif how == "tiles":
        steps, options["tiles"] = (), {"x": sx, "q": gq}
    else:
        sx, gq = draw(st.integers(1, 5)), draw(st.integers(1, 7))
        steps = (("stream", "x", sx), ("tile", "q", gq))
    sizes = {q: _ragged(draw, "q", gq), x: _ragged(draw, "x", sx)}
    sizes.update({ax: (4 if ax.name in ("d", "e") else draw(st.integers(1, 3), label=ax.name))
                  for ax in att.axes if ax not in sizes})
    label = f"attention+logsumexp({weave}, causal={causal}, window={window}, bias={bias}, dv={dv}, {how})"
    return Case(label, att, steps, sizes, att, options)


# --------------------------------------------------------------------------- 16-bit operand buffers

@st.composite
def sixteen_bit_family(draw, what=None):
    """f16 / bf16 on simulated tensor cores (tiles and chunks of 16 or 32, d = 16): one part
    of the FlashAttention-2 backward (dS a 16-bit buffer), or an MLP (its hidden layer)."""
    from napkin_cat.lowering.torch_op import backward_plan   # the parts torch_op runs
    dt = draw(st.sampled_from((nc.f16, nc.bf16)))
    options = {"threads": draw(st.sampled_from((32, 64)), label="threads")}
    what = what or draw(st.sampled_from(("backward", "backward", "backward-wg", "mlp", "document", "document")))
    if what == "backward-tf32x3":   # tf32x3_family: fp32 on 3xTF32 fragments, "auto": double buffers
        dt, what, options["fp32"] = nc.f32, "backward", "3xtf32"
        options["prefetch"] = draw(st.sampled_from((False, "auto")), label="prefetch")
    if what == "backward-wg":   # 4 warps in one warpgroup: wgmma where the fragments allow (planner.WGMMA)
        options = {"threads": 128, "wgmma": True}
    if what == "document":   # one warp: the scores and the output on the same fragment rows
        return _document_case(draw, dt, {"threads": 32})
    if what == "mlp":
        gt = draw(st.sampled_from((16, 32)))
        mlp = L.mlp(t=t, d=e, h=f, dtype=dt)
        sizes = {t: draw(st.integers(1, 40), label="t"), e: 16, f: draw(st.sampled_from((16, 32)), label="f")}
        return Case(f"{dt.name} mlp", mlp, (("tile", "t", gt),), sizes, mlp, options, regimes=SMALL_DATA)
    causal = draw(st.booleans())
    fl = L.attention(q=q, x=x, d=d, causal=causal).stream(x, "s_x").tile(q, "g_q")
    # D = rowsum(dO O), the key-tile part (dK, dV) or the query-tile part (dQ) of two kernels, or
    # the one kernel adding dQ across key tiles (its dS also a 16-bit buffer, read by dQ transposed)
    which = draw(st.sampled_from((1, 2, "one", "one") if dt is nc.f32 else (0, 1, 1, 2, 2, "one")))
    if which == "one":
        part = backward_plan(fl, form="one kernel").at(dt).parts[-1]
    else:
        part = backward_plan(fl).at(dt).parts[which]
    blocks = {n: draw(st.sampled_from((64,) if what == "backward-wg" and n[0] == "g" else (16, 32)), label=n)
              for n in ("g_x", "s_q", "g_q", "s_x") if n in part._sched_str()}
    # queries often a multiple of 4: the fp32 L and D then go by cp.async too (4 words per copy)
    n_q = draw(st.one_of(st.integers(1, 24), st.sampled_from((8, 20, 24))), label="q")
    sizes = {q: n_q, x: draw(st.integers(1, 24), label="x"), d: 16}
    if dt is not nc.f32 and what == "backward":     # what nc.torch_op lowers with, or none
        options["prefetch"] = draw(st.sampled_from((False, "auto")), label="prefetch")
    fwd = L.attention(q=q, x=x, d=d, causal=causal, logsumexp=True)
    label = (f"{dt.name}{' 3xTF32' if dt is nc.f32 else ''} attention backward "
             f"({', '.join(a.name for a in part.cod)}, causal={causal})")
    mine = {a.name for a in part.axes}                  # D = rowsum(dO O) has no key axis
    return Case(label, part, (), {a: n for a, n in sizes.items() if a.name in mine}, part.unrelabelled(),
                {**options, "tiles": blocks}, _residuals(fwd, sizes, part), SMALL_DATA)


@st.composite
def tf32x3_family(draw):
    """fp32 FlashAttention-2 backward parts on 3xTF32 fragments (``fp32="3xtf32"``): dK, dV or dQ
    of the two kernels, or the one kernel adding dQ across key tiles with fp32 atomics (the form
    ``nc.torch_op`` picks for 3xTF32); P and dS packed from the registers that computed them."""
    return draw(sixteen_bit_family(what="backward-tf32x3"))


@st.composite
def copying_family(draw, forwards: bool = False):
    """The one-kernel backward as ``nc.torch_op`` runs it on an H100: 256 computing threads on
    warpgroups, a copying warpgroup (``producer.SWITCH = "auto"``: dQ added across key tiles),
    chunks handed over by named barriers and by block barriers (both lowered and checked), dS
    published among the computing threads;
    several query chunks (of 64), one or two key tiles (of 128), ragged.  Or, with a block table
    of random entries over a document mask (``nc.blocked``: an entry of 0 masks its block), that
    backward or the forward (query tiles of 128, key chunks of 32): both sides of the copying
    warpgroup scan the table for the chunks it keeps (``copying-table``); the forwards over three
    buffers (``three-buffers``, ``three-buffers-table``).  Or the forward without a table, any
    number of key chunks (``three-buffers``).

    The backwards here, the forwards with ``forwards`` (:func:`copying_forward_family`): two
    variants a family, so that a family's few examples reach both (of four variants in one family,
    eight examples missed one about once in ten random runs)."""
    from napkin_cat.lowering.torch_op import backward_plan
    dt = draw(st.sampled_from((nc.f16, nc.bf16)))
    variants = ("forward-table", "forward") if forwards else ("backward", "backward-table")
    what = draw(st.sampled_from(variants), label="variant")
    options = {"threads": 256, "wgmma": True, "hand_over": "both", "prefetch": "double",
               "tiles": {"g_x": 128, "s_q": 64}}
    if what.endswith("table"):
        return _copying_table_case(draw, dt, what, options)
    if what == "forward":    # over three buffers with the named hand-over (producer.STAGES), two with the block one
        causal = draw(st.booleans(), label="causal")
        att = L.attention(q=q, x=x, d=d, causal=causal, dtype=dt)
        steps = (("stream", "x", 32), ("tile", "q", 128), ("place", "O", "registers"))
        sizes = {q: draw(st.integers(33, 140), label="q"), x: draw(st.integers(1, 200), label="x"), d: 16}
        return Case(f"{dt.name} forward, copying warpgroup (causal={causal})", att, steps, sizes, att,
                    {**options, "tiles": None}, None, SMALL_DATA)
    causal = draw(st.booleans())
    fl = L.attention(q=q, x=x, d=d, causal=causal).stream(x, "s_x").tile(q, "g_q")
    part = backward_plan(fl, form="one kernel").at(dt).parts[-1]
    # queries mostly a multiple of 4 (L and D go by cp.async, so the copying warpgroup joins); at
    # times not (it cannot, and the kernel says why)
    four = draw(st.sampled_from((True, True, True, False)), label="q a multiple of 4")
    n_q = 4 * draw(st.integers(17, 25), label="q / 4") if four else draw(st.integers(65, 100), label="q")
    sizes = {q: n_q, x: draw(st.sampled_from((20, 130)), label="x"), d: 16}
    # dQ staged in shared memory, one bulk reduction a chunk (lowering/staged_add.py), in the named
    # hand-over's lowering; by atomics in the block barriers' (both lowered: _lower_and_check)
    options["staged"] = True
    # the column values (L, D) read before the wait of a contraction of at least one step, not the
    # default's 8 (d = 128): column_values.BEFORE_WAIT
    options["before_wait"] = 1
    fwd = L.attention(q=q, x=x, d=d, causal=causal, logsumexp=True)
    return Case(f"{dt.name} one-kernel attention backward, copying warpgroup (causal={causal})",
                part, (), sizes, part.unrelabelled(), options, _residuals(fwd, sizes, part), SMALL_DATA)


@st.composite
def copying_forward_family(draw):
    """:func:`copying_family`'s forwards: over three buffers, with a block table or without."""
    return draw(copying_family(forwards=True))


@st.composite
def copying_tma_family(draw):
    """The forward over three buffers at ``d`` = 64 or 128 (one or two 64-column panels a copy):
    K and V by tensor copies completing on mbarriers, read by swizzle-mode descriptors; causal or
    not, ragged; its own family, since each example simulates a 64-wide forward (the named
    hand-over only: the block one keeps two buffers and ``cp.async``, which ``copying_forward``
    covers).  Or, one time in two, the forward under a block table of random entries
    (:func:`_copying_table_case` at d = 64): the chunks the table keeps, by tensor copies
    (``tma-table``, ``producer._staged_copies``)."""
    dt = draw(st.sampled_from((nc.f16, nc.bf16)))
    options = {"threads": 256, "wgmma": True, "hand_over": "named", "prefetch": "double"}
    if draw(st.sampled_from(("forward", "forward-table")), label="variant") == "forward-table":
        return _copying_table_case(draw, dt, "forward-table", options, width=64)
    causal = draw(st.booleans(), label="causal")
    att = L.attention(q=q, x=x, d=d, causal=causal, dtype=dt)
    steps = (("stream", "x", 32), ("tile", "q", 128), ("place", "O", "registers"))
    sizes = {q: draw(st.integers(33, 140), label="q"), x: draw(st.integers(1, 200), label="x"),
             d: draw(st.sampled_from((64, 64, 128)), label="d")}
    return Case(f"{dt.name} forward, copying warpgroup, TMA (causal={causal})", att, steps, sizes, att, options,
                None, SMALL_DATA)


def _copying_table_case(draw, dt, what, options, width: int = 16):
    """:func:`copying_family`'s block-table examples: 33 to 140 tokens (a multiple of 4, so ``L``
    and ``D`` go by cp.async), a table over blocks of 32 queries by 128 keys (the backward's
    chunks by its tiles) or 128 by 32 (the forward's), documents of ids 0 and 1 in runs of 8;
    heads ``width`` wide."""
    from napkin_cat.lowering.torch_op import backward_plan
    n = 4 * draw(st.integers(9, 35), label="n / 4")
    rows, cols = (32, 128) if what == "backward-table" else (128, 32)
    shape = (-(-n // rows), -(-n // cols))
    doc = nc.aux("doc", nc.Axis("n", n))
    bt = nc.aux("bt", nc.Axis("rb", shape[0]), nc.Axis("cb", shape[1]))
    m = nc.mask_mod(lambda b_, h_, i, j: doc[i] == doc[j])
    count = shape[0] * shape[1]
    entries = st.lists(st.sampled_from((0.0, 0.0, 1.0, 2.0)), min_size=count, max_size=count)
    table = np.array(draw(entries, label="table"), np.float32).reshape(shape)
    att = L.attention(q=q, x=x, d=d, mask=nc.blocked(m, bt, rows, cols), dtype=dt)
    sizes = {q: n, x: n, d: width}

    def named(rng, regime):
        ids = np.repeat(rng.integers(0, 2, n // 8 + 1), 8)[:n].astype(np.float32)
        return {"doc": ids, "bt": table} | {k: REGIMES[regime][0](rng, (n, width)) for k in "QKV"}
    if what == "forward-table":
        steps = (("stream", "x", 32), ("tile", "q", 128), ("place", "O", "registers"))
        options = {**options, "tiles": None}

        def inputs(rng, regime):
            got = named(rng, regime)
            return [got[a.name] for a in att.dom]
        return Case(f"{dt.name} forward, block table, copying warpgroup", att, steps, sizes, att, options, inputs,
                    SMALL_DATA)
    fl = att.stream(x, "s_x").tile(q, "g_q")
    part = next(p for p in backward_plan(fl, form="one kernel").at(dt).parts if "dK" in {a.name for a in p.cod})
    fwd = L.attention(q=q, x=x, d=d, mask=nc.blocked(m, bt, rows, cols), logsumexp=True).bind(sizes)
    return Case(f"{dt.name} one-kernel attention backward, block table, copying warpgroup", part, (), sizes,
                part.unrelabelled(), {**options, "tiles": {"g_x": 128, "s_q": 32}}, _table_residuals(named, fwd, part),
                SMALL_DATA)


def _table_residuals(named, fwd, part):
    """The inputs of backward ``part`` of ``fwd`` (attention with its logsumexp, under a mask that
    reads data): ``named(rng, regime)`` its inputs by name, ``O`` and ``L`` from the forward, ``dO``
    drawn, ``D = rowsum(dO O)``."""
    def residuals(rng, regime):
        got = named(rng, regime)
        got["O"], got["L"] = nc.evaluate(fwd, *[got[a.name] for a in fwd.dom])
        got["dO"] = REGIMES[regime][0](rng, got["O"].shape)
        got["D"] = (got["dO"] * got["O"]).sum(-1)
        return [got[a.name] for a in part.dom]
    return residuals


def _document_case(draw, dt, options):
    """A document mask reading its block table (four gathers per score: the fragment epilogue
    written out row by row, ``emit_acc.UNROLL_GATHERS``), ragged sizes, random documents."""
    n = draw(st.integers(1, 40), label="n")
    blk = draw(st.sampled_from((16, 8)), label="table block")   # 16: a tile inside one table block
    doc = nc.aux("doc", nc.Axis("n", n))
    bt = nc.aux("bt", nc.Axis("rb", -(-n // blk)), nc.Axis("cb", -(-n // blk)))
    m = nc.mask_mod(lambda b_, h_, i, j: (doc[i] == doc[j]) & (j <= i))
    att = L.attention(q=q, x=x, d=d, mask=nc.blocked(m, bt, blk, blk), dtype=dt)
    steps = (("stream", "x", 16), ("tile", "q", 16), ("place", "O", "registers"))
    sizes = {q: n, x: n, d: 16}

    def inputs(rng, regime):
        ids = np.cumsum(rng.random(n) < 0.2).astype(np.float32)
        qkv = [REGIMES[regime][0](rng, (n, 16)) for _ in range(3)]
        return [*qkv, nc.block_table(m, n, n, blk, blk, {"doc": ids}), ids]
    return Case(f"{dt.name} document mask with its block table", att, steps, sizes, att, options, inputs,
                SMALL_DATA)


# --------------------------------------------------------------------------- auxiliary tensors in HBM

@st.composite
def aux_in_place_family(draw):
    """Attention variants gathering from auxiliary tensors that stay in global memory, read in
    place by their gathers (``place(name, "HBM")``, or the default for a large tensor,
    ``loopnest.AUX_WHOLE_BYTES``, here lowered to 0): a document mask, an explicit block mask of
    blocks of 2 to 5 tokens, a document mask reading its block table (its chunk test reading the
    table in global memory), and a relative-bias table ``rb[i - j + n - 1]`` with a per-key bias;
    fp32 (tiles of 1 to 16, non-powers of two, threads, micro-tiles) or f16 / bf16 on tensor
    cores (tiles of 16), ragged sizes, random data and documents."""
    what = draw(st.sampled_from(("document", "block_mask", "document_table", "relative_table", "batch_table")),
                label="variant")
    dt = draw(st.sampled_from((nc.f32, nc.f32, nc.f16, nc.bf16)), label="dtype")
    n = draw(st.integers(1, 40), label="n")
    nb = draw(st.integers(1, 3), label="batch") if what == "batch_table" else 1
    extra = {}
    if what == "batch_table":     # documents packed differently in each sequence, a table each
        doc = nc.aux("doc", nc.Axis("nb", nb), nc.Axis("n", n))
        m = nc.mask_mod(lambda b_, h_, i, j: (doc[b_, i] == doc[b_, j]) & (j <= i))
        blk = draw(st.sampled_from((4, 8, 16)), label="table block")
        bt = nc.aux("bt", nc.Axis("tb", nb), nc.Axis("rb", -(-n // blk)), nc.Axis("cb", -(-n // blk)))
        kw = {"mask": nc.blocked(m, bt, blk, blk), "batch": bb}
        extra = {bb: nb}

        def aux(rng):
            ids = np.cumsum(rng.random((nb, n)) < 0.2, axis=1).astype(np.float32)
            return [nc.block_table(m, n, n, blk, blk, {"doc": ids}, batch=nb), ids]
    elif what == "document" or what == "document_table":
        doc = nc.aux("doc", nc.Axis("n", n))
        m = nc.mask_mod(lambda b_, h_, i, j: (doc[i] == doc[j]) & (j <= i))
        blk = draw(st.sampled_from((4, 8, 16)), label="table block")
        bt = nc.aux("bt", nc.Axis("rb", -(-n // blk)), nc.Axis("cb", -(-n // blk)))
        kw = {"mask": m if what == "document" else nc.blocked(m, bt, blk, blk)}

        def aux(rng):
            ids = np.cumsum(rng.random(n) < 0.2).astype(np.float32)
            return [ids] if what == "document" else [nc.block_table(m, n, n, blk, blk, {"doc": ids}), ids]
    elif what == "block_mask":
        blk = draw(st.integers(2, 5), label="mask block")
        bm = nc.aux("bm", nc.Axis("rb", -(-n // blk)), nc.Axis("cb", -(-n // blk)))
        kw = {"mask": nc.mask_mod(lambda b_, h_, i, j: bm[i // blk, j // blk] > 0)}

        def aux(rng):
            return [(rng.random((-(-n // blk),) * 2) < 0.6).astype(np.float32)]
    else:
        rb, tb = nc.aux("rb", nc.Axis("nr", 2 * n - 1)), nc.aux("tb", nc.Axis("n", n))
        kw = {"bias": nc.bias_mod(lambda b_, h_, i, j: rb[i - j + (n - 1)] + tb[j]), "causal": draw(st.booleans())}

        def aux(rng):
            return [rng.standard_normal(2 * n - 1).astype(np.float32), rng.standard_normal(n).astype(np.float32)]
    att = L.attention(q=q, x=x, d=d, dtype=dt, **kw)
    names = [a.name for a in att.dom[3:]]
    tq, tx, options = _blocks(draw, dt, 16)
    how = draw(st.sampled_from(("place", "default")), label="placement")
    placed = tuple(("place", name, "HBM") for name in names) if how == "place" else ()
    options["aux_whole_bytes"] = None if how == "place" else 0
    batches = (("tile", "bb", draw(st.sampled_from((1, 1, nb)), label="batch tile")),) if extra else ()
    steps = (("stream", "x", tx), ("tile", "q", tq), *batches, *placed)
    sizes = {q: n, x: n, d: 16, **extra}
    lead = (nb,) if extra else ()

    def inputs(rng, regime):
        return [*(REGIMES[regime][0](rng, (*lead, n, 16)) for _ in range(3)), *aux(rng)]
    return Case(f"{dt.name} {what}, auxiliary tensors in HBM ({how})", att, steps, sizes, att, options, inputs,
                SMALL_DATA)


@st.composite
def gqa_backward_family(draw):
    """The FlashAttention-2 backward of grouped-query attention as ``nc.torch_op`` splits it
    (``backward_parts.fa2_parts``): a key-tile part streaming the groups one at a time around the
    query chunks (dK, dV summed over both in registers; in the one kernel dQ added across key
    tiles too), a query-tile part with a block per group, or ``D``; 1 to 3 groups, causal or
    not, fp32 (blocks of 3 to 8) or f16 / bf16 on tensor cores (16), ragged sizes."""
    from napkin_cat.lowering.torch_op import backward_plan
    dt = draw(st.sampled_from((nc.f32, nc.f16, nc.bf16)), label="dtype")
    causal = draw(st.booleans(), label="causal")
    fl = L.attention(q=q, x=x, d=d, groups=g, causal=causal).stream(x, "s_x").tile(q, "g_q")
    which = draw(st.sampled_from((0, 1, 2, "one", "one")), label="part")
    part = (backward_plan(fl, form="one kernel").at(dt).parts[-1] if which == "one"
            else backward_plan(fl).at(dt).parts[which])
    if dt == nc.f32:
        blocks = {n: draw(st.integers(3, 8), label=n) for n in ("g_x", "s_q", "g_q", "s_x") if n in part._sched_str()}
        options = _fp32_options(draw)
    else:
        blocks = {n: 16 for n in ("g_x", "s_q", "g_q", "s_x") if n in part._sched_str()}
        options = {"threads": draw(st.sampled_from((32, 64)), label="threads")}
    sizes = {q: draw(st.integers(1, 20), label="q"), x: draw(st.integers(1, 20), label="x"), d: 16,
             g: draw(st.integers(1, 3), label="groups")}
    fwd = L.attention(q=q, x=x, d=d, groups=g, causal=causal, logsumexp=True)
    mine = {a.name for a in part.axes}
    return Case(f"{dt.name} GQA backward ({', '.join(a.name for a in part.cod)}, causal={causal})", part, (),
                {a: n for a, n in sizes.items() if a.name in mine}, part.unrelabelled(), {**options, "tiles": blocks},
                _residuals(fwd, sizes, part), SMALL_DATA)


@st.composite
def index_mask_family(draw):
    """Masks whose block sparsity is derived from comparisons of the block quotients ``i // b``,
    ``j // b`` (``index_support._quotients``): block-causal, NATTEN on an image ``b`` wide with a
    radius of 0 to 2, a band of blocks, and each joined with a comparison of ``i`` and ``j``
    (``&`` causal, ``|`` a window), read once per block where a tile lies inside one block
    (``block-quotient``, :func:`napkin_cat.lowering.emit_kinds.block_quotients`); fp32 (tiles and chunks of 1 to 9, threads, micro-tiles) or
    f16 / bf16 on tensor cores (16), ragged sizes of up to 40 tokens, so chunks are skipped,
    kept whole and partial at block edges that fall inside chunks; half of them with a bias whose
    row term ``nc.lower`` drops (``row-terms``), checked against the bias as written."""
    kind = draw(st.sampled_from(("block_causal", "natten", "block_band", "natten_causal", "block_or_window")),
                label="mask")
    b, k = draw(st.integers(1, 6), label="block"), draw(st.integers(0, 2), label="radius")
    masks = {
        "block_causal": lambda b_, h_, i, j: i // b >= j // b,
        "natten": lambda b_, h_, i, j: (abs(i // b - j // b) <= k) & (abs(i % b - j % b) <= k),
        "block_band": lambda b_, h_, i, j: (j // b <= i // b) & (i // b - j // b <= k),
        "natten_causal": lambda b_, h_, i, j: (abs(i // b - j // b) <= k) & (abs(i % b - j % b) <= k) & (j <= i),
        "block_or_window": lambda b_, h_, i, j: (i // b == j // b + k) | (abs(i - j) <= 1),
    }
    dt = draw(st.sampled_from((nc.f32, nc.f32, nc.f16, nc.bf16)), label="dtype")
    # a bias with a term of the row alone, which nc.lower drops (relabel/row_terms.py), half the time
    bias = draw(st.sampled_from(("none", "relative", "mixed", "none")), label="bias")
    biases = {"none": None, "relative": lambda s, b_, h_, i, j: s + (i - j) * 0.25,
              "mixed": lambda s, b_, h_, i, j: s + ((i - j) * 0.5 + abs(i - j) * 0.125)}
    att = L.attention(q=q, x=x, d=d, mask=nc.mask_mod(masks[kind]), dtype=dt,
                      **({"score_mod": biases[bias]} if biases[bias] else {}))
    tq, tx, options = _blocks(draw, dt, 9)
    n = draw(st.integers(1, 40), label="n")
    return Case(f"{dt.name} {kind} (b={b}, k={k}, bias {bias})", att, (("stream", "x", tx), ("tile", "q", tq)),
                {q: n, x: n, d: 16}, att, options, None, SMALL_DATA)


TABLE_READS = {   # (table block, query tile, key chunk, threads): what the tile x chunk reads
    "one entry": ((16,), 16, 16, 32),        # inside one block
    "entries": ((8,), 16, 16, 32),           # over 2 x 2 blocks, read one by one
    "warp rows": ((16,), 32, 16, 64),        # over 2 blocks; each of 2 warps' 16 rows inside one
    "warp columns": ((16,), 16, 32, 64),     # ... each of 2 warps' 16 columns inside one
    "loops": ((4, 12), 16, 16, 32),          # over 16 blocks, or a count that varies: loops
}
BACKWARD_READS = {"warp rows": ((16,), 32, 16, 64), "warp columns": ((16,), 32, 32, 128)}
"""The backward's dK, dV part instead, where the warps' entries are drawn: key tiles (the fragments'
rows, the mask's columns) by query chunks, on 2 x 1 warps or 2 x 2."""


@st.composite
def table_reads_family(draw):
    """A causal document mask reading the user's block table of random entries (``nc.blocked``;
    entries 0, 1, 2 drawn, not derived: a kept block of other documents shows in the output), f16
    or bf16 on simulated tensor cores, ragged sizes of several chunks: the tile x chunk inside one
    table block (``table-versions``), over a few blocks read one by one (``table-entries``,
    ``emit_tables.SPANNED_ENTRIES``), over blocks that each warp's rows or columns lie inside
    (``warp-entries``: ``unswitch._warp_entries``, the partial chunks written per value of each
    warp's entry) or over blocks read in loops (``table-loops``; a block of 12, not a power of two);
    or the backward's dK, dV part over such a table, whose fragments' rows are the mask's columns."""
    dt = draw(st.sampled_from((nc.f16, nc.bf16)), label="dtype")
    what = draw(st.sampled_from(sorted(TABLE_READS)), label="table reads")
    blocks, tq, tx, threads = TABLE_READS[what]
    if what in BACKWARD_READS and draw(st.booleans(), label="backward"):
        what = "backward, " + what
        blocks, tq, tx, threads = BACKWARD_READS[what[len("backward, "):]]
    blk = draw(st.sampled_from(blocks), label="table block")
    n = draw(st.integers(1, 3 * max(tq, tx) + 5), label="n")
    shape = (-(-n // blk), -(-n // blk))
    table = np.array(draw(st.lists(st.sampled_from((0.0, 1.0, 1.0, 2.0)), min_size=shape[0] * shape[1],
                                   max_size=shape[0] * shape[1]), label="table"), np.float32).reshape(shape)
    doc = nc.aux("doc", nc.Axis("n", n))
    bt = nc.aux("bt", nc.Axis("rb", shape[0]), nc.Axis("cb", shape[1]))
    m = nc.mask_mod(lambda b_, h_, i, j: (doc[i] == doc[j]) & (j <= i))
    att = L.attention(q=q, x=x, d=d, mask=nc.blocked(m, bt, blk, blk), dtype=dt)

    def named(rng, regime):
        return {"doc": np.cumsum(rng.random(n) < 0.2).astype(np.float32), "bt": table} \
            | {k: REGIMES[regime][0](rng, (n, 16)) for k in "QKV"}
    if what.startswith("backward"):
        from napkin_cat.lowering.torch_op import backward_plan
        part = next(p for p in backward_plan(att.stream(x, "s_x").tile(q, "g_q")).at(dt).parts
                    if "dK" in {a.name for a in p.cod})
        fwd = L.attention(q=q, x=x, d=d, mask=nc.blocked(m, bt, blk, blk), logsumexp=True).bind({q: n, x: n, d: 16})
        return Case(f"{dt.name} attention backward (dK, dV), the user's table of {blk} x {blk} blocks ({what})",
                    part, (), {q: n, x: n, d: 16}, part.unrelabelled(),
                    {"threads": threads, "tiles": {"g_x": tq, "s_q": tx}}, _table_residuals(named, fwd, part),
                    SMALL_DATA)

    def inputs(rng, regime):
        got = named(rng, regime)
        return [got[a.name] for a in att.dom]
    return Case(f"{dt.name} document mask, the user's table of {blk} x {blk} blocks ({what})", att,
                (("stream", "x", tx), ("tile", "q", tq), ("place", "O", "registers")), {q: n, x: n, d: 16}, att,
                {"threads": threads}, inputs, SMALL_DATA)


@st.composite
def grouped_table_family(draw):
    """Grouped-query heads with a block table of each query head (``h * G + g``: a window of
    each query head's own width, ``block_table(..., heads=H * G)``): a block holding one
    key/value head and one group reads its slice of the table and skips the chunks it masks
    (``emit_loads._lead_entry``), one holding several groups evaluates the mask; 1 to 2 heads,
    1 to 3 groups, fp32 (tiles of 1 to 9) or f16 / bf16 on tensor cores, ragged sizes."""
    H, G = draw(st.integers(1, 2), label="heads"), draw(st.integers(1, 3), label="groups")
    n = draw(st.integers(1, 40), label="n")
    blk = draw(st.sampled_from((4, 8, 16)), label="table block")
    dt = draw(st.sampled_from((nc.f32, nc.f32, nc.f16, nc.bf16)), label="dtype")
    wh = nc.aux("wh", nc.Axis("nh", H * G))
    m = nc.mask_mod(lambda b_, h_, i, j: (j <= i) & (i - j <= wh[h_]))
    bt = nc.aux("bt", nc.Axis("th", H * G), nc.Axis("rb", -(-n // blk)), nc.Axis("cb", -(-n // blk)))
    att = L.attention(q=q, x=x, d=d, heads=h, groups=g, dtype=dt, mask=nc.blocked(m, bt, blk, blk))
    tq, tx, options = _blocks(draw, dt, 9)
    group_tile = draw(st.sampled_from((1, 1, G)), label="group tile")
    steps = (("stream", "x", tx), ("tile", "q", tq), ("tile", "h", 1), ("tile", "g", group_tile))

    def inputs(rng, regime):
        widths = rng.integers(0, n + 1, H * G).astype(np.float32)
        ins = {"Q": REGIMES[regime][0](rng, (H, G, n, 16)), "K": REGIMES[regime][0](rng, (H, n, 16)),
               "V": REGIMES[regime][0](rng, (H, n, 16)), "wh": widths,
               "bt": nc.block_table(m, n, n, blk, blk, {"wh": widths}, heads=H * G)}
        return [ins[a.name] for a in att.dom]
    return Case(f"{dt.name} GQA ({H} x {G}) with a table of each query head (block {blk}, groups tiled by "
                f"{group_tile})", att, steps, {q: n, x: n, d: 16, h: H, g: G}, att, options, inputs, SMALL_DATA)


@st.composite
def derived_table_family(draw):
    """Masks that read data with no block table of the user's (``lowering/tabled.py``): the
    kernel of the blocked mask over its own blocks, the tables derived from the inputs at each
    launch: packed documents (ids), documents of each sequence (a table of each, read where a
    block holds one sequence), a causal window of each query head under grouped heads (a table
    of each head and group); fp32 (tiles of 1 to 9, non-powers of two) or f16 / bf16 on tensor
    cores, ragged sizes, random documents (ids from 0, or from past what 16 bits hold) and widths."""
    what = draw(st.sampled_from(("documents", "batch_documents", "head_windows")), label="variant")
    dt = draw(st.sampled_from((nc.f32, nc.f32, nc.f16, nc.bf16)), label="dtype")
    n = draw(st.integers(1, 40), label="n")
    tq, tx, options = _blocks(draw, dt, 9)
    steps, sizes = (("stream", "x", tx), ("tile", "q", tq)), {q: n, x: n, d: 16}
    if what == "head_windows":
        H, G = draw(st.integers(1, 2), label="heads"), draw(st.integers(1, 3), label="groups")
        wh = nc.aux("wh", nc.Axis("nh", H * G))
        att = L.attention(q=q, x=x, d=d, heads=h, groups=g, dtype=dt,
                          mask=nc.mask_mod(lambda b_, h_, i, j: (j <= i) & (i - j <= wh[h_])))
        steps += (("tile", "h", 1), ("tile", "g", draw(st.sampled_from((1, 1, G)), label="group tile")))
        sizes |= {h: H, g: G}
        shapes = {"Q": (H, G, n, 16), "K": (H, n, 16), "V": (H, n, 16)}
        data = lambda rng: {"wh": rng.integers(0, n + 1, H * G).astype(np.float32)}
    else:
        nb = draw(st.integers(1, 3), label="batch") if what == "batch_documents" else 1
        lead = (nb,) if what == "batch_documents" else ()
        doc = nc.aux("doc", *(nc.Axis("nb", nb),) * len(lead), nc.Axis("n", n))
        same = (lambda b_, i, j: doc[b_, i] == doc[b_, j]) if lead else (lambda b_, i, j: doc[i] == doc[j])
        causal = draw(st.booleans(), label="causal")
        m = nc.mask_mod(lambda b_, h_, i, j: same(b_, i, j) & (j <= i) if causal else same(b_, i, j))
        att = L.attention(q=q, x=x, d=d, dtype=dt, mask=m, **({"batch": bb} if lead else {}))
        if lead:
            steps += (("tile", "bb", draw(st.sampled_from((1, 1, nb)), label="batch tile")),)
            sizes |= {bb: nb}
        shapes = {k: (*lead, n, 16) for k in "QKV"}
        # ids past what 16 bits hold exactly (bf16 256, f16 2048, f16's largest 65504): read as f32
        first = draw(st.sampled_from((0, 0, 257, 2049, 70001)), label="first id")
        data = lambda rng: {"doc": (first + np.cumsum(rng.random((*lead, n)) < 0.2, axis=-1)).astype(np.float32)}

    def inputs(rng, regime):
        ins = {k: REGIMES[regime][0](rng, s) for k, s in shapes.items()} | data(rng)
        return [ins[a.name] for a in att.dom]
    return Case(f"{dt.name} {what}, block tables derived per launch", att, steps, sizes, att, options, inputs,
                SMALL_DATA)


def aux_whole_bytes(limit):
    """``loopnest.AUX_WHOLE_BYTES`` for one lowering (None: as it is), then restored."""
    from napkin_cat.relabel import loopnest
    return module_setting(loopnest, "AUX_WHOLE_BYTES", loopnest.AUX_WHOLE_BYTES if limit is None else limit)


# --------------------------------------------------------------------------- one example

COPYING_EXAMPLES = 8
"""Examples of the ``copying`` family in any profile (each two kernels of 384 simulated threads):
with 5, a random run (the dev profile) drew no backward the copying warpgroup could join and
reached no ``computing-barrier``; with 8, and queries a multiple of 4 three times in four, a
random run misses a feature about once in 1000."""
TMA_EXAMPLES = 12
"""Examples of the ``copying_tma`` family in any profile: two variants (with a block table or
without), each of which must reach its own features; with 12, a random run misses one about once
in 2000."""
FAMILY_SETTINGS = SETTINGS
COPYING_SETTINGS = settings(SETTINGS, max_examples=min(FUZZ_EXAMPLES, COPYING_EXAMPLES))
TMA_SETTINGS = settings(SETTINGS, max_examples=min(FUZZ_EXAMPLES, TMA_EXAMPLES))

FAMILIES = {"reindex": reindex_family, "split_reduction": split_reduction_family,
            "logsumexp": logsumexp_family, "sixteen_bit": sixteen_bit_family, "tf32x3": tf32x3_family,
            "copying": copying_family, "copying_forward": copying_forward_family, "copying_tma": copying_tma_family,
            "aux_in_place": aux_in_place_family, "index_masks": index_mask_family,
            "gqa_backward": gqa_backward_family, "grouped_table": grouped_table_family,
            "derived_table": derived_table_family, "table_reads": table_reads_family}

# what each family must reach across its examples (named by test_kernel_fuzz._features)
EXPECTED_FEATURES = {"reindex": {"reindex", "reindex-predicate", "gather-kernel"},
                     "split_reduction": {"atomic"}, "logsumexp": {"lse-from-stats"},
                     "sixteen_bit": {"16-bit-operand", "ldmatrix-trans", "fragment-rows", "table-versions",
                                     "register-copy", "frag-operand", "wgmma", "cp.async-f32", "paired-atomic",
                                     "column-values", "paired-store", "paired-global"},
                     "aux_in_place": {"aux-in-place", "aux-in-place-table", "fragments", "batch-table"},
                     "index_masks": {"quotient-bound", "block-quotient", "skipped-arithmetic", "unswitched", "fragments", "ragged-chunk",
                                     "row-terms", "paired-global"},
                     "gqa_backward": {"nested-streams", "nested-skip", "atomic", "fragments", "ragged-chunk"},
                     "grouped_table": {"grouped-table", "fragments", "ragged-chunk"},
                     "table_reads": {"table-versions", "table-entries", "warp-entries", "table-loops", "fragments",
                                     "ragged-chunk"},
                     "derived_table": {"derived-table", "batch-table", "fragments", "ragged-chunk",
                                       "skipped-arithmetic", "unswitched", "table-versions",
                                       "table-version-skipped", "table-kernel", "table-kernel-static",
                                       "table-kernel-leads", "table-kernel-bounds"},
                     "copying": {"copying-warpgroup", "named-hand-over", "block-hand-over", "computing-barrier",
                                 "wgmma", "paired-atomic", "copying-table", "unswitched", "wgmma-shared-a",
                                 "issued-ahead", "staged-add", "columns-before-wait"},
                     "copying_forward": {"copying-warpgroup", "named-hand-over", "block-hand-over", "wgmma",
                                         "copying-table", "three-buffers", "three-buffers-table"},
                     "copying_tma": {"copying-warpgroup", "named-hand-over", "three-buffers", "tma", "ragged-chunk",
                                     "tma-table"},
                     "tf32x3": {"tf32x3", "tf32x3-atomic", "frag-operand", "double-buffered", "cp.async-f32",
                                "paired-atomic", "column-values"}}


def fuzz_case(family: str, data, stats: Counter):
    case = data.draw(FAMILIES[family](), label="case")
    try:
        rel = _apply(case.base, case.steps).bind(case.sizes)
    except nc.RelabelError as err:
        stats["relabel refused"] += 1
        note(f"relabel refused: {err}")
        assume(False)
    regime = data.draw(st.sampled_from(case.regimes), label="regime")
    seed = data.draw(st.integers(0, 2 ** 16), label="seed")
    note(f"{case.label}: {rel}  lower({case.options})")
    options = dict(case.options)
    modes = options.pop("hand_over", "named")     # a copying warpgroup's hand-over, or both in turn
    for mode in (("named", "block") if modes == "both" else (modes,)):
        _lower_and_check(case, rel, options, mode, regime, seed, stats)


def _lower_and_check(case, rel, options, mode, regime, seed, stats):
    try:
        with planner_switches(WGMMA=options.get("wgmma", False)), hand_over(mode), \
                aux_whole_bytes(options.get("aux_whole_bytes")), \
                module_setting(staged_add, "STAGED_ADD", options.get("staged", False) and mode == "named"), \
                module_setting(column_values, "BEFORE_WAIT", options.get("before_wait", column_values.BEFORE_WAIT)):
            kernel = nc.lower(rel, verify=False, **{k: v for k, v in options.items()
                                                    if k not in ("wgmma", "aux_whole_bytes", "staged", "before_wait")})
    except nc.LoweringError as err:
        stats["lowering refused"] += 1
        stats["refusal: " + str(err).split(":")[0][:60]] += 1
        return
    oracle = case.oracle.bind(case.sizes)
    rng = np.random.default_rng(seed)
    inputs = case.inputs(rng, regime) if case.inputs else \
        [REGIMES[regime][0](rng, tuple(ax.size for ax in arr.axes)) for arr in oracle.dom]
    diff = kernelcheck.kernel_outcome(oracle, kernel, inputs)
    stats["kernels"] += 1
    stats["case " + case.label.split("(")[0].strip()] += 1
    stats["non-power-of-two block"] += any(s & (s - 1) for op, _, s in case.steps if op != "place")
    feats = _features(kernel)
    if {"tf32x3", "atomic"} <= feats:   # the one-kernel backward on 3xTF32 fragments
        feats.add("tf32x3-atomic")
    if "double-buffered: chunk c + 1 is fetched into registers" in kernel.source:   # fp32 prefetch="double"
        feats.add("double-buffered")
    feats |= _table_kernels_agree(kernel, inputs)
    for feat in feats:
        stats["feature " + feat] += 1
    assert diff.failure is None, (f"{case.label} (hand-over {mode}): kernel differs from the oracle: "
                                  f"{kernelcheck.describe_failure(diff.failure)}\n{kernel!r}\nsource:\n"
                                  + kernel.source)


def _table_kernels_agree(kernel, inputs) -> set[str]:
    """A kernel with derived tables: each table by its generated kernel (``lowering/table_kernel.py``,
    what a GPU runs; here the simulator) is the mask's NumPy meaning on these inputs."""
    from napkin_cat.lowering.table_kernel import table_kernel
    feats = set()
    for spec in getattr(kernel, "tables", ()):
        tk = table_kernel(spec, inputs)
        got = tk.numpy([inputs[k] for _, k in spec.aux])
        np.testing.assert_array_equal(got, spec.values(inputs), err_msg=f"table kernel of {spec}:\n{tk.source}")
        feats |= {"table-kernel"} | ({"table-kernel-static"} if tk.static is not None else set()) \
            | ({"table-kernel-leads"} if spec.leads else set()) \
            | ({"table-kernel-bounds"} if "decided by the bounds" in tk.source else set())
    return feats


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_kernel_fuzz_reaches_generator_path(family):
    if family in ("sixteen_bit", "tf32x3", "copying", "copying_forward", "copying_tma"):
        pytest.importorskip("torch")   # the backward parts come from napkin_cat.lowering.torch_op
    stats: Counter = Counter()
    # a copying example lowers and runs two kernels of 384 simulated threads: fewer of them (the
    # decorator's text is kept: hypothesis derives a derandomised run's seed from it)
    SETTINGS = TMA_SETTINGS if family == "copying_tma" else COPYING_SETTINGS if family.startswith("copying") \
        else FAMILY_SETTINGS
    examples = SETTINGS.max_examples

    @SETTINGS
    @given(st.data())
    def run(data):
        fuzz_case(family, data, stats)

    run()
    print(f"\nkernel fuzz {family}: {dict(stats)}")
    assert stats["kernels"] >= examples // 2, f"too few kernels generated for {family}: {dict(stats)}"
    reached = {k[len("feature "):] for k in stats if k.startswith("feature ")}
    missing = EXPECTED_FEATURES[family] - reached
    assert not missing, f"{family}: the fuzzer reached no {missing}: {dict(stats)}"
