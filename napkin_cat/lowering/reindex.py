"""Reindexing boxes read through their index maps, inside the kernel that consumes them.

A reindexing (``unfold``: windows, padding, zero-upsampling; ``split``, ``merge``, ``slice``,
``rename``, ``diagonal``) is an elementwise box whose element ``y`` is its input at another
index ``x = f(y)``, or zero where ``f(y)`` falls outside the input (padding, the holes of a
transposed convolution).  Its reader (a contraction's operand, an epilogue, a store) evaluates
it where it reads it: each remapped input axis gets its *global* index from the global indices
of the output axes (an affine map per axis), a validity predicate selects zero, and the input
is read at that index in its shared buffer.  A convolution is then one kernel: the input tile
in shared memory, the windows read from it inside the contraction's inner loop.

Index arithmetic is ``uint32`` where it cannot leave the axis (no padding, non-negative
steps) and signed (``int(...)``) otherwise; the index read is always clamped into the axis,
so a predicate that is false never leads to an out-of-bounds read (inline producers of the
input are evaluated before the select).

The remapped input axes must be whole in the block (role ``full``: their local index is the
global one); :func:`check_axes` refuses a schedule that tiles or streams one.  Where one kernel
is refused (this, or the whole input over the shared memory), :func:`napkin_cat.lower` cuts the
diagram into kernels (:mod:`.multi`): a run of reindexings on its own is a gather kernel
(:mod:`.gather`, the same index maps, read from HBM) and its consumer reads the result.

>>> from napkin_cat.core import Axis
>>> from napkin_cat.ops.boxes import unfold_box
>>> from napkin_cat.core.types import Array
>>> box = unfold_box(Array((Axis("h", 8),)), "h", Axis("ho", 4), Axis("k", 3), stride=2, offset=-1)
>>> remapped(box)
('h',)
>>> check(box) is None
True
"""

from __future__ import annotations

from ..core.errors import LoweringError

OPS = ("unfold", "split", "merge", "slice", "rename", "diagonal")
"""Reindexing ops read through an index map (``transpose`` keeps the names: read as is)."""


def remapped(box) -> tuple[str, ...]:
    """The input axes of reindexing ``box`` whose index is computed from other axes."""
    op = box.param("op")
    if op in ("unfold", "split", "slice", "rename"):
        return (box.param("axis"),)
    if op == "merge":
        return (box.param("outer"), box.param("inner"))
    if op == "diagonal":
        return (box.param("drop"),)
    return ()


def remaps(box) -> bool:
    """``box`` is a reindexing read through an index map (its elements read other elements)."""
    return box.kind == "reindex" and bool(remapped(box))


def check(box) -> str | None:
    """Why reindexing ``box`` cannot be read through its index map (None when it can)."""
    op = box.param("op")
    if op == "transpose":
        return None
    if op not in OPS:
        return f"{box.name}: no numba.cuda index map for reindexing {op!r}"
    return None


def check_axes(ff, ax) -> None:
    """Refuse a kernel in which a reindexed input axis is tiled or streamed (its reader needs
    indices anywhere along it: a window, a halo, a reversed or strided read), or in which a
    reshape (split, merge, slice, rename, diagonal) makes an axis the grid tiles (a view
    between kernels, :class:`.multi.View`, reads only the tile in place)."""
    dd = ff.diagram
    for e in dd.eqns:
        if e.box.kind != "reindex" or e.box.param("op") == "transpose":
            continue
        if e.box.param("op") != "unfold":
            made = [a for a in e.box.cod[0].axis_names if a not in e.box.dom[0].axis_names]
            tiled = [a for a in made if ax[a].role in ("grid", "batch")]
            if tiled:
                # each block would read the whole input for a tile of the result; between two
                # kernels the same reshape is a view of HBM that reads only the tile (.multi)
                raise LoweringError(f"{e.box.name} makes axis {tiled[0]}, which this kernel tiles: a block would "
                                    f"read all of {e.box.dom[0]} for one tile; it is a view between kernels")
        for a in remapped(e.box):
            p = ax.get(a)
            if p is not None and p.role != "full":
                raise LoweringError(
                    f"{e.box.name} reads axis {a} at other indices ({e.box.param('op')}), but this kernel "
                    f"{'tiles' if p.role in ('grid', 'batch') else 'streams'} {a} by {p.cap}: the reindexed "
                    f"axis must be whole in the block")


