"""Planted code generation bugs are caught by ``check_equivalent(oracle, kernel)`` in its default
budget: mutation testing of the kernel-level check.

Each mutant is a generated kernel whose source text is changed the way a code generator goes
wrong (a rescale skipped on moderate jumps, a wrong initial maximum, a doubled last chunk, a
dropped ragged tail, a missing guard for fully masked rows, a rescale applied twice, a
normaliser not rescaled, an off-by-one mask).  The mutation must apply (the pattern is found in
the source, so a codegen change cannot silently turn a test into one that cannot fail) and the
check must raise :class:`~napkin_cat.EquivalenceError` whose reproducer names the kernel.
The patterns match text written by the renderer (``napkin_cat.lowering.emit``,
``emit_threads`` and ``emit_acc``: online-softmax rescale, state initialisation, normaliser
guard, ragged chunk bounds) and ``emit_kinds`` (the causal mask).
"""

from __future__ import annotations

import copy
import os
import re

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest  # noqa: E402

import napkin_cat as nc  # noqa: E402

q, x, d = nc.axes("q x d")
r, c = nc.axes("r c")
L = nc.library


def _sum_rows():
    g = nc.Builder(nc.f32)
    return g.diagram(g.reduce("sum", g.input("X", r, c), c))


ATTN = (L.attention(q=q, x=x, d=d), lambda dg: dg.stream(x, 3).tile(q, 4), {q: 5, x: 13, d: 2})
BIASED = (L.attention(q=q, x=x, d=d, bias="input"), lambda dg: dg.stream(x, 3).tile(q, 4), {q: 5, x: 13, d: 2})
CAUSAL = (L.attention(q=q, x=x, d=d, causal=True), lambda dg: dg.stream(x, 3).tile(q, 4), {q: 6, x: 13, d: 2})
SUM = (_sum_rows(), lambda dg: dg.stream(c, 3).tile(r, 2), {r: 3, c: 13})

# name -> (case, pattern, replacement): re.sub on the generated source
MUTANTS = {
    "rescale_skipped_on_moderate_jumps": (
        ATTN, r"delta = math\.exp\((\w+) - (\w+)\)",
        r"delta = math.exp(\1 - \2) if not (float32(20.0) < \2 - \1 < float32(1e4)) else float32(1.0)"),
    "initial_max_zero": (ATTN, r"(\w+_mu\[\w+\]) = NEG_INF", r"\1 = ZERO"),
    "rescale_applied_twice": (ATTN, r"(O_o\[i, j\]) \*= scale", r"\1 *= scale * scale"),
    "normaliser_not_rescaled": (ATTN, r"(\w+_z\[\w+\]) = delta \* \1 \+ psum", r"\1 = \1 + psum"),
    "fully_masked_row_not_guarded": (BIASED, r" / z if z != ZERO else ZERO\)", r" / z)"),
    "doubled_last_chunk": (
        SUM, r"(\w+) = \1 \+ (smem\[[^\n]*\])\n",
        r"\1 = \1 + \2 * (float32(2.0) if c0 + CHUNK_c >= N_c else float32(1.0))\n"),
    "ragged_tail_dropped": (SUM, r"len_c = min\(CHUNK_c, N_c - c0\)", r"len_c = CHUNK_c if N_c - c0 >= CHUNK_c else U0"),
    "fourth_chunk_on_dropped": (SUM, r"(for i_c\w* in range\()len_c\)", r"\1len_c if c0 < U3 * CHUNK_c else U0)"),
    "causal_off_by_one": (CAUSAL, r"(\(x0 \+ \w+\)) <= (\(q0 \+ \w+\))", r"\1 < \2"),
}


def _mutant(kernel, pattern: str, replacement: str):
    source, n = re.subn(pattern, replacement, kernel.source)
    assert n >= 1, f"mutation pattern {pattern!r} no longer occurs in the generated source:\n{kernel.source}"
    mutant = copy.copy(kernel)
    mutant.source, mutant._dispatcher, mutant._launchers = source, None, {}
    return mutant


# the attention mutants take 15-45 s each in the simulator: the slow tier
SLOW_MUTANTS = {"initial_max_zero", "fully_masked_row_not_guarded", "rescale_skipped_on_moderate_jumps",
                "normaliser_not_rescaled", "rescale_applied_twice", "causal_off_by_one"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_MUTANTS else n
                                  for n in sorted(MUTANTS)])
def test_planted_kernel_bug_is_caught(name):
    (oracle, relabel, sizes), pattern, replacement = MUTANTS[name]
    kernel = nc.lower(relabel(oracle).bind(sizes), verify=False, threads=16)
    nc.check_equivalent(oracle, kernel, examples=1)   # the unmutated kernel passes
    mutant = _mutant(kernel, pattern, replacement)
    with pytest.raises(nc.EquivalenceError) as info:
        nc.check_equivalent(oracle, mutant)             # the default budget
    err = info.value
    assert "kernel differs" in str(err) or "kernel raises" in str(err)
    assert "kernel = nc.lower(" in err.counterexample["code"]
