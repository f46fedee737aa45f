"""The kernel fuzzer: random diagrams, random relabellings and random ``lower`` options, every
generated kernel run in numba's CUDA simulator against the NumPy oracle.

Hypothesis draws a *family* (attention variants: masks, biases, GQA, heads and batch, d_v != d_k;
score chains: a contraction, elementwise boxes, a softmax, a contraction; matmul chains with
epilogues; reductions; norms and normalised attention; MLPs), a relabelling (one or two
streams, tiles of any legal size, 1 and non-powers of two included), sizes (ragged, up to six
chunks), ``threads``, ``micro`` and ``prefetch``, and a data regime of
:mod:`napkin_cat.verify.check` (adversarial ones included).  A relabelling the rules refuse is not
drawn again (``assume``); a configuration ``lower`` refuses with a ``LoweringError`` is counted
(refusing is allowed, a wrong kernel is not); every kernel that is generated must agree with
the oracle under :func:`napkin_cat.verify.kernelcheck.kernel_outcome` (the rule ``check_equivalent``
applies to kernels).  Each family's test then asserts how many kernels ran and which mappings
of the generator they reached, so a fuzzer that silently stops reaching code fails by name.

:mod:`test_kernel_fuzz_paths` runs four more families the same way, on diagrams of their own,
each asserted to reach one generator path (named by :func:`_features`): reindexings read
through their index maps and gather kernels of a multi-kernel cut (convolutions, flat-head GQA,
slice / pad / split / merge chains), split reductions added with atomics (split-K matmul, a
split sum, the one-kernel attention backward), a logsumexp read from an online softmax's row
statistics, and materialised 16-bit operand buffers read by ldmatrix (f16 / bf16 backward
parts and MLPs).

``HYPOTHESIS_PROFILE=ci`` (default) runs :data:`FUZZ_EXAMPLES` examples per family,
derandomised; ``HYPOTHESIS_PROFILE=dev`` runs ten times as many, at random.
"""

from __future__ import annotations

import os
import contextlib
import re

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

from collections import Counter  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, assume, given, note, settings, strategies as st  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering.gather import is_gather  # noqa: E402
from napkin_cat.lowering.multi import MultiKernel  # noqa: E402
from napkin_cat.lowering.tabled import TabledKernel  # noqa: E402
from napkin_cat.lowering.reindex import remaps  # noqa: E402
from napkin_cat.verify import kernelcheck  # noqa: E402
from napkin_cat.verify.check import REGIMES  # noqa: E402

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
FUZZ_EXAMPLES = 150 if PROFILE == "dev" else 14
SETTINGS = settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                    derandomize=PROFILE != "dev",
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large])

q, x, d, e, g, h, bb = nc.axes("q x d e g h bb")
a, b, c, r, t, f = nc.axes("a b c r t f")
L = nc.library
SAFE_UNARY = ("neg", "abs", "relu", "gelu", "silu", "sigmoid", "tanh", "scale", "shift", "square")
THREADS = (16, 32, 48, 64)
MICRO = (None, (1, 1), (2, 2), (1, 4), (4, 1), (3, 2))
PREFETCH = (False, True, "double", "auto")
REGIME_NAMES = ("normal", "jumps", "huge_one_sign", "repeated", "huge")


# --------------------------------------------------------------------------- families
# each returns (diagram, {axis name: role}) where role is "stream" (a reduced axis an
# accumulator can stream), "tile" (an output axis) or "weave" (batch/heads/groups)

def _unary_chain(draw, g_, w, n_max=2):
    for _ in range(draw(st.integers(0, n_max))):
        fn = draw(st.sampled_from(SAFE_UNARY))
        cval = draw(st.sampled_from((0.5, -1.25, 2.0))) if fn in ("scale", "shift") else None
        w = g_.map(fn, w, c=cval)
    return w


