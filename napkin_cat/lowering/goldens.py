"""Golden kernels: the generated source of canonical diagrams, committed in ``kernels/``.

Every code-generation change shows up as a diff of these files in review.
``python -m napkin_cat.lowering.goldens`` diffs them (exit 1 on a difference);
``python -m napkin_cat.lowering.goldens --update`` (or ``napkin goldens --update``) rewrites them.
Sizes, tiles and threads are fixed here, so the text does not depend on the machine.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"


def canonical() -> dict:
    """name -> (diagram with sizes bound, tiles, threads)."""
    from .. import library as L
    from ..core import axes

    from ..core import Axis
    from ..library.variants import aux
    from ..ops import mask_mod

    q, x, d, h, g, b = axes("q x d h g b")
    a, k, c, t = axes("a k c t")
    att = {q: 4096, x: 4096, d: 64}
    doc = aux("doc", Axis("n", 4096))   # packed documents: a mask that reads data (its table derived per launch)
    documents = mask_mod(lambda b_, h_, i, j: (doc[i] == doc[j]) & (j <= i))
    return {
        "matmul": (L.matmul(a=a, b=k, c=c).bind({a: 4096, k: 4096, c: 4096}),
                   {"a": 128, "c": 128, "k": 16}, 256),
        "attention": (L.attention(q=q, x=x, d=d, heads=h, batch=b).bind({**att, h: 8, b: 2}),
                      {"q": 128, "x": 64}, 256),
        "causal_attention": (L.attention(q=q, x=x, d=d, heads=h, batch=b, causal=True).bind({**att, h: 8, b: 2}),
                             {"q": 128, "x": 64}, 256),
        "gqa_attention": (L.attention(q=q, x=x, d=d, groups=g, heads=h, causal=True).bind({**att, g: 4, h: 2}),
                          {"q": 128, "x": 64}, 256),
        "document_attention": (L.attention(q=q, x=x, d=d, heads=h, mask=documents).bind({**att, h: 8}),
                               {"q": 128, "x": 64}, 256),
        "l2_attention": (L.normalized_attention(q=q, x=x, d=d).bind(att), {"q": 64, "x": 64}, 256),
        "layernorm": (L.layernorm(t=t, d=d).bind({t: 8192, d: 4096}), {"t": 1}, 256),
        "softmax": (L.softmax(r=t, c=x).bind({t: 8192, x: 4096}), {"t": 1}, 256),
        "attention_backward_f16": (_backward_part(L.attention(q=q, x=x, d=d, heads=h, causal=True), q, x, h)
                                   .bind({**att, h: 16}), None, None),
    }


GPU_PLANNED = frozenset({"attention_backward_f16"})
"""Goldens planned as for a Hopper GPU, whichever machine writes them, with ``nc.torch_op``'s
``prefetch="auto"``: warpgroup MMAs, a copying warpgroup, contractions issued ahead, the kernel
``nc.torch_op`` runs there."""


def _backward_part(attention, q, x, h):
    """The (dQ, dK, dV) kernel of FlashAttention's one-kernel backward in f16 (``nc.torch_op``'s
    form on warpgroup tensor cores), its blocks left to the planner."""
    from .backward_forms import backward_plan
    from ..core import f16
    flash = attention.stream(x, "s_x").tile(q, "g_q").tile(h, 1)
    return next(p for p in backward_plan(flash, form="one kernel").at(f16).parts if "dK" in {a.name for a in p.cod})


def generate(name: str) -> str:
    from contextlib import nullcontext
    from unittest import mock

    from . import lower
    import napkin_cat.lowering as lowering
    dia, tiles, threads = canonical()[name]
    # source snapshots at GPU sizes, for review: running them against the float64 oracle at these
    # sizes is the GPU benchmark's job (kernels/bench.py checks every kernel before timing it)
    gpu = name in GPU_PLANNED   # ... with nc.torch_op's prefetch, as it plans them
    with mock.patch.object(lowering, "_gpu_present", lambda runtime: True) if gpu else nullcontext():
        return lower(dia, tiles=tiles, threads=threads, name=name, verify=False, prefetch="auto" if gpu else False).source


def diff(name: str, directory: Path = KERNELS_DIR) -> str:
    path = directory / f"{name}.py"
    new = generate(name)
    old = path.read_text() if path.exists() else ""
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                        f"{path} (committed)", f"{path} (generated)"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m napkin_cat.lowering.goldens", description=__doc__.splitlines()[0])
    ap.add_argument("--update", action="store_true", help="rewrite the golden files")
    ap.add_argument("--dir", default=str(KERNELS_DIR))
    args = ap.parse_args(argv)
    directory = Path(args.dir)
    if not args.update and not directory.is_dir():
        # installed without a checkout: nothing to compare with, which is not a difference
        print(f"no golden kernels to compare: {directory} does not exist (they are committed in kernels/ of a "
              f"napkin_cat checkout; --dir DIR names another folder, --update writes them)", file=sys.stderr)
        return 1
    names = list(canonical())
    status = 0
    for name in names:
        if args.update:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / f"{name}.py").write_text(generate(name))
            print(f"wrote {directory / (name + '.py')}")
            continue
        text = diff(name, directory)
        if text:
            status = 1
            sys.stdout.write(text)
    if args.update:
        return 0
    if status:
        print("golden kernels differ: review, then run `python -m napkin_cat.lowering.goldens --update`")
    else:
        print(f"golden kernels match: {len(names)} kernels in {directory} are what the code generator writes today")
    return status


if __name__ == "__main__":
    sys.exit(main())
