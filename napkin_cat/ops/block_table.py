"""Block tables: data-dependent block sparsity (document masks, explicit block masks).

A mask that reads data (``doc[i] == doc[j]``) has no support a kernel can derive from its
definition alone: which tiles it masks depends on the values.  :func:`block_table` evaluates
the mask once, before the kernel runs, over blocks of ``rows x cols`` entries: ``0`` where the
block is masked whole, ``2`` where it is kept whole, ``1`` otherwise (FlexAttention's block
mask, with its full blocks).  :func:`blocked` writes the mask so that it reads the table::

    ((T[i // rows, j // cols] >= 2) | ((T[i // rows, j // cols] >= 1) & mask)) & bounds

(``bounds``: the conjuncts of ``mask`` that bound the columns without data, such as ``j <= i``,
so that a kernel's loop stops where they do), equal to ``mask`` when ``T`` is its table, so the
NumPy meaning, the cost and the kernel all read the same definition; a comparison
``T[i // r, j // c] (cmp) v`` is a :class:`~.index_support.BlockAtom`: per chunk the kernel
reads the entries over its tile and chunk, skips the chunk when they mask it whole and skips the
mask's arithmetic when they keep it whole.  An explicit block mask (FlashAttention's block-sparse attention) is the same thing
written directly: ``mask_mod(lambda b, h, i, j: bm[i // 128, j // 128] > 0)``.

The table is computed on the host (NumPy) or on the device (torch tensors: the mask's own
torch meaning, no extra kernel): once per mask and data, like FlexAttention's
``create_block_mask``, and O(rows x columns) work, a small fraction of one attention call.

>>> import numpy as np, napkin_cat as nc
>>> doc = nc.aux("doc", nc.Axis("n", 8))
>>> m = nc.mask_mod(lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i))
>>> nc.block_table(m, 8, 8, 4, 4, {"doc": np.array([0, 0, 0, 0, 1, 1, 1, 1])})
array([[1., 0.],
       [0., 1.]], dtype=float32)
"""

from __future__ import annotations

from ..core.errors import TypingError
from .index import Predicate, mask_mod

MAX_ENTRIES = 1 << 24   # rows x columns evaluated at once (a band of row blocks at a time)


def _as_mask(mask) -> Predicate:
    if isinstance(mask, Predicate):
        if mask.kind != "expr":
            form = mask.index_form()
            if form is None:
                raise TypingError(f"block_table: {mask!r} is a custom Python predicate; write it with "
                                  f"nc.mask_mod so that it can be evaluated and lowered")
            return Predicate("expr", (form[0], None, None))
        return mask
    return mask_mod(mask)


def block_table(mask, n_rows: int, n_cols: int, rows: int, cols: int, aux: dict | None = None, *,
                batch: int | None = None, heads: int | None = None):
    """The ``(ceil(n_rows / rows), ceil(n_cols / cols))`` float32 table of ``mask`` (a
    :class:`~.index.Predicate` or a ``fn(b, h, i, j)``): 0 masked, 1 partial, 2 kept, per
    block; ``aux`` the auxiliary arrays by name (NumPy arrays, or torch tensors: then the table
    is a torch tensor on their device).  A mask that reads the batch index ``b`` (documents
    packed differently in each sequence: ``doc[b, i] == doc[b, j]``) or the head ``h`` has a
    table per batch and head: ``batch`` and ``heads`` give their counts, and the table has
    those leading axes, batch first (FlexAttention's block mask of shape ``(B, H, ...)``)."""
    m = _as_mask(mask)
    e = m.expr
    if m.args[1] is not None:       # bound to a diagram's axes: back to the roles
        from .index_expr import Ix
        e = e.subst({m.args[1]: Ix("idx", (), "i"), m.args[2]: Ix("idx", (), "j")})
    counts = {"b": batch, "h": heads}
    leads = table_leads(e)
    for role, (opt, one) in _ROLES.items():
        n = counts[role]
        if role in leads and not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
            raise TypingError(f"block_table: {m!r} reads the index {role}: its table has one slice per "
                              f"{one}; pass {opt}= (their count, >= 1), got {n!r}")
        if role not in leads and n is not None:
            raise TypingError(f"block_table: {opt}={n!r} would be ignored: {m!r} does not read {role}, so "
                              f"one table serves every {one}")
    aux = dict(aux or {})
    missing = [a.name for a in e.auxes() if a.name not in aux]
    if missing:
        raise TypingError(f"block_table: {m!r} gathers from {missing}; pass their values in aux")
    xp, like = _namespace(aux)
    if leads:    # one table per batch (and head), stacked batch first
        return _slices(lambda at: _table(e, n_rows, n_cols, rows, cols, {**aux, **dict(zip(leads, at))}, xp, like),
                       tuple(counts[r] for r in leads), like)
    return _table(e, n_rows, n_cols, rows, cols, aux, xp, like)