@st.composite
def attention_family(draw):
    causal = draw(st.booleans())
    window = draw(st.sampled_from((None, None, 1, 2, 3)))
    bias = draw(st.sampled_from((None, None, "input", nc.alibi(0.5))))
    weave = draw(st.sampled_from(("none", "heads", "batch", "gqa")))
    dv = draw(st.booleans())
    kw = dict(causal=causal, window_size=window, bias=bias, dv=e if dv else None)
    if weave == "heads":
        kw["heads"] = h
    elif weave == "batch":
        kw.update(heads=h, batch=bb)
    elif weave == "gqa":
        kw.update(groups=g, heads=h)
    diagram = L.attention(q=q, x=x, d=d, **kw)
    return f"attention({weave}, causal={causal}, window={window}, bias={bias}, dv={dv})", diagram, \
        {"x": "stream", "q": "tile"}


@st.composite
def score_chain_family(draw):
    """contract -> elementwise chain -> softmax -> contract -> elementwise epilogue."""
    g_ = nc.Builder(nc.f32)
    Q, K, V = g_.input("Q", q, d), g_.input("K", x, d), g_.input("V", x, e)
    S = _unary_chain(draw, g_, g_.contract(Q, K, out=(q, x), name="S"))
    if draw(st.booleans()):
        S = g_.mask(S, q, x, nc.causal(draw(st.integers(-1, 2))))
    O = _unary_chain(draw, g_, g_.contract(g_.softmax(S, x), V, out=(q, e), name="O"))
    return "score_chain", g_.diagram(O, names=["O"]), {"x": "stream", "q": "tile"}


@st.composite
def matmul_family(draw):
    g_ = nc.Builder(nc.f32)
    A, B = g_.input("A", a, b), g_.input("B", b, c)
    bias = g_.input("Bias", c) if draw(st.booleans()) else None
    C = g_.contract(A, B, out=(a, c), name="C")
    if bias is not None:
        C = g_.map("add", C, bias, out=(a, c))
    C = _unary_chain(draw, g_, C)
    return "matmul_chain", g_.diagram(C, names=["C"]), {"b": "stream", "a": "tile", "c": "tile"}


@st.composite
def reduction_family(draw):
    g_ = nc.Builder(nc.f32)
    X = _unary_chain(draw, g_, g_.input("X", r, c))
    op = draw(st.sampled_from(nc.ops.REDUCTIONS))
    Y = _unary_chain(draw, g_, g_.reduce(op, X, c))
    return f"reduce({op})", g_.diagram(Y, names=["Y"]), {"c": "stream", "r": "tile"}


@st.composite
def library_family(draw):
    name = draw(st.sampled_from(("softmax", "layernorm", "rmsnorm", "l2_attention", "l1_attention",
                                 "sigmoid_sum_attention", "mlp", "linear", "batched_matmul")))
    if name == "softmax":
        return name, L.softmax(r=r, c=c), {"r": "tile"}
    if name in ("layernorm", "rmsnorm"):
        return name, getattr(L, name)(t=t, d=d), {"t": "tile"}
    if name.endswith("_attention"):
        kind = name[: -len("_attention")]
        return name, L.normalized_attention(q=q, x=x, d=d, kind=kind), {"x": "stream", "q": "tile"}
    if name == "mlp":
        return name, L.mlp(t=t, d=d, h=f), {"f": "stream", "t": "tile"}
    if name == "linear":
        return name, L.linear(t=t, i=r, o=c), {"r": "stream", "t": "tile", "c": "tile"}
    return name, L.batched_matmul(batch=bb, a=a, b=b, c=c), {"b": "stream", "a": "tile", "c": "tile"}


@st.composite
def fused_attention_family(draw):
    """Attention relabelled the way the fused-scores path needs (states in registers, tiles and
    chunks of 4 or 8, d = 4): the path the GPU kernels take, on ragged sizes."""
    label, diagram, _ = draw(attention_family())
    steps = (("stream", "x", draw(st.sampled_from((4, 8)))), ("tile", "q", draw(st.sampled_from((4, 8)))),
             ("place", "O", "registers"))
    return "fused " + label, diagram, {"x": "stream", "q": "tile", "d": "size 4", "e": "size 4"}, steps


