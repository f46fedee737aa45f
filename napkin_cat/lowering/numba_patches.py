"""One repair to numba-cuda's compiler, for kernels as long as the generated ones.

numba-cuda 0.30's ``Lower._find_singly_assigned_variable`` (run once per compiled function)
decides which variables live in SSA registers rather than stack slots: a variable assigned in
one block, used only there, and assigned once.  For the last condition it scans every
assignment of the block, once per variable: quadratic in the length of a block.  A generated
FlashAttention backward kernel is long straight-line code (unrolled fragments, thousands of
statements per block), and half of its numba compile went there: offline
(``NUMBA_ENABLE_CUDASIM=0``, numba to LTO-IR for sm_90) the fp16 dK, dV kernel took 45.2 s, and
22.6 s with :func:`linear_singly_assigned`, whose LTO-IR was byte for byte the same.

:func:`install` puts the linear version in place when the installed method is the one it was
written against (its source's digest is :data:`REVIEWED`), and leaves numba alone otherwise
(``STATE`` says which).  It runs where kernels compile for a GPU (:func:`.devices.import_cuda`
with the simulator off); the simulator compiles nothing.  ``tests/test_numba_patch.py`` checks
that both versions find the same variables on numba-cuda's IR of generated kernels.
"""

from __future__ import annotations

import hashlib
import inspect
from collections import Counter, defaultdict

REVIEWED = {"c3b499f76517"}
"""Digests (sha256 of the source, 12 hex) of the ``_find_singly_assigned_variable`` versions
:func:`linear_singly_assigned` reproduces (numba-cuda 0.30.4)."""

STATE = {"installed": False, "why": "not tried"}


def linear_singly_assigned(self) -> None:
    """numba-cuda's ``Lower._find_singly_assigned_variable`` with the assignments of each block
    counted once (a :class:`~collections.Counter` per block) instead of once per variable."""
    from numba.cuda.core import ir
    from numba.cuda.core.analysis import compute_use_defs, must_use_alloca

    func_ir = self.func_ir
    sav = set()
    if not func_ir.func_id.is_generator:
        use_defs = compute_use_defs(func_ir.blocks)
        alloca_vars = must_use_alloca(func_ir.blocks)
        assigned_in = defaultdict(set)
        for blk, names in use_defs.defmap.items():
            for var in names:
                assigned_in[var].add(blk)
        used_in = defaultdict(set)
        for blk, names in use_defs.usemap.items():
            for var in names:
                used_in[var].add(blk)
        counts: dict = {}
        for var, blocks in assigned_in.items():
            if var in alloca_vars or len(blocks) != 1 or used_in[var]:
                continue
            (blk,) = blocks
            if blk not in counts:
                counts[blk] = Counter(s.target.name for s in self.blocks[blk].find_insts(ir.assign_types))
            if counts[blk][var] == 1:
                sav.add(var)
    self._singly_assigned_vars = sav
    self._blk_local_varmap = {}


def digest(fn) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:12]


def install() -> bool:
    """Replace numba-cuda's method by :func:`linear_singly_assigned` if it is a reviewed version;
    returns whether the linear one is in place (``STATE["why"]`` says why not)."""
    if STATE["installed"]:
        return True
    try:
        from numba.cuda.lowering import Lower
        original = Lower._find_singly_assigned_variable
        got = digest(original)
    except (ImportError, AttributeError, OSError, TypeError) as e:
        STATE["why"] = f"numba-cuda's Lower._find_singly_assigned_variable not found: {e}"
        return False
    if got not in REVIEWED:
        STATE["why"] = f"numba-cuda's Lower._find_singly_assigned_variable is a version not reviewed ({got})"
        return False
    Lower._napkin_original_singly_assigned = original
    Lower._find_singly_assigned_variable = linear_singly_assigned
    STATE.update(installed=True, why=f"installed over version {got}")
    return True
