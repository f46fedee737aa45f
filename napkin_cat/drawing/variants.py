"""``docs/variants.md``: the gallery of attention variants, drawn and written out.

    python -m napkin_cat.drawing.variants [--out docs]

For each entry of :data:`napkin_cat.library.variant_gallery.GALLERY`: the variant as a user
writes it, its string diagram (``docs/variants/<name>.png``, drawn by :func:`.diagram.draw`),
the index expression bound to the diagram's axes, the pseudocode of its loop nest (tiles of 64
queries, chunks of 64 keys) and the share of the dense work the derived block sparsity leaves at
N = 4096.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..core import Axis, axes
from ..costmodel.model import cost
from ..library import attention
from ..library.variant_gallery import GALLERY, build
from ..ops.derived_tables import derivable
from ..relabel.row_terms import drop_row_terms
from .diagram import draw

N_COST, TILE = 4096, 64


def _reads_heads(v) -> bool:
    return any(role in v.code for role in ("h + 1", "hb[h]", "w[h]", "bb[b]", "[b, "))


def entry(v, out: Path) -> str:
    q, x, d = axes("q x d")
    heads = Axis("h") if _reads_heads(v) else None
    batch = Axis("b") if _reads_heads(v) else None
    dia = build(v, q, x, d, 16, heads=heads, batch=batch)
    png = out / "variants" / f"{v.name}.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    fig = draw(dia, str(png), title=f"attention: {v.name}")
    import matplotlib.pyplot as plt
    plt.close(fig)
    exprs = []
    for e in dia.eqns:
        fn = e.box.param("pred", None) or e.box.param("bias", None)
        if fn is not None and fn.kind == "expr":
            exprs.append(f"{e.box.kind}: {fn.expr}")
    sizes = {q: N_COST, x: N_COST, d: 64, **({heads: 4} if heads else {}), **({batch: 2} if batch else {})}
    big = build(v, q, x, d, N_COST, heads=heads, batch=batch).bind(sizes).stream("x", TILE).tile("q", TILE)
    dense = attention(q=q, x=x, d=d, heads=heads, batch=batch).bind(sizes).stream("x", TILE).tile("q", TILE)
    share = cost(big).flops["tensor"] / cost(dense).flops["tensor"]
    tables = [a.table.name for e in big.eqns if e.box.kind == "mask" for a in e.box.param("pred").block_atoms()]
    derived = derivable(big)   # a mask that reads data: a kernel derives its block table (ops/derived_tables.py)
    if tables or derived:   # skipped by the data as the kernel runs: counted with the gallery's data
        import numpy as np
        data = v.aux(N_COST, sizes.get(heads, 1), sizes.get(batch, 1), np.random.default_rng(0))
        share = cost(big, data=data).flops["tensor"] / cost(dense).flops["tensor"]
    pseudo = big.loop_nest().pseudocode(memory=False)
    lines = [f"## {v.name}", "", v.doc + ".", "", "```python", v.code, "```", "",
             f"![{v.name}](variants/{v.name}.png)", ""]
    if exprs:
        lines += ["Bound to the diagram's axes (`q` query, `x` key, `h` head, `b` batch):", "", "```"]
        lines += exprs + ["```", ""]
    rewritten, dropped = drop_row_terms(dia)   # the terms a softmax divides out, dropped before lowering
    if dropped:
        lowered = [f"index_bias: {e.box.param('bias').expr}" for e in rewritten.eqns
                   if e.box.kind == "index_bias" and e.box.param("bias").kind == "expr"]
        lines += ["As `nc.lower` computes it in 16-bit kernels, its terms of the row alone dropped before the softmax "
                  "(`napkin_cat/relabel/row_terms.py`):", "", "```", *lowered, "```", ""]
    why = ("the chunks its block table masks are skipped as the kernel runs; counted with the gallery's "
           "random data, each batch and head by its own slice of the table" if tables else
           "the chunks its data masks are skipped by the block table a kernel derives from the data at each "
           "launch; counted with the gallery's data" if derived else
           "tiles skipped by the derived block sparsity" if share < 1 else "no tile can be skipped")
    lines += [f"Tensor work at N = {N_COST}, tiles of {TILE} x {TILE}: **{float(share):.3f}** of dense ({why}).",
              "", "<details><summary>pseudocode (loop nest)</summary>", "", "```", pseudo, "```", "", "</details>", ""]
    return "\n".join(lines)


HEADER = """# Attention variants as data