@st.composite
def tensor_core_family(draw):
    """fp16 / bf16 attention and matmul relabelled onto whole m16n8k16 fragments (tiles and
    chunks of 16 or 32, d = 16), ragged sizes: the tensor-core engine (simulated fragments);
    fp32 ones lowered with fp32="3xtf32" (3xTF32 fragments, fuzz_one)."""
    dt = draw(st.sampled_from((nc.f16, nc.bf16, nc.f32)))
    if draw(st.sampled_from((False, False, True)), label="warpgroups"):
        dt = nc.f16 if dt is nc.f32 else dt    # warpgroups multiply 16-bit operands only
        # lowered with planner.WGMMA (fuzz_one): row tiles of 64 on one warpgroup (128 threads) or
        # of 128 on two (256 threads, where a copying warpgroup may join: lowering/producer.py)
        rows = draw(st.sampled_from((64, 128)))
        causal = draw(st.booleans())
        weave = draw(st.sampled_from(("none", "heads", "gqa")))
        kw = dict(causal=causal, dtype=dt, dv=e if draw(st.booleans()) else None)
        kw.update({"heads": dict(heads=h), "gqa": dict(groups=g, heads=h)}.get(weave, {}))
        steps = (("stream", "x", draw(st.sampled_from((16, 32)))), ("tile", "q", rows), ("place", "O", "registers"))
        return (f"wg{rows} {dt.name} attention({weave}, causal={causal})", L.attention(q=q, x=x, d=d, **kw),
                {"x": "stream", "q": "tile", "d": "size 16", "e": "size 32"}, steps)
    if draw(st.sampled_from(("attention", "attention", "matmul"))) == "attention":
        causal = draw(st.booleans())
        bias = draw(st.sampled_from((None, nc.alibi(0.5))))
        weave = draw(st.sampled_from(("none", "heads", "gqa")))
        dv = draw(st.booleans())
        kw = dict(causal=causal, bias=bias, dv=e if dv else None, dtype=dt)
        kw.update({"heads": dict(heads=h), "gqa": dict(groups=g, heads=h)}.get(weave, {}))
        steps = [("stream", "x", draw(st.sampled_from((16, 32)))), ("tile", "q", draw(st.sampled_from((16, 32))))]
        if draw(st.booleans()):
            steps.append(("place", "O", "registers"))
        return (f"{dt.name} attention({weave}, causal={causal}, bias={bias}, dv={dv})",
                L.attention(q=q, x=x, d=d, **kw), {"x": "stream", "q": "tile", "d": "size 16", "e": "size 32"},
                tuple(steps))
    steps = [("stream", "b", draw(st.sampled_from((16, 32)))), ("tile", "a", draw(st.sampled_from((16, 32)))),
             ("tile", "c", draw(st.sampled_from((8, 16, 24))))]
    if draw(st.booleans()):
        steps.append(("place", "C", "registers"))
    return f"{dt.name} matmul", L.matmul(a=a, b=b, c=c, dtype=dt), {"b": "stream", "a": "tile", "c": "tile"}, \
        tuple(steps)


FAMILIES = {"attention": attention_family, "fused_attention": fused_attention_family, "score_chain": score_chain_family, "matmul": matmul_family,
            "reduction": reduction_family, "library": library_family, "tensor_core": tensor_core_family}

# mappings each family must reach across its examples (the generator's thread mappings:
# napkin_cat.lowering.plan Micro / Flat / Coop / Rows and fused scores)
EXPECTED_MAPPINGS = {"attention": {"micro", "group-reduction", "ragged-chunk"}, "fused_attention": {"fused-scores", "prescale", "deferred-row-sum"},
                     "score_chain": {"micro"}, "matmul": {"micro", "flat"}, "reduction": {"flat"},
                     "library": {"micro"},
                     "tensor_core": {"fragments", "mma-registers", "ldmatrix", "ldmatrix-trans", "cp.async",
                                     "cp.async-pipeline", "packed-operand", "wgmma", "wgmma-scale-d-0",
                                     "wgmma-accumulate", "copying-warpgroup", "named-hand-over",
                                     "hoisted-fragments", "tf32x3",
                                     "ldmatrix-b-pair", "ldmatrix-b-single", "strided-copies",
                                     "deferred-row-sum"}}


# --------------------------------------------------------------------------- one example