def read(em, box, x: int, env: dict, src, define=None) -> str:
    """The value of reindexing ``box`` (input variable ``x``) at the output indices ``env``:
    ``x`` at the mapped indices, or zero where the map leaves the input."""
    env_in = {a: i for a, i in env.items() if a not in remapped(box)}
    conds: list[str] = []
    for a, idx, ok in _index_map(em, box, env, src):
        if em.ax[a].cap > 1:
            env_in[a] = idx
        conds += ok
    # a fresh memo: the input is read at other indices than the values already computed here
    val = em.value(x, env_in, src, {}, {}, define)
    if not conds:
        return val
    zero = getattr(em, "zero", None) or em.consts.f(0.0, "ZERO")   # a gather of 16-bit patterns: int16
    return f"{val} if {' and '.join(conds)} else {zero}"


def signed_index(em, axis: str, env: dict) -> str:
    """Global index of ``axis`` as a signed int (``int64``: numba's ``int()`` keeps a uint32
    unsigned, and unsigned minus signed is a float64 in its typing)."""
    g = em.gidx(axis, env)
    return f"int64{g}" if g.startswith("(") and g.endswith(")") else f"int64({g})"


def _index_map(em, box, env, src):
    """``(input axis, local index expression, conditions)`` for each remapped input axis."""
    op, p, k = box.param("op"), box.param, em.consts
    size = em.sizes
    if op == "unfold":
        yield _unfold(em, box, env, src)
    elif op == "split":
        a = p("axis")
        yield a, f"{em.gidx(p('outer'), env)} * {k.u(size[p('inner')])} + {em.gidx(p('inner'), env)}", []
    elif op == "merge":
        m, n_in = em.gidx(p("axis"), env), k.u(size[p("inner")])
        yield p("outer"), f"{m} // {n_in}", []
        yield p("inner"), f"{m} % {n_in}", []
    elif op == "slice":
        yield p("axis"), f"{em.gidx(p('new'), env)} + {k.u(p('start'))}", []
    elif op == "rename":
        yield p("axis"), em.gidx(p("new"), env), []
    elif op == "diagonal":
        yield p("drop"), em.gidx(p("keep"), env), []
    else:   # pragma: no cover -- refused by check()
        raise LoweringError(f"internal: no index map for reindexing {op!r}")


def unfold_bounds(box, sizes: dict) -> tuple[int, int]:
    """The smallest and largest position ``stride*y + dilation*k + offset`` an unfold reads."""
    p = box.param
    ny = sizes[p("new")]
    nk = sizes[p("window")] if p("window", None) else 1
    s, dl, off = p("stride"), p("dilation"), p("offset")
    lo = off + min(0, dl * (nk - 1))
    hi = off + s * (ny - 1) + max(0, dl * (nk - 1))
    return lo, hi


def _unfold(em, box, env, src):
    """``x = (stride*y + dilation*k + offset) / divisor``, valid where that is an index of the axis."""
    p, k = box.param, em.consts
    a, n = p("axis"), em.sizes[p("axis")]
    s, dl, off, div = p("stride"), p("dilation"), p("offset"), p("divisor")
    window = p("window", None)
    lo, hi = unfold_bounds(box, em.sizes)
    inside = div == 1 and lo >= 0 and hi < n
    if inside and dl > 0 and off >= 0:
        # every position is an index of the axis: unsigned arithmetic, no predicate
        terms = [_times(em.gidx(p("new"), env), s, k)]
        if window is not None:
            terms.append(_times(em.gidx(window, env), dl, k))
        if off:
            terms.append(k.u(off))
        return a, " + ".join(terms), []
    terms = [_times(signed_index(em, p("new"), env), s)]
    if window is not None:
        terms.append(_times(signed_index(em, window, env), dl))
    pos = " + ".join(terms) + (f" + {off}" if off > 0 else f" - {-off}" if off < 0 else "")
    pv = em.names.fresh(f"pos_{a}")
    src(f"{pv} = {pos}")
    conds = [] if lo >= 0 else [f"{pv} >= 0"]
    if hi >= n * div:
        conds.append(f"{pv} < {n * div}")
    if div > 1:
        conds.append(f"{pv} % {div} == 0")
    idx = f"{pv} // {div}" if div > 1 else pv
    iv = em.names.fresh(f"i_{a}_at")
    src(f"{iv} = uint32(min(max({idx}, 0), {n - 1}))" if conds else f"{iv} = uint32({idx})")
    return a, iv, conds


def _times(x: str, c: int, consts=None) -> str:
    """``x * c`` (unsigned with ``consts``, else signed literals), without multiplying by 1."""
    if c == 1:
        return x
    if consts is not None:
        return f"{x} * {consts.u(c)}"
    return f"{x} * {c}" if c > 0 else f"-{x} * {-c}" if c != -1 else f"-{x}"


__all__ = ["OPS", "check", "check_axes", "read", "remapped", "remaps", "signed_index", "unfold_bounds"]