Each variant below is written as a user writes it (FlexAttention's `score_mod(score, b, h, i, j)`
and `mask_mod(b, h, i, j)`), traced once into an index expression
(`napkin_cat/ops/index_expr.py`), and from that one definition gets its NumPy and torch meaning,
its cost, the drawing and the generated kernel; the tiles a mask removes for a whole block of
rows are derived from the expression (`napkin_cat/ops/index_support.py`), so the tiled executor,
the cost model and the kernel skip them alike.  `tests/test_variants.py` checks each against an
independent NumPy reference (`napkin_cat/library/variant_gallery.py`), tiled, and (slow tier)
its kernel under the CUDA simulator.  On a GPU, `kernels/variants.py --only flex` checks the
kernels of sixteen variants like these and of dense attention (fp32 and, on tensor cores, fp16) against float64
references computed from FlexAttention's own functions, then times them against FlexAttention:
the H100 and H200 tables are in `kernels/BENCHMARKS.md`.  Regenerate with
`python -m napkin_cat.drawing.variants`.

Data-dependent sparsity: a mask that reads data (`doc[i] == doc[j]`) lowers to a kernel that
derives its block table from the data at each launch, over its own tiles, and skips the chunks it
masks whole (`napkin_cat/lowering/tabled.py`; tables of torch tensors are kept by the tensors'
identity and version; on a GPU with warpgroup MMAs, the 16-bit forward is lowered on two blocks and
each call runs the one whose tables keep less area, `TableChoice`, as for a user's table whose blocks hold each warp's 16 rows (each warp then reads its own entry); on a GPU a generated kernel makes a table in one launch,
`napkin_cat/lowering/table_kernel.py`); `nc.block_table` with `nc.blocked` makes one table for
many calls, as FlexAttention's `create_block_mask` does.  The values a mask compares (the ids) are
an f32 input whatever the attention's dtype, exact for integers up to 2**24 (`nc.aux`'s `dtype`);
`nc.torch_op` takes them as a float or integer tensor.  Given the table's values
(`nc.cost(d, data={"bt": table})`), the cost model counts a kept chunk's mask arithmetic as the
kernel writes it: in a chunk that reads one table entry, the table's comparisons take that entry's
value and fold away (`ops/index_support.py`, `with_atoms`, which the kernel's versions are written
with), so a derived document table's partial chunk costs 3 operations an element (the ids and
the bound) where it counted 13 (`tests/test_table_mask_cost.py`).

Semantics worth knowing: `window_size=0` keeps only the diagonal `j == i` (`None` is no window);
gathers from `nc.aux` tensors clamp their indices into the tensor; a fully masked row gives 0;
the roles are `i` query, `j` key, `b` batch, `h` query head (`kv_head * G + group` under GQA).
Torch's spellings trace too (`.clamp(min, max)`, `.abs()`, shifts by a constant: `x >> k` is
`x // 2**k`), so FlexAttention's examples (NATTEN clamped to the canvas, tiled or in Morton order,
sliding tile attention, sink tokens) are traced unchanged: `tests/test_flex_examples.py`.  So are
torch's functions on the traced indices and score, as FlexAttention's documentation writes them
(`torch.where(q_idx >= kv_idx, score, -float("inf"))`, `softcap * torch.tanh(score / softcap)`,
`torch.clamp`, `torch.logical_and`, `torch.remainder`..., and the same as methods, `score.tanh()`:
`ops/index_torch.py`), and masks composed
with FlexAttention's `and_masks` / `or_masks` (the same tree as `&` / `|`, skipped alike); a captured tensor
indexed by a traced index (`alibi[h]`) is refused with the fix, `nc.aux`
(`tests/test_torch_spellings.py`).

"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs")
    out = Path(ap.parse_args(argv).out)
    text = HEADER + "\n".join(entry(v, out) for v in GALLERY)
    (out / "variants.md").write_text(text)
    print(f"wrote {out / 'variants.md'} and {len(GALLERY)} pictures in {out / 'variants'}")


if __name__ == "__main__":
    main()