@st.composite
def relabelled(draw, family):
    label, base, roles, *fixed = draw(FAMILIES[family]())
    if fixed:
        return label, base, fixed[0], roles
    steps = []
    names = {ax.name for ax in base.axes}
    streams = [n for n, role in roles.items() if role == "stream" and n in names]
    tiles = [n for n, role in roles.items() if role == "tile"]
    for n in streams:
        if draw(st.booleans()) or not tiles:
            steps.append(("stream", n, draw(st.integers(1, 5))))
    for n in tiles:
        choice = draw(st.sampled_from(("tile", "tile", "stream", "none")))
        if choice != "none":
            steps.append((choice, n, draw(st.integers(1, 7))))
    if steps and draw(st.booleans()):   # accumulator states in registers: the fused-scores path
        steps.append(("place", base.cod[0].name, "registers"))
    return label, base, tuple(steps), roles


def _apply(diagram, steps):
    for op, what, arg in steps:
        diagram = getattr(diagram, op)(what, arg)
    return diagram


def _sizes(draw, diagram, steps, roles):
    blocks = {axis: size for op, axis, size in steps if op != "place"}
    sizes = {}
    for ax in diagram.axes:
        if roles.get(ax.name, "").startswith("size "):
            sizes[ax] = int(roles[ax.name].split()[1])
            continue
        if ax.name not in roles:   # features, heads, batch, groups: small (the simulator is slow)
            sizes[ax] = draw(st.integers(1, 4), label=ax.name)
            continue
        blk = blocks.get(ax.name)
        top = 9 if blk is None else max(9, min(6 * blk - 1, 20))
        low_many = min(3 * blk + 1, top) if blk else 1
        sizes[ax] = draw(st.one_of(st.integers(1, top), st.integers(low_many, top)), label=ax.name)
    return sizes


# mapping descriptions of napkin_cat.lowering.plan (Micro, Flat, Coop, Rows) -> feature name
MAPPING_WORDS = {"register micro-tiles": "micro", "per thread": "flat", "lanes each": "lanes",
                 "row statistics": "rows"}


def column_arrays(body: str):
    """``(name, its declaration, its first read)`` of each column-values array in a kernel's
    ``body`` (:mod:`napkin_cat.lowering.column_values`)."""
    for m in re.finditer(r"(\w+_cols\d*) = cuda\.local\.array", body):
        read = re.search(rf"[^\w]{m[1]}\[j\](?! =)", body[m.end():])
        yield m[1], m.start(), m.end() + read.start()


