"""Convolutions as diagrams: unfold the spatial axes into windows, then contract.

A convolution is no box of its own.  Each spatial axis ``h`` is *unfolded* (a reindexing box:
``U[.. ho kh ..] = X[.. stride*ho + dilation*kh - padding ..]``, zero outside) and the windows
are contracted with the weights over the input channels and the kernel axes: the cost model
counts ``2 * out_channels * outputs * in_channels/groups * kernel`` FLOPs, the contraction's
volume.  ``groups`` splits both channel axes into ``(g, c/g)`` and the contraction is weaved over
``g``; a transposed convolution unfolds with ``divisor = stride`` and a negative dilation (the
windows read the input at ``(ho + padding - dilation*kh) / stride`` when that is an integer).

Weights use PyTorch's layouts, so a ``torch.nn.Conv2d``'s tensors plug in unchanged:
``W[o c/g kh kw]`` (``W[c o/g kh kw]`` transposed) and ``bias[o]``.

>>> import napkin_cat as nc
>>> print(nc.library.conv2d(3, 8, 32, 32, kernel=3, padding=1, stride=2))
X[c=3 h=32 w=32] f32, W[o=8 c=3 kh=3 kw=3] f32, bias[o=8] f32 -> Y[o=8 ho=16 wo=16] f32
"""

from __future__ import annotations

from typing import Sequence

from ..core import Axis, Diagram, DType, f32
from ..core.errors import TypingError
from ..core.diagram import Box
from ..ops import Builder, merge_box, split_box, unfold_box
from ..ops.sizes import ConvLength


def _axis(value, name: str, what: str) -> Axis:
    if value is None:
        return Axis(name, name)
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise TypingError(f"{what}: size of axis {name} must be >= 1, got {value}")
        return Axis(name, value)
    if not isinstance(value, Axis):
        raise TypingError(f"{what}: axis {name} must be an Axis or an int, got {value!r}")
    return value


def _per_dim(value, n: int, option: str, low: int, what: str) -> tuple[int, ...]:
    vals = (value,) * n if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(vals, (tuple, list)) or len(vals) != n:
        raise TypingError(f"{what}: {option} must be an int or {n} ints, got {value!r}")
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise TypingError(f"{what}: {option} must be int(s) >= {low}, got {value!r}")
    return tuple(vals)


def out_size(n: int, k: int, stride: int = 1, padding: int = 0, dilation: int = 1,
             transposed: bool = False, output_padding: int = 0) -> int:
    """The output length of a convolution along one axis (PyTorch's formula)."""
    if transposed:
        return (n - 1) * stride - 2 * padding + dilation * (k - 1) + output_padding + 1
    return (n + 2 * padding - dilation * (k - 1) - 1) // stride + 1


