"""lowering/unswitch.py: a target's element loop written twice, for the chunks its masks keep
whole (the masks left out) and for the rest (each element tested, as before), under one test of
the chunk flags."""
import re

import numpy as np
import pytest

import napkin_cat as nc
from napkin_cat import library as L
from napkin_cat.lowering import emit_acc, emit_threads, unswitch
from napkin_cat.verify import kernelcheck

q, x, d = nc.axes("q x d")
MARK = "the masks keep the whole chunk: its elements without them"


def _outcome(dia, kernel, seed: int = 0):
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal(tuple(ax.size for ax in arr.axes)) * 4 for arr in dia.dom]
    return kernelcheck.kernel_outcome(dia, kernel, inputs)


def _branches(src: str) -> tuple[str, str]:
    """The text of the first written-twice loop: the branch for whole chunks, then the other."""
    lines = src.splitlines()
    at = next(n for n, ln in enumerate(lines) if MARK in ln)
    indent = len(lines[at]) - len(lines[at].lstrip())
    other = next(n for n in range(at + 1, len(lines)) if lines[n] == " " * indent + "else:")
    end = next((n for n in range(other + 1, len(lines))
                if lines[n].strip() and len(lines[n]) - len(lines[n].lstrip()) <= indent), len(lines))
    return "\n".join(lines[at + 1:other]), "\n".join(lines[other + 1:end])


@pytest.mark.parametrize("n", [16, 15])   # whole tiles, and a ragged last tile and chunk
def test_causal_scores_are_written_for_whole_chunks_without_the_mask(n):
    dia = L.attention(q=q, x=x, d=d, causal=True).bind({q: n, x: n, d: 4})
    # rows in tiles of 8, keys in chunks of 4: chunks left of the tile's first row are kept whole
    kernel = nc.lower(dia, tiles={"q": 8, "x": 4}, threads=16)
    whole, rest = _branches(kernel.source)
    # the mask's comparison of indices in the other branch only (a ragged chunk's padding is -inf in both)
    assert "<=" not in whole and "_full" not in whole and re.search(r"if \(x_full\w* or .*<=.*else NEG_INF", rest)
    assert _outcome(dia, kernel).failure is None


def test_without_the_switch_each_element_tests_the_flag():
    dia = L.attention(q=q, x=x, d=d, causal=True).bind({q: 16, x: 16, d: 4})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(unswitch, "UNSWITCH", False)
        kernel = nc.lower(dia, tiles={"q": 8, "x": 4}, threads=16)
    assert MARK not in kernel.source and "(x_full or " in kernel.source
    assert _outcome(dia, kernel).failure is None


def test_a_loop_written_for_whole_chunks_in_every_chunk_is_caught():
    """Planted: the masks left out in every chunk, the flags never tested."""
    def untested(em, t, src, body):
        before = em.assumed_full
        em.assumed_full = before | frozenset(unswitch.chunk_flags(em, t.var, frozenset({t.source})))
        try:
            body()
        finally:
            em.assumed_full = before

    dia = L.attention(q=q, x=x, d=d, causal=True).bind({q: 16, x: 16, d: 4})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(emit_threads, "unswitched", untested)
        mp.setattr(emit_acc, "unswitched", untested)
        kernel = nc.lower(dia, tiles={"q": 8, "x": 4}, threads=16, verify=False)
    assert MARK not in kernel.source and "NEG_INF if" not in kernel.source
    assert _outcome(dia, kernel).failure is not None


def test_a_data_mask_with_its_block_table_is_written_twice():
    doc = nc.aux("doc", nc.Axis("n", 16))
    dia = L.attention(q=q, x=x, d=d, mask=lambda b_, h_, i, j: (doc[i] == doc[j]) & (j <= i)).bind(
        {q: 16, x: 16, d: 4})
    kernel = nc.lower(dia, tiles={"q": 8, "x": 4}, threads=16, verify=False)
    whole, rest = _branches(kernel.source)
    assert "doc_s" not in whole and "NEG_INF" not in whole
    assert "smem[doc_s + " in rest and "else NEG_INF" in rest
    rng = np.random.default_rng(1)
    ids = np.repeat([0, 1, 2], [5, 8, 3]).astype(np.float64)     # three documents, cut inside chunks
    inputs = [rng.standard_normal((16, 4)) * 4 for _ in range(3)] + [ids]
    assert kernelcheck.kernel_outcome(dia, kernel, inputs).failure is None