def _slices(one, counts: tuple, like):
    """``one(at)`` for every index ``at`` of ``counts``, stacked into leading axes of those sizes
    (a torch tensor where ``like`` is one, else NumPy)."""
    import itertools
    parts = [one(at) for at in itertools.product(*(range(n) for n in counts))]
    if like is not None:
        import torch
        out = torch.stack(parts)
    else:
        import numpy as np
        out = np.stack(parts)
    return out.reshape(*counts, *out.shape[1:])


_ROLES = {"b": ("batch", "batch"), "h": ("heads", "head")}
"""The roles a block table can have a slice for: ``block_table``'s option, and one of them."""


def table_leads(e) -> tuple[str, ...]:
    """The roles among ``b``, ``h`` that mask expression ``e`` reads: the leading axes of its
    block table, in this order."""
    return tuple(r for r in _ROLES if r in e.leaves("idx"))


def _table(e, n_rows, n_cols, rows, cols, aux, xp, like):
    R, C = -(-n_rows // rows), -(-n_cols // cols)
    band = max(1, MAX_ENTRIES // max(1, rows * C * cols))
    parts = []
    j = _arange(xp, like, C * cols)[None, :]
    for r0 in range(0, R, band):
        r1 = min(R, r0 + band)
        i = _arange(xp, like, r0 * rows, r1 * rows)[:, None]
        keep = xp.broadcast_to(e.evaluate(xp, {"i": i, "j": j, **aux}), (i.shape[0], j.shape[1]))
        some = every = keep
        if r1 * rows > n_rows or C * cols > n_cols:   # ragged: the entries past the ends count for neither
            valid = (i < n_rows) & (j < n_cols)
            some, every = keep & valid, keep | ~valid
        some, every = _blocks(some, r1 - r0, rows, C, cols, "any"), _blocks(every, r1 - r0, rows, C, cols, "all")
        parts.append(xp.where(some, xp.where(every, 2.0, 1.0), 0.0))
    out = parts[0] if len(parts) == 1 else xp.concatenate(parts, 0)
    return out.astype(xp.float32) if hasattr(out, "astype") else out.float()


def blocked(mask, table, rows: int, cols: int) -> Predicate:
    """``mask`` reading its block table ``table`` (an ``nc.aux`` over (row blocks, column
    blocks), filled by :func:`block_table` with the same ``rows`` and ``cols``)."""
    m = _as_mask(mask)
    if m.args[1] is not None:
        raise TypingError(f"blocked: {m!r} is already placed on a diagram's axes; block the mask "
                          f"before passing it to nc.library.attention")
    leads = table_leads(m.expr)
    if len(table.axes) != 2 + len(leads):
        what = " and ".join(_ROLES[r][1] for r in leads)
        raise TypingError(f"blocked: the block table {table!r} needs {2 + len(leads)} axes "
                          f"({what + ', ' if leads else ''}row blocks, column blocks): {m!r} reads "
                          f"{', '.join(leads) if leads else 'neither b nor h'}")
    from .index_expr import leaves
    lv = leaves()
    t = table[(*(lv[r] for r in leads), lv["i"] // rows, lv["j"] // cols)]
    e = (t >= 2) | ((t >= 1) & m.expr)
    for c in bounds(m.expr):   # the mask's own bounds, which the table's data cannot show
        e = e & c
    return Predicate("expr", (e, None, None))


def bounds(e) -> tuple:
    """The conjuncts of mask expression ``e`` (its operands of ``&``, recursively) that gather
    nothing and bound the columns themselves (``j <= i``): :func:`blocked` keeps them beside the
    table, so that a kernel's loop stops where they do (the diagonal of a causal document mask)
    instead of reading the table's masked entries up to the last column; where the table is
    ``e``'s, ``table-read & conjunct`` is ``e`` still, since ``e`` implies each conjunct."""
    if e.op == "and" and e.dtype == "bool":
        return bounds(e.args[0]) + bounds(e.args[1])
    if e.auxes():
        return ()
    return (e,) if Predicate("expr", (e, None, None)).skips_chunks() else ()


def _namespace(aux: dict):
    from .arrays import NUMPY, torch_namespace
    for v in aux.values():
        if type(v).__module__.startswith("torch"):
            return torch_namespace(), v
    return NUMPY, None


def _arange(xp, like, a, b=None):
    if like is not None:
        import torch
        return torch.arange(a, b, device=like.device) if b is not None else torch.arange(a, device=like.device)
    import numpy as np
    return np.arange(a, b) if b is not None else np.arange(a)


def _blocks(x, R: int, rows: int, C: int, cols: int, how: str):
    """Whether ``any`` (or ``all``) of each ``rows x cols`` block of boolean ``x`` holds."""
    x = x.reshape(R, rows, C, cols)
    return getattr(getattr(x, how)(3), how)(1)