def _features(kernel) -> set[str]:
    """The thread mappings a kernel uses, its fused-scores path and its chunk loops, and the
    generator paths of :mod:`test_kernel_fuzz_paths`: reindexings read through their index maps
    (``reindex``; ``reindex-predicate`` where the map can leave the input), a gather kernel of a
    multi-kernel cut, atomic adds of partial sums, a logsumexp read from an online softmax's
    statistics, a materialised 16-bit operand buffer, a value kept in registers for a later
    epilogue (``register-copy``) or read from them as tensor-core A fragments (``frag-operand``),
    A fragments of a loop-invariant input read once before a stream loop (``hoisted-fragments``),
    a bias's row terms dropped before lowering (``row-terms``), column values read before the
    wait of the warpgroup contraction whose epilogue reads them (``columns-before-wait``), a
    stream loop's chunks copied by the tensor memory accelerator (``tma``).
    A multi-kernel: its kernels' features; a kernel whose block tables are derived per launch
    (``derived-table``): its inner kernel's."""
    if isinstance(kernel, MultiKernel):
        return {"multi-kernel"}.union(*(_features(k) for k in kernel.kernels))
    if isinstance(kernel, TabledKernel):   # lowering/tabled.py: the kernel of the blocked mask, tables derived
        return {"derived-table"} | _features(kernel.inner)
    if is_gather(kernel.diagram):
        return {"gather-kernel"}
    out = {feat for desc in kernel.mappings.values() for words, feat in MAPPING_WORDS.items() if words in desc}
    body = kernel.source.split("@cuda.jit(fastmath")[-1]
    if "_group_" in body:
        out.add("group-reduction")
    if "len_" in kernel.source:
        out.add("ragged-chunk")
    if "warp-private" in kernel.source:
        out.add("fused-scores")
    if any(remaps(eq.box) for eq in kernel.diagram.eqns):
        out.add("reindex")
        if "pos_" in body:
            out.add("reindex-predicate")
    if kernel.zero_args and ("cuda.atomic.add(" in body or "red_add2(" in body):
        out.add("atomic")
    for marker, feat in (("tensor-core fragments", "fragments"), ("weights stay in registers", "mma-registers"),
                         ("ldsm_x4(", "ldmatrix"), ("_t(smem16", "ldmatrix-trans"), ("cp_async16(", "cp.async"),
                         ("cp_async16_f32(", "cp.async-f32"), ("red_add2(", "paired-atomic"),
                         ("st_pair16(", "paired-global"),
                         ("cp_async_wait1()", "cp.async-pipeline"), ("pack_f16(smem", "packed-operand"),
                         ("pack_f16((smem", "packed-operand"), ("pack_bf16(smem", "packed-operand"),
                         ("pack_bf16((smem", "packed-operand"), ("written out row by row", "fragment-rows"),
                         ("C_PRESCALE_LOG2E", "prescale"), ("wgmma_f16_n", "wgmma"), ("wgmma_bf16_n", "wgmma"),
                         ("mma_tf32x3(", "tf32x3"), ("bulk_add_f32(", "staged-add")):
        if marker in body or marker in "".join(kernel.mappings.values()):
            out.add(feat)
    if any("= wgmma_wait" in body[start:read] for _, start, read in column_arrays(body)):   # column_values.BEFORE_WAIT
        out.add("columns-before-wait")
    if any("dropped before the softmax" in n for n in kernel.notes):   # relabel/row_terms.py
        out.add("row-terms")
    # the generator's notes in the kernel's docstring: L = mu + log z of the online softmax;
    # a shared buffer "(materialised, 16-bit, ...)" in the shared-memory line
    if "row statistics (L = mu + log z)" in kernel.source:
        out.add("lse-from-stats")
    if "(materialised, 16-bit" in kernel.source:
        out.add("16-bit-operand")
    if "the copying warpgroup: copies every chunk" in body:   # lowering/producer.py
        out.add("copying-warpgroup")
        out.add("named-hand-over" if "bar_arrive(" in body else "block-hand-over")
        copying = body[:body.index("setmaxnreg_inc_")] if "setmaxnreg_inc_" in body else body
        if "_kept" in copying:       # ... which visits the chunks no block table masks whole
            out.add("copying-table")
        if "_ahead = " in copying:   # ... over three buffers, chunk c + 2 issued at chunk c (producer.STAGES)
            out.add("three-buffers")
        if "issued_" in copying:     # ... over three buffers, chunks a table skips (producer._staged_copies)
            out.add("three-buffers-table")
        if "tma_load" in copying:    # ... by tensor copies into swizzled panels (lowering/tma.py)
            out.add("tma")
            if "_kept" in copying:   # ... of the chunks a block table keeps
                out.add("tma-table")
    if "bar_named(uint32(1), NTHREADS)  # the computing threads" in body:   # ... their own barriers
        out.add("computing-barrier")
    if re.search(r"wgmma_b?f16_n\d+_ss(_z)?\(smem16", body):   # wgmma.shared_a_buffer: A by descriptor too
        out.add("wgmma-shared-a")
    if re.search(r"wgmma_wait[1-9]_n\d+\(", body):   # lowering/issue_ahead.py: a later contraction issued early
        out.add("issued-ahead")
    if "_z(smem16" in body:                        # wgmma.emit_wgmma: a fresh accumulator's first step
        out.add("wgmma-scale-d-0")
    if re.search(r"wgmma_b?f16_n\d+\(smem16", body):   # ... and the steps that add to it
        out.add("wgmma-accumulate")
    if "Registers: the tensor-core fragments of" in kernel.source:   # emit_mma.hoisted_fragments
        out.add("hoisted-fragments")
    if re.search(r"int64\(\w+0\) // \d", body):     # emit_kinds.block_quotients
        out.add("block-quotient")
    if re.search(r"_r = cuda\.local\.array\(.*# \w+ kept for \w+(,|$)", body, re.M):   # lowering/register_copies.py
        out.add("register-copy")
    if re.search(r"pack_(b?f16|tf32x3)\(\w+_r\[", body):   # lowering/frag_operands.py: A fragments from registers
        out.add("frag-operand")
    if re.search(r"b\w+, b\w+, b\w+, b\w+ = ldsm_x4", body):   # emit_mma.LdMatrix.b_tile: two column tiles by one .x4
        out.add("ldmatrix-b-pair")
    if re.search(r"b\w+, b\w+ = ldsm_x2", body):                 # ... or one by .x2 (an odd count of column tiles)
        out.add("ldmatrix-b-single")
    if "# the same every step" in body:                         # emit_loads._decode_strided
        out.add("strided-copies")
    if "each lane's part summed over the row's lanes" in body:   # emit_states.sum_deferred_z
        out.add("deferred-row-sum")
    if re.search(r"_(end|begin) = .*// U\d+(, U1\) - U1| \+ U1)?\) \* U\d+", body):   # index_support._quotients
        out.add("quotient-bound")
    if "the mask keeps the whole chunk: its arithmetic is skipped" in body:   # emit_loads._chunk_flags
        out.add("skipped-arithmetic")
    if "the masks keep the whole chunk: its elements without them" in body:   # lowering/unswitch.py
        out.add("unswitched")
    if "holds over the whole chunk" in body:   # unswitch._by_value: a partial chunk by its table entry's value
        out.add("table-versions")
    if "entries of the table over the tile and chunk" in body:   # emit_tables._spanned_entries
        out.add("table-entries")
    if "this warp's rows lie inside one block" in body:   # unswitch._warp_entries: an entry per warp
        out.add("warp-entries")
    if "static count: read in loops" in body:   # emit_tables._block_atom: the blocks in loops
        out.add("table-loops")
    if "the block table masks such a chunk whole: the loop skips it" in body:   # ... none for a skipped one
        out.add("table-version-skipped")
    if len(re.findall(r"# stream \w+ in chunks of", body)) >= 2:   # loopnest._updates_per_chunk: GQA's dK
        out.add("nested-streams")
        if "chunks are masked for every" in body:   # skipping.chunk_skips: a sum over both streams' axes
            out.add("nested-skip")
    if "stays in global memory: its gathers read it in place" in body:   # emit_kinds.aux_read
        out.add("aux-in-place")
        tables = re.findall(r"# (\w+)\[[^\]]*\] \w+ stays in global memory", body)
        if any(re.search(rf"(_entry = |if )(\w+\()?{t}\[", body) for t in tables):   # emit_loads._block_atom
            out.add("aux-in-place-table")
    if re.search(r"(_entry = |if ).*\(uint32\(min\(\w+0, U\d+\)\) \* N_", body):   # emit_loads._lead_entry
        out.add("batch-table")
    if re.search(r"(_entry = |if ).*\(uint32\(min\(max\(\(\(int64\(h0\) \* \d+\) \+ int64\(g0\)\)", body):
        out.add("grouped-table")                  # ... a lead expression: the query head h * G + g
    if "per column of this thread" in body:                     # column_values.column_value
        out.add("column-values")
    if re.search(r"smem32\[.*\] = pack_b?f16\(\w+_pair\[0\]", body):   # paired_stores.stored_pair
        out.add("paired-store")
    return out