def conv(c, o, spatial: Sequence[Axis], kernel: Sequence[Axis], *, out: Sequence[Axis] | None = None,
         stride=1, padding=0, dilation=1, groups: int = 1, bias: bool = True, transposed: bool = False,
         output_padding=0, batch: Axis | None = None, dtype: DType = f32, what: str = "conv") -> Diagram:
    """The N-d convolution ``Y[o *out] = sum_{c, *kernel} W[o c *kernel] U[c *out *kernel] + bias[o]``
    with ``U`` the unfolded input ``X[c *spatial]`` (see the module docstring).

    ``out`` names the output spatial axes (default ``<axis>o`` with the size PyTorch computes);
    an ``o`` equal to ``c`` (a channel-preserving convolution, a residual stream) reads the input
    channels under the name ``<c>_in``.  ``batch`` weaves the input over a batch axis (weights
    shared)."""
    n = len(spatial)
    c, o = _axis(c, "c", what), _axis(o, "o", what)
    spatial = tuple(_axis(a, f"s{i}", what) for i, a in enumerate(spatial))
    kernel = tuple(_axis(k, f"k{i}", what) for i, k in enumerate(kernel))
    if len(kernel) != n:
        raise TypingError(f"{what}: {len(kernel)} kernel sizes for {n} spatial axes")
    stride = _per_dim(stride, n, "stride", 1, what)
    padding = _per_dim(padding, n, "padding", 0, what)
    dilation = _per_dim(dilation, n, "dilation", 1, what)
    output_padding = _per_dim(output_padding, n, "output_padding", 0, what)
    for flag, name in ((bias, "bias"), (transposed, "transposed")):
        if not isinstance(flag, bool):
            raise TypingError(f"{what}: {name} must be True or False, got {flag!r}")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise TypingError(f"{what}: groups must be an int >= 1, got {groups!r}")
    if not transposed and any(output_padding):
        raise TypingError(f"{what}: output_padding={output_padding} is only for transposed convolutions")
    for i, p in enumerate(output_padding):
        if p and p >= max(stride[i], dilation[i]):
            raise TypingError(f"{what}: output_padding {p} along {spatial[i].name} must be smaller than "
                              f"its stride {stride[i]} or dilation {dilation[i]}")
    for ch in (c, o):
        if groups > 1 and ch.symbolic:
            raise TypingError(f"{what}: groups={groups} needs a concrete size for channel axis {ch.name}, "
                              f"got the symbol {ch.size!r}")
        if groups > 1 and ch.size % groups:
            raise TypingError(f"{what}: channel axis {ch.describe()} is not divisible by groups={groups}")
    names = {c.name, o.name}
    for a in spatial + kernel:
        if a.name in names:
            raise TypingError(f"{what}: axis name {a.name} is used twice ({c.name}, {o.name}, spatial "
                              f"{[s.name for s in spatial]}, kernel {[k.name for k in kernel]})")
        names.add(a.name)
    out = _out_axes(spatial, kernel, out, stride, padding, dilation, transposed, output_padding, what)
    for a in out:
        if a.name in names - {s.name for s in spatial}:
            raise TypingError(f"{what}: output axis {a.name} clashes with a channel or kernel axis")

    g = Builder(dtype)
    ci = Axis(f"{c.name}_in", c.size) if c.name == o.name else c
    cg = Axis(f"{ci.name}g", ci.size // groups) if groups > 1 else ci
    og = Axis(f"{o.name}g", o.size // groups) if groups > 1 else o
    X = g.input("X", c, *spatial)
    W = g.input("W", *((ci, og) if transposed else (o, cg)), *kernel)
    B = g.input("bias", o) if bias else None
    gx = Axis("g", groups)
    Wg, Bg = W, B
    if groups > 1:   # the splits of the weights first: views of HBM that leave the rest one kernel
        Wg = g.box(split_box(g.ty(W), ci if transposed else o, gx, cg if transposed else og), W)
        Bg = g.box(split_box(g.ty(B), o, gx, og), B) if B is not None else None
    U = g.rename(X, c, ci) if ci != c else X
    for a, new, k, s, p, dl, op in zip(spatial, out, kernel, stride, padding, dilation, output_padding):
        how = dict(stride=1, dilation=-dl, offset=p, divisor=s) if transposed else \
            dict(stride=s, dilation=dl, offset=-p)
        box = unfold_box(g.ty(U), a, new, k, **how)
        if new.symbolic:   # its size follows from a's when that is bound (Diagram.bind)
            rule = ConvLength(new.name, a, k, s, p, dl, transposed, op)
            box = Box(box.kind, box.dom, box.cod, box.params + (("length", rule),), box.name)
        U = g.box(box, U)
    if groups > 1:
        U = g.box(split_box(g.ty(U), ci, gx, cg), U)
        Y = g.contract(U, Wg, out=(gx, og, *out), name="Y")
        if Bg is not None:
            Y = g.map("add", Y, Bg, out=(gx, og, *out))
        Y = g.box(merge_box(g.ty(Y), gx, og, o), Y)
    else:
        Y = g.contract(U, Wg, out=(o, *out), name="Y")
        if B is not None:
            Y = g.map("add", Y, B, out=(o, *out))
    d = g.diagram(Y, names=["Y"])
    return d if batch is None else d.weave(_axis(batch, "n", what), inputs=(0,))


def _out_axes(spatial, kernel, out, stride, padding, dilation, transposed, output_padding, what):
    want = []
    for a, k, s, p, dl, op in zip(spatial, kernel, stride, padding, dilation, output_padding):
        if a.symbolic or k.symbolic:
            want.append(None)
            continue
        m = out_size(a.size, k.size, s, p, dl, transposed, op)
        if m < 1:
            raise TypingError(f"{what}: axis {a.describe()} with kernel {k.describe()}, stride {s}, padding {p}, "
                              f"dilation {dl} leaves no output (size {m})")
        want.append(m)
    if out is None:
        return tuple(Axis(f"{a.name}o", f"{a.name}o" if m is None else m) for a, m in zip(spatial, want))
    out = tuple(_axis(a, f"y{i}", what) for i, a in enumerate(out))
    if len(out) != len(spatial):
        raise TypingError(f"{what}: {len(out)} output axes for {len(spatial)} spatial axes")
    for a, m in zip(out, want):
        if m is not None and not a.symbolic and a.size != m:
            raise TypingError(f"{what}: output axis {a.describe()} should have size {m} (PyTorch's formula)")
    return out


def conv1d(c=None, o=None, length=None, kernel=3, *, out: Axis | None = None, stride=1, padding=0,
           dilation=1, groups: int = 1, bias: bool = True, transposed: bool = False, output_padding=0,
           batch: Axis | None = None, dtype: DType = f32) -> Diagram:
    """``torch.nn.functional.conv1d`` (``conv_transpose1d`` with ``transposed=True``) as a diagram:
    ``X[c l] -> Y[o lo]``; ``kernel`` is an int or an :class:`Axis` (``k``)."""
    what = "conv1d"
    return conv(c, o, (_axis(length, "l", what),), (_kernel(kernel, "k", what),),
                out=None if out is None else (out,), stride=stride, padding=padding, dilation=dilation,
                groups=groups, bias=bias, transposed=transposed, output_padding=output_padding, batch=batch,
                dtype=dtype, what=what)


def conv2d(c=None, o=None, h=None, w=None, kernel=3, *, out: Sequence[Axis] | None = None, stride=1,
           padding=0, dilation=1, groups: int = 1, bias: bool = True, transposed: bool = False,
           output_padding=0, batch: Axis | None = None, dtype: DType = f32) -> Diagram:
    """``torch.nn.functional.conv2d`` (``conv_transpose2d`` with ``transposed=True``) as a diagram:
    ``X[c h w] -> Y[o ho wo]``; ``kernel`` is an int, a pair, or a pair of axes (``kh kw``)."""
    what = "conv2d"
    ks = (kernel, kernel) if not isinstance(kernel, (tuple, list)) else tuple(kernel)
    if len(ks) != 2:
        raise TypingError(f"{what}: kernel must be an int or 2 sizes, got {kernel!r}")
    return conv(c, o, (_axis(h, "h", what), _axis(w, "w", what)),
                (_kernel(ks[0], "kh", what), _kernel(ks[1], "kw", what)), out=out, stride=stride,
                padding=padding, dilation=dilation, groups=groups, bias=bias, transposed=transposed,
                output_padding=output_padding, batch=batch, dtype=dtype, what=what)


def _kernel(k, name: str, what: str) -> Axis:
    if isinstance(k, Axis):
        return k
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise TypingError(f"{what}: kernel size {name} must be an int >= 1 or an Axis, got {k!r}")
    return Axis(name, k)


__all__ = ["conv", "conv1d", "conv2d", "out_size"]
