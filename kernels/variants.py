"""Build, check and time a few code-generator variants in one GPU call (fp32).

    python kernels/variants.py [--out DIR] [--only attention|matmul|flex]

Each variant is (diagram, tiles, prefetch, planner switches); every kernel is checked against a
float64 reference on random inputs before it is timed, and PyTorch's SDPA / cuBLAS are timed in
the same run.  Prints a table last and writes variants.json to ``--out`` (``$OUT`` on the device).

``--only flex``: attention variants written as data (issue 11: relative bias, per-head ALiBi, block-causal, prefix-LM, NATTEN, GQA (causal, and with a window of each query head read from a table of each query head; the same windows without groups),
sliding window, block-diagonal, document mask, the document mask with its block table
(``nc.blocked`` / ``nc.block_table``: data-dependent tile skipping), soft-cap; ``FLEX`` below),
N = 4096, d = 64, B * H = 32, each in fp32 (CUDA cores) and in fp16 (tensor cores, the mma
engine; ``--dtypes``), each against FlexAttention compiled with the block mask it would use on
inputs of the same dtype, SDPA dense as a yardstick.  One definition per variant: the
napkin_cat diagram is built from the same Python functions FlexAttention receives.

    python kernels/variants.py --only flex --dtypes f32,f16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering import planner  # noqa: E402
from bench import compiled_flex, cuda_time, device_ms, reference_rows, rel_err  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
DEV = "cuda"
SWITCHES = ("CONTRACTION_UNROLL", "FUSE_SCORES", "REGISTER_FLOOR", "REGISTER_SLACK", "TRANSPOSE_PAD")

ATT = [  # (d, causal, tiles, prefetch, switches)
    (64, False, {"q": 128, "x": 64}, False, {"CONTRACTION_UNROLL": 8}),
    (64, False, {"q": 128, "x": 64}, False, {"CONTRACTION_UNROLL": 8, "TRANSPOSE_PAD": 0}),
    (64, False, {"q": 256, "x": 32}, False, {"CONTRACTION_UNROLL": 8}),
    (64, False, {"q": 256, "x": 32}, False, {"CONTRACTION_UNROLL": 4}),
    (64, False, {"q": 256, "x": 64}, False, {"CONTRACTION_UNROLL": 8}),
    (64, False, {"q": 128, "x": 32}, False, {"CONTRACTION_UNROLL": 8}),
    (64, False, {"q": 128, "x": 64}, "double", {"CONTRACTION_UNROLL": 8}),
    (64, True, {"q": 128, "x": 64}, False, {"CONTRACTION_UNROLL": 8}),
    (64, True, {"q": 256, "x": 32}, False, {"CONTRACTION_UNROLL": 8}),
    (128, False, {"q": 128, "x": 32}, False, {"CONTRACTION_UNROLL": 8}),
    (128, False, {"q": 128, "x": 64}, False, {"CONTRACTION_UNROLL": 8}),
    (128, False, {"q": 128, "x": 32}, "double", {"CONTRACTION_UNROLL": 8}),
    (128, True, {"q": 128, "x": 32}, False, {"CONTRACTION_UNROLL": 8}),
]
MM = [
    ({"a": 128, "c": 128, "b": 8}, True, {"CONTRACTION_UNROLL": 8}),
    ({"a": 128, "c": 128, "b": 8}, True, {"CONTRACTION_UNROLL": 8, "REGISTER_FLOOR": 255}),
    ({"a": 128, "c": 128, "b": 8}, "double", {"CONTRACTION_UNROLL": 8}),
    ({"a": 128, "c": 128, "b": 8}, False, {"CONTRACTION_UNROLL": 8}),
    ({"a": 128, "c": 128, "b": 16}, "double", {"CONTRACTION_UNROLL": 8, "REGISTER_FLOOR": 255}),
    ({"a": 128, "c": 128, "b": 16}, True, {"CONTRACTION_UNROLL": 8, "REGISTER_FLOOR": 255}),
    ({"a": 128, "c": 128, "b": 16}, False, {"CONTRACTION_UNROLL": 8}),
    ({"a": 128, "c": 128, "b": 8}, True, {"CONTRACTION_UNROLL": 8, "TRANSPOSE_PAD": 0}),
]


def with_switches(sw):
    old = {k: getattr(planner, k) for k in SWITCHES}
    for k, v in sw.items():
        setattr(planner, k, v)
    return old


def attention_variant(N, D, causal, BH, tiles, pf, sw, gen):
    B, H = 2, BH // 2
    q, x, d, h, b = nc.axes("q x d h b")
    dia = nc.library.attention(q=q, x=x, d=d, heads=h, batch=b, causal=causal).bind(
        {q: N, x: N, d: D, h: H, b: B})
    old = with_switches(sw)
    try:
        kernel = nc.lower(dia, tiles=tiles, threads=256, prefetch=pf)
    finally:
        with_switches(old)
    Q, K, V = (torch.randn(B, H, N, D, device=DEV, generator=gen) for _ in range(3))
    O = torch.full_like(Q, float("nan"))
    run = kernel.prepare(Q, K, V, out=O)
    run()
    torch.cuda.synchronize()
    rows = torch.randperm(N, device=DEV, generator=gen)[:128].sort().values
    err = rel_err(O[:, :2, rows], reference_rows(Q, K, V, causal, 1 / math.sqrt(D), rows, 2))
    assert not torch.isnan(O).any()
    ms = cuda_time(run)
    flops = 4 * B * H * N * N * D * (0.5 if causal else 1.0)
    r = {"kind": "attention", "N": N, "d": D, "causal": causal, "tiles": tiles, "prefetch": pf,
         "switches": sw, "ms": ms, "tflops": flops / ms / 1e9, "rel_err": err,
         "smem": kernel.launch.dynamic_smem_bytes, "mappings": kernel.mappings}
    r.update(kernel.compiled_info())
    r["sdpa_ms"] = cuda_time(lambda: torch.nn.functional.scaled_dot_product_attention(Q, K, V, is_causal=causal))
    return r


def matmul_variant(M, tiles, pf, sw, gen):
    a, b, c = nc.axes("a b c")
    dia = nc.library.matmul(a=a, b=b, c=c).bind({a: M, b: M, c: M})
    old = with_switches(sw)
    try:
        kernel = nc.lower(dia, tiles=tiles, threads=256, prefetch=pf)
    finally:
        with_switches(old)
    A = torch.randn(M, M, device=DEV, generator=gen)
    Bm = torch.randn(M, M, device=DEV, generator=gen)
    C = torch.full((M, M), float("nan"), device=DEV)
    run = kernel.prepare(A, Bm, out=C)
    run()
    torch.cuda.synchronize()
    rows = torch.randperm(M, device=DEV, generator=gen)[:128]
    err = rel_err(C[rows], torch.matmul(A[rows].double(), Bm.double()))
    assert not torch.isnan(C).any()
    ms = cuda_time(run)
    r = {"kind": "matmul", "N": M, "tiles": tiles, "prefetch": pf, "switches": sw, "ms": ms,
         "tflops": 2 * M ** 3 / ms / 1e9, "rel_err": err, "smem": kernel.launch.dynamic_smem_bytes,
         "mappings": kernel.mappings}
    r.update(kernel.compiled_info())
    r["cublas_ms"] = cuda_time(lambda: torch.matmul(A, Bm))
    return r


# --------------------------------------------------------------------------- variants as data vs FlexAttention

FLEX_N, FLEX_D, FLEX_B, FLEX_H, WINDOW, BLOCK = 4096, 64, 2, 16, 256, 64
CHUNK, PREFIX, IMAGE, RADIUS, GROUPS = 256, 1024, 64, 3, 4   # block-causal chunk, prefix-LM prefix, NATTEN 64 x 64 image 7 x 7, GQA groups
TABLE_BLOCK = 128     # FlexAttention's default block size
FLEX_TILES = {"f32": ({"q": 128, "x": 64}, 256, False), "f16": (None, None, "auto")}
"""dtype -> (tiles, threads, prefetch): 16-bit kernels take ``nc.lower``'s own blocks and threads
(None: what a user gets; ``--tiles`` forces others) and ``prefetch="auto"`` (two cp.async buffers
per streamed input where registers and shared memory allow: ``planner.auto_prefetch``), as
``nc.torch_op`` does."""
TORCH_DT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _doc_ids(n, gen):
    """Packed documents of random lengths (at least 64 tokens each), sorted ids."""
    cpu = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=gen, device=gen.device)))
    cuts = torch.sort(torch.randperm(n // 64 - 1, generator=cpu)[:12] + 1).values * 64
    ids = torch.zeros(n, dtype=torch.int64)
    ids[cuts] = 1
    return torch.cumsum(ids, 0)


def flex_variants(gen):
    """name -> (napkin_cat keyword arguments from the aux tensors, flex score_mod, flex mask_mod,
    aux tensors by name, tensor work share); the same functions serve both."""
    H = FLEX_H
    slopes = torch.tensor([2.0 ** (-8.0 * (k + 1) / H) for k in range(H)], device=DEV)
    doc = _doc_ids(FLEX_N, gen).to(DEV)
    n_ax = nc.Axis("n", FLEX_N)
    nh = nc.Axis("nh", H)
    out = {"dense": (dict(), None, None, {})}     # the yardstick: the same kernel with no variant
    rel = lambda s, b, h, i, j: s + (i - j) * 0.01
    out["relative_bias"] = (dict(score_mod=rel), rel, None, {})
    sl = nc.aux("slope", nh)
    out["alibi_per_head"] = (dict(score_mod=lambda s, b, h, i, j: s + sl[h] * (j - i), causal=True),
                             lambda s, b, h, i, j: s + slopes[h] * (j - i),
                             lambda b, h, i, j: j <= i, {"slope": slopes})
    win = lambda b, h, i, j: (j <= i) & (i - j <= WINDOW)
    out["sliding_window"] = (dict(mask=win), None, win, {})
    blk = lambda b, h, i, j: i // BLOCK == j // BLOCK
    out["block_diagonal"] = (dict(mask=blk), None, blk, {})
    dd = nc.aux("doc", n_ax)
    doc_mask = nc.mask_mod(lambda b, h, i, j: (dd[i] == dd[j]) & (j <= i))
    out["document"] = (dict(mask=doc_mask), None,
                       lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i), {"doc": doc.float()})
    # the same mask reading its block table (computed once on the device, like create_block_mask)
    nb = -(-FLEX_N // TABLE_BLOCK)
    bt = nc.aux("bt", nc.Axis("rb", nb), nc.Axis("cb", nb))
    table = nc.block_table(doc_mask, FLEX_N, FLEX_N, TABLE_BLOCK, TABLE_BLOCK, {"doc": doc.float()})
    out["document_table"] = (dict(mask=nc.blocked(doc_mask, bt, TABLE_BLOCK, TABLE_BLOCK)), None,
                             lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i), {"doc": doc.float(), "bt": table})
    cap = 20.0
    out["softcap"] = (dict(softcap=cap, causal=True), lambda s, b, h, i, j: torch.tanh(s / cap) * cap,
                      lambda b, h, i, j: j <= i, {})
    # tiles skipped from the mask's definition alone (block quotients, no table)
    chunked = lambda b, h, i, j: i // CHUNK >= j // CHUNK
    out["block_causal"] = (dict(mask=chunked), None, chunked, {})
    prefix = lambda b, h, i, j: (j <= i) | (j < PREFIX)
    out["prefix_lm"] = (dict(mask=prefix), None, prefix, {})
    natten = lambda b, h, i, j: (abs(i // IMAGE - j // IMAGE) <= RADIUS) & (abs(i % IMAGE - j % IMAGE) <= RADIUS)
    out["natten"] = (dict(mask=natten), None, natten, {})
    # documents packed differently in each sequence: a block table per sequence
    docs = torch.stack([_doc_ids(FLEX_N, gen) for _ in range(FLEX_B)]).to(DEV)
    bd = nc.aux("doc", nc.Axis("nb", FLEX_B), n_ax)
    bdoc = nc.mask_mod(lambda b, h, i, j: (bd[b, i] == bd[b, j]) & (j <= i))
    bbt = nc.aux("bt", nc.Axis("nb", FLEX_B), nc.Axis("rb", nb), nc.Axis("cb", nb))
    btable = nc.block_table(bdoc, FLEX_N, FLEX_N, TABLE_BLOCK, TABLE_BLOCK, {"doc": docs.float()}, batch=FLEX_B)
    out["batch_documents"] = (dict(mask=nc.blocked(bdoc, bbt, TABLE_BLOCK, TABLE_BLOCK)), None,
                              lambda b, h, i, j: (docs[b, i] == docs[b, j]) & (j <= i),
                              {"doc": docs.float(), "bt": btable}, {"B": FLEX_B})
    # grouped-query heads: FLEX_H query heads share FLEX_H // GROUPS key/value heads
    out["gqa_causal"] = (dict(causal=True), None, lambda b, h, i, j: j <= i, {}, {"groups": GROUPS})
    # ... and a causal window of each query head's own width, a block table of each query head
    # (the query head h * G + g indexes it)
    widths = torch.arange(1, H + 1, device=DEV, dtype=torch.float32) * (FLEX_N // H)   # exact in 16 bits
    wq = nc.aux("wq", nh)
    head_win = nc.mask_mod(lambda b, h, i, j: (j <= i) & (i - j <= wq[h]))
    hbt = nc.aux("bt", nh, nc.Axis("rb", nb), nc.Axis("cb", nb))
    htable = nc.block_table(head_win, FLEX_N, FLEX_N, TABLE_BLOCK, TABLE_BLOCK, {"wq": widths}, heads=H)
    out["gqa_head_windows"] = (dict(mask=nc.blocked(head_win, hbt, TABLE_BLOCK, TABLE_BLOCK)), None,
                               lambda b, h, i, j: (j <= i) & (i - j <= widths[h]), {"wq": widths, "bt": htable},
                               {"groups": GROUPS, "H": H})
    # the same windows and table without groups: what the grouped heads add
    out["head_windows"] = (dict(mask=nc.blocked(head_win, hbt, TABLE_BLOCK, TABLE_BLOCK)), None,
                           lambda b, h, i, j: (j <= i) & (i - j <= widths[h]), {"wq": widths, "bt": htable},
                           {"H": H})
    # the same windows from their widths alone: the tables derived by the kernel (lowering/tabled.py)
    out["head_windows_derived"] = (dict(mask=head_win), None, lambda b, h, i, j: (j <= i) & (i - j <= widths[h]),
                                   {"wq": widths}, {"H": H})
    out["gqa_head_windows_derived"] = (dict(mask=head_win), None,
                                       lambda b, h, i, j: (j <= i) & (i - j <= widths[h]), {"wq": widths},
                                       {"groups": GROUPS, "H": H})
    return out


def _flex_reference(Q, K, V, score, mask, rows, heads):
    """float64 reference on some rows of some heads, from FlexAttention's own functions (``K``,
    ``V`` with as many heads as ``Q``)."""
    q = Q[:, :heads, rows].double()
    k, v = K[:, :heads].double(), V[:, :heads].double()
    S = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(Q.shape[-1])
    b = torch.arange(Q.shape[0], device=DEV)[:, None, None, None]
    h = torch.arange(heads, device=DEV)[None, :, None, None]
    i = rows[None, None, :, None]
    j = torch.arange(K.shape[-2], device=DEV)[None, None, None, :]
    if score is not None:
        S = score(S, b, h, i, j)
    if mask is not None:
        S = S.masked_fill(~mask(b, h, i, j), float("-inf"))
    return torch.matmul(torch.softmax(S, dim=-1), v)


def flex_variant(name, spec, gen, tiles=None, dt="f32", threads=None, prefetch=None):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    kw, score, mask, aux_tensors, flex_kw = (*spec, {})[:5]
    N, D, B, H = FLEX_N, FLEX_D, FLEX_B, FLEX_H
    G = flex_kw.get("groups", 1)      # query heads per key/value head
    q, x, d, h, b, g = nc.axes("q x d h b g")
    ndt = {"f32": nc.f32, "f16": nc.f16, "bf16": nc.bf16}[dt]
    grouped = dict(groups=g) if G > 1 else {}
    dia = nc.library.attention(q=q, x=x, d=d, heads=h, batch=b, dtype=ndt, **grouped, **kw).bind(
        {q: N, x: N, d: D, h: H // G, b: B, **({g: G} if G > 1 else {})})
    t, th, pf = FLEX_TILES.get(dt, FLEX_TILES["f16"])
    tiles, threads, prefetch = tiles or t, threads or th, pf if prefetch is None else prefetch
    chooser = nc.lower(dia, tiles=tiles, threads=threads, prefetch=prefetch, verify=False)
    Q = torch.randn(B, H, N, D, device=DEV, generator=gen).to(TORCH_DT[dt])
    K, V = (torch.randn(B, H // G, N, D, device=DEV, generator=gen).to(TORCH_DT[dt]) for _ in range(2))
    # auxiliary inputs in the dtype the diagram declares for them (16-bit in a 16-bit kernel)
    extra = [aux_tensors[a.name].to(TORCH_DT.get(a.dtype.name, torch.float32)).contiguous() for a in dia.dom[3:]]
    # query head kvh * G + g is Q[b, kvh, g]: a view, as napkin_cat's grouped diagram takes it
    inputs = (Q.view(B, H // G, G, N, D) if G > 1 else Q, K, V, *extra)
    # two forms chosen at each launch from their tables (lowering/tabled.py, TableChoice): the one these inputs run
    kernel = chooser.chosen(*inputs)[0] if hasattr(chooser, "forms") else chooser
    tiles = {r.axis: r.size for r in kernel.diagram.schedule if r.op in ("tile", "stream") and r.axis in ("q", "x")}
    inner = getattr(kernel, "inner", kernel)   # a TabledKernel's options say the user's threads (None: its own)
    threads = kernel.options.get("threads") or inner.options.get("threads") or kernel.launch.block[0]   # what it runs
    O = torch.full_like(Q, float("nan"))
    out = O.view(B, H // G, G, N, D) if G > 1 else O
    run = chooser.prepare(*inputs, out=out)
    run()
    torch.cuda.synchronize()
    rows = torch.randperm(N, device=DEV, generator=gen)[:128].sort().values
    ref = _flex_reference(Q, K.repeat_interleave(G, 1), V.repeat_interleave(G, 1), score, mask, rows, 2)
    err = rel_err(O[:, :2, rows], ref)
    assert not torch.isnan(O).any()
    ms = cuda_time(run)
    bm = (create_block_mask(mask, B=flex_kw.get("B"), H=flex_kw.get("H"), Q_LEN=N, KV_LEN=N, device=DEV)
          if mask is not None else None)
    flex = compiled_flex()
    gqa = dict(enable_gqa=True) if G > 1 else {}
    fo = flex(Q, K, V, score_mod=score, block_mask=bm, **gqa)
    flex_err = rel_err(fo[:, :2, rows], ref)
    flex_ms = cuda_time(lambda: flex(Q, K, V, score_mod=score, block_mask=bm, **gqa))
    # kernel time alone (CUPTI), both sides: FlexAttention's host work per call (guards, the block
    # mask's arguments) can outlast a short kernel, and then the events above time the host
    kernel_ms, flex_kernel_ms = device_ms(run), device_ms(lambda: flex(Q, K, V, score_mod=score, block_mask=bm, **gqa))
    dense = 4 * B * H * N * N * D
    data = {"bt": aux_tensors["bt"].cpu().numpy()} if "bt" in aux_tensors else None
    costed = dia.stream("x", tiles["x"]).tile("q", tiles["q"])
    derived = {}
    if hasattr(kernel, "tables"):   # a mask that reads data: its block table derived per launch (lowering/tabled.py)
        tables = kernel.derive(*inputs)
        data, costed = {t.name: v.cpu().float().numpy() for t, v in zip(kernel.tables, tables)}, kernel.inner.diagram
        # what a call that derives its table costs (auxiliary tensors it has not seen: the tables
        # of tensors it has seen are kept, lowering/tabled.py): the tables alone, and the whole call
        from napkin_cat.lowering.table_kernel import make_table
        derived = {"table_ms": cuda_time(lambda: [t.values(inputs) for t in kernel.tables]),
                   "table_kernel_ms": cuda_time(lambda: [make_table(t, inputs) for t in kernel.tables]),
                   "call_ms": cuda_time(lambda: chooser(*inputs[:3], *(a.clone() for a in inputs[3:]), out=out)),
                   "kept_call_ms": cuda_time(lambda: chooser(*inputs, out=out)),
                   "table_blocks": [kernel.tables[0].rows, kernel.tables[0].cols],
                   # the peer's own table, made the same way each call
                   "flex_block_mask_ms": cuda_time(lambda: create_block_mask(
                       mask, B=flex_kw.get("B"), H=flex_kw.get("H"), Q_LEN=N, KV_LEN=N, device=DEV))}
    share = float(nc.cost(costed, data=data).flops["tensor"]) / dense
    r = {"kind": "flex", "variant": name, "dtype": dt, "N": N, "d": D, "BH": B * H, "tiles": tiles,
         "forms": len(getattr(chooser, "forms", ())) or 1,
         "threads": threads, "prefetch": prefetch, "mma": "mma_" in kernel.source, "ms": ms,
         "rel_err": err, "flex_ms": flex_ms, "flex_rel_err": flex_err, "kept_share": share,
         "kernel_ms": kernel_ms, "flex_kernel_ms": flex_kernel_ms,
         "sdpa_dense_ms": cuda_time(lambda: torch.nn.functional.scaled_dot_product_attention(Q, K, V, **gqa)),
         "smem": kernel.launch.dynamic_smem_bytes, "mappings": kernel.mappings, **derived}
    r.update(kernel.compiled_info())
    return r


def _tilings(text: str):
    """``"q=64,x=64,threads=128;default;..."`` -> [(tiles, threads)]; ``default`` or
    nothing: the defaults (FLEX_TILES)."""
    out = []
    for part in (p for p in text.split(";") if p.strip()):
        if part.strip() == "default":   # what nc.lower chooses
            out.append((None, None))
            continue
        kv = dict(item.split("=") for item in part.split(","))
        threads = int(kv.pop("threads")) if "threads" in kv else None
        out.append(({k: int(v) for k, v in kv.items()}, threads))
    return out or [(None, None)]


def main_flex(out: Path, gen, dtypes=("f32", "f16"), only=(), tilings=((None, None),), prefetch=None):
    res = []
    specs = flex_variants(gen)
    unknown = set(only) - set(specs)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; the variants are {sorted(specs)}")
    for dt in dtypes:
        for name, spec in specs.items():
            if only and name not in only:
                continue
            for tiles, threads in tilings:
                t0 = time.perf_counter()
                try:
                    r = flex_variant(name, spec, gen, tiles=tiles, dt=dt, threads=threads, prefetch=prefetch)
                except Exception as e:  # noqa: BLE001
                    r = {"kind": "flex", "variant": name, "dtype": dt, "tiles": tiles,
                         "error": f"{type(e).__name__}: {str(e)[:400]}"}
                r["wall_s"] = time.perf_counter() - t0
                res.append(r)
                print(json.dumps(r, default=str), flush=True)
                (out / f"variants_flex_{'_'.join(dtypes)}.json").write_text(json.dumps(res, indent=1, default=str))
    print("\n| variant | dtype | tiles | threads | prefetch | regs | kept | ms | Flex ms | vs Flex | kernel ms | Flex kernel ms "
          "| vs Flex (kernels) | SDPA dense ms | err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in res:
        if "error" in r:
            print(f"| {r['variant']} | {r.get('dtype')} | {r.get('tiles')} | ERROR {r['error'][:200]} |")
            continue
        print(f"| {r['variant']} | {r['dtype']} | {r['tiles']['q']} x {r['tiles']['x']} | {r['threads']} | {r['prefetch']} | "
              f"{r.get('registers')} | {r['kept_share']:.3f} | {r['ms']:.3f} | {r['flex_ms']:.3f} | "
              f"{r['flex_ms'] / r['ms']:.2f}x | {r['kernel_ms']:.3f} | {r['flex_kernel_ms']:.3f} | "
              f"{r['flex_kernel_ms'] / r['kernel_ms']:.2f}x | {r['sdpa_dense_ms']:.3f} | {r['rel_err']:.0e} |")
    for r in res:
        if "table_ms" in r:
            print(f"{r['variant']} {r['dtype']}: block table derived per launch over {r['table_blocks']}: "
                  f"table {r['table_ms']:.3f} ms by torch operations, {r.get('table_kernel_ms', float('nan')):.3f} ms "
                  f"by the generated table kernel, a call that derives it {r['call_ms']:.3f} ms, a call on "
                  f"tensors whose table is kept {r['kept_call_ms']:.3f} ms; FlexAttention's "
                  f"create_block_mask {r.get('flex_block_mask_ms', float('nan')):.3f} ms (not in its times)")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", default="")
    ap.add_argument("--dtypes", default="f32,f16", help="--only flex: comma list of f32, f16, bf16")
    ap.add_argument("--variants", default="", help="--only flex: comma list of variant names (default all)")
    ap.add_argument("--tiles", default="", help='--only flex: tilings to run each variant at, "q=64,x=64,threads=128;..."'
                    " (default: FLEX_TILES)")
    ap.add_argument("--prefetch", default="", choices=("", "none", "regs", "double", "auto"),
                    help="--only flex: every kernel's prefetch (default: FLEX_TILES')")
    args = ap.parse_args(argv)
    gen = torch.Generator(device=DEV).manual_seed(0)
    res = []
    out = Path(args.out)
    print(torch.cuda.get_device_name(0), torch.__version__, flush=True)
    if args.only == "flex":
        return main_flex(out, gen, tuple(args.dtypes.split(",")), tuple(v for v in args.variants.split(",") if v),
                         _tilings(args.tiles), {"": None, "none": False, "regs": True}.get(args.prefetch, args.prefetch))
    jobs = []
    if args.only in ("", "attention"):
        jobs += [("a", (4096, D, causal, 16, t, pf, sw)) for D, causal, t, pf, sw in ATT]
    if args.only in ("", "matmul"):
        jobs += [("m", (4096, t, pf, sw)) for t, pf, sw in MM]
    for kind, job in jobs:
        t0 = time.perf_counter()
        try:
            r = attention_variant(*job, gen) if kind == "a" else matmul_variant(*job, gen)
        except Exception as e:  # noqa: BLE001
            r = {"kind": kind, "job": str(job), "error": f"{type(e).__name__}: {str(e)[:400]}"}
        r["wall_s"] = time.perf_counter() - t0
        res.append(r)
        print(json.dumps(r, default=str), flush=True)
        (out / "variants.json").write_text(json.dumps(res, indent=1, default=str))
    print("\nkind  d   c tiles                          pf      switches                   ms      TF/s  x_peer regs local err")
    for r in res:
        if "error" in r:
            print("ERR", r["job"], r["error"][:200])
            continue
        peer = r.get("sdpa_ms", r.get("cublas_ms"))
        print(f"{r['kind'][:4]:5s} {r.get('d', '-'):3} {str(r.get('causal', '-'))[0]} {str(r['tiles']):30s} {str(r['prefetch']):7s} "
              f"{str(r['switches']):26s} {r['ms']:7.3f} {r['tflops']:5.1f} {peer / r['ms']:5.2f} "
              f"{r.get('registers')} {r.get('local_bytes')} {r['rel_err']:.0e}")


if __name__ == "__main__":
    main()