@contextlib.contextmanager
def planner_switches(**values):
    """Planner tunables (napkin_cat.lowering.planner) set for one lowering, then restored."""
    from napkin_cat.lowering import planner
    old = {k: getattr(planner, k) for k in values}
    for k, v in values.items():
        setattr(planner, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(planner, k, v)


@contextlib.contextmanager
def module_setting(module, name: str, value):
    """``module.<name>`` set for one lowering, then restored."""
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def producer_setting(name: str, value):
    """``napkin_cat.lowering.producer.<name>`` set for one lowering, then restored."""
    from napkin_cat.lowering import producer
    return module_setting(producer, name, value)


def hand_over(mode: str):
    """The copying warpgroup's hand-over (``producer.HAND_OVER``) for one lowering."""
    return producer_setting("HAND_OVER", mode)


def producer_switch(on: bool):
    """``producer.SWITCH`` for one lowering."""
    return producer_setting("SWITCH", on)


def fuzz_one(family: str, data, stats: Counter):
    label, base, steps, roles = data.draw(relabelled(family), label="diagram")
    try:
        rel = _apply(base, steps)
    except nc.RelabelError as err:
        stats["relabel refused"] += 1
        note(f"relabel refused: {err}")
        assume(False)
    sizes = _sizes(data.draw, base, steps, roles)
    threads = {"fused_attention": (16, 32), "tensor_core": (32, 64)}.get(family, THREADS)
    wg_rows = re.match(r"wg(\d+) ", label)      # tensor_core_family's warpgroup cases: 16 rows a warp
    warpgroups = wg_rows is not None
    threads = (2 * int(wg_rows.group(1)),) if warpgroups else threads
    opts = {"threads": data.draw(st.sampled_from(threads), label="threads"),
            "micro": data.draw(st.sampled_from(MICRO if family in ("attention", "score_chain", "matmul",
                                                                  "reduction", "library") else (None,)),
                               label="micro"),
            "prefetch": data.draw(st.sampled_from(PREFETCH), label="prefetch")}
    # lowering/producer.py: with two computing warpgroups and two cp.async buffers, mostly with one
    copying = warpgroups and threads[0] >= 256 and data.draw(st.sampled_from((True, True, False)),
                                                              label="copying warpgroup")
    mode = "named"
    if copying:
        opts["prefetch"] = data.draw(st.sampled_from(("double", "auto")), label="prefetch (copying)")
        mode = data.draw(st.sampled_from(("named", "named", "block")), label="hand-over")
    regime = data.draw(st.sampled_from(REGIME_NAMES), label="regime")
    seed = data.draw(st.integers(0, 2 ** 16), label="seed")
    bound = rel.bind(sizes)
    note(f"{label}: {bound}  lower({opts})")
    try:
        with planner_switches(WGMMA=warpgroups), producer_switch(copying), hand_over(mode):
            kernel = nc.lower(bound, verify=False, fp32="3xtf32" if label.startswith("f32") else "fma", **opts)
    except nc.LoweringError as err:
        stats["lowering refused"] += 1
        stats["refusal: " + str(err).split(":")[0][:60]] += 1
        return
    rng = np.random.default_rng(seed)
    oracle = base.bind(sizes)
    inputs = [REGIMES[regime][0](rng, tuple(ax.size for ax in arr.axes)) for arr in oracle.dom]
    diff = kernelcheck.kernel_outcome(oracle, kernel, inputs)
    stats["kernels"] += 1
    stats["streams x%d" % sum(op == "stream" for op, _, _ in steps)] += 1
    stats["non-power-of-two block"] += any(s & (s - 1) for op, _, s in steps if op != "place")
    stats["placed in registers"] += any(op == "place" for op, _, _ in steps)
    stats["prefetch=" + str(opts["prefetch"])] += 1
    for feat in _features(kernel):
        stats["mapping " + feat] += 1
    assert diff.failure is None, (f"{label}: kernel differs from the oracle: "
                                  f"{kernelcheck.describe_failure(diff.failure)}\n{kernel!r}\nsource:\n"
                                  + kernel.source)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_kernel_fuzz_matches_oracle(family):
    stats: Counter = Counter()

    @SETTINGS
    @given(st.data())
    def run(data):
        fuzz_one(family, data, stats)

    run()
    print(f"\nkernel fuzz {family}: {dict(stats)}")
    assert stats["kernels"] >= FUZZ_EXAMPLES // 2, f"too few kernels generated for {family}: {dict(stats)}"
    reached = {k.split()[1] for k in stats if k.startswith("mapping ")}
    missing = EXPECTED_MAPPINGS[family] - reached
    assert not missing, f"{family}: the fuzzer reached no {missing} mapping: {dict(stats)}"


# --------------------------------------------------------------------------- the bugs it found

def _split_sum():
    g_ = nc.Builder(nc.f32)
    return g_.diagram(g_.reduce("sum", g_.map("shift", g_.input("X", r, c), c=1.5), c, name="Y"), names=["Y"])


def _split_two_axes():
    g_ = nc.Builder(nc.f32)
    A, B = g_.input("A", a, b, f), g_.input("B", b, f, c)
    return g_.diagram(g_.contract(g_.map("shift", A, c=1.5), g_.map("shift", B, c=1.5), out=(a, c), name="C"),
                      names=["C"])

REGRESSIONS = {
    # spare threads of a non-power-of-two tile clamped onto its last row raced on the scores
    "tile_not_power_of_two": (L.attention(q=q, x=x, d=d), lambda dg: dg.stream(x, 4).tile(q, 3),
                              {q: 6, x: 8, d: 4}, {}),
    "automatic_odd_sizes": (L.attention(q=q, x=x, d=d), lambda dg: dg, {q: 3, x: 11, d: 3}, {}),
    # thread counts the mapping cannot use were accepted and wrong
    "threads_48": (L.attention(q=q, x=x, d=d), lambda dg: dg.stream(x, 4).tile(q, 4), {q: 8, x: 8, d: 4},
                   {"threads": 48}),
    # nested streams lowered to garbage
    "nested_streams_matmul": (L.matmul(a=a, b=b, c=c), lambda dg: dg.stream(b, 2).stream(a, 2),
                              {a: 4, b: 4, c: 4}, {}),
    "nested_streams_attention": (L.attention(q=q, x=x, d=d), lambda dg: dg.stream(x, 4).stream(q, 2),
                                 {q: 4, x: 8, d: 4}, {}),
    # a sum over a split axis (tile(..., partial="sum")) ran over the whole ragged last tile: the
    # padding's shift(0) = 1.5 was added in (test_kernel_fuzz_paths, split_reduction)
    "split_sum_ragged_tile": (_split_sum(), lambda dg: dg.tile(c, 3, partial="sum"), {r: 3, c: 7}, {}),
    # the same for a contraction summed over two axes, one of them split, by a group of lanes
    "split_two_summed_axes": (_split_two_axes(), lambda dg: dg.tile(b, 3, partial="sum"),
                              {a: 1, b: 7, f: 5, c: 1}, {}),
}


@pytest.mark.parametrize("case", sorted(REGRESSIONS))
def test_kernel_regression_correct_or_refused(case):
    """Each wrong kernel the fuzzer found: now a correct kernel (checked through the public
    ``check_equivalent(oracle, kernel)``) or a LoweringError that names the problem."""
    base, relabel, sizes, opts = REGRESSIONS[case]
    try:
        kernel = nc.lower(relabel(base).bind(sizes), verify=False, **opts)
    except nc.LoweringError as err:
        assert any(s in str(err) for s in ("threads", "stream", "nested")), str(err)
        return
    report = nc.check_equivalent(base, kernel, examples=6)
    assert report.kernels == 6


def test_split_backward_sums_dq_over_the_ragged_key_tile_only():
    """The same bug in dQ of the one-kernel backward (found by test_kernel_fuzz_paths): dS summed
    past the ragged key tile (x = 3 in tiles of 2), where the padded keys give P = exp(0 - L),
    inf for rows whose scores are all below -88, and inf * 0 = NaN.  The residuals O and L are
    the forward's: random ones seldom make a row that negative."""
    sizes = {q: 2, x: 3, d: 2}
    fwd = L.attention(q=q, x=x, d=d, logsumexp=True)
    bwd = nc.grad_with_residuals(fwd, wrt=["Q", "K", "V"])
    kernel = nc.lower(bwd.tile(x, 2, partial="sum").stream(q, 2).bind(sizes), verify=False)
    rng = np.random.default_rng(0)
    Q, K = 10 + rng.standard_normal((2, 2)), -10 + rng.standard_normal((3, 2))
    V, dO = rng.standard_normal((3, 2)), rng.standard_normal((2, 2))
    O, lse = nc.evaluate(fwd.bind(sizes), Q, K, V)
    assert lse.max() < -88
    diff = kernelcheck.kernel_outcome(bwd.bind(sizes), kernel, [Q, K, V, O, lse, dO])
    assert diff.failure is None, kernelcheck.describe_failure(diff.failure)
