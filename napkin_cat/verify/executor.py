"""Evaluation: the NumPy oracle on any diagram, and the tiled executor for relabelled ones.

``evaluate(d, *arrays)`` runs an unrelabelled diagram equation by equation through the
reference rules (:mod:`napkin_cat.ops.semantics`).  A relabelled diagram runs its final form
(:mod:`napkin_cat.relabel.loopnest`) literally, chunk by chunk: each box through its rule,
each accumulator through its NumPy steps (:mod:`.accumulators`).  The same loop nest feeds
the cost model and the kernel generator, so checking the executor against the unrelabelled
oracle checks the relabelling those stages read.
"""

from __future__ import annotations

import numpy as np

from ..core.diagram import Diagram
from ..core.errors import ShapeError, TypingError
from ..core.hierarchy import DEVICES
from ..ops.semantics import (Ctx, _as_numpy, apply_box, check_call_options, check_inputs, concrete_shape,
                             resolve_sizes, run_eqns)
from ..relabel.accumulators import Accumulator
from ..relabel.devices import device_visits, layout_of
from ..relabel.loopnest import Compute, Finalise, Init, Load, Loop, Store, Update, final_form
from ..relabel.rules import check_blocks
from ..relabel.skipping import chunk_skips, visited
from ..relabel.split import AddStore, added_outputs
from ..ops.index import IntAlgebra
from . import accumulators as acc_steps


def evaluate(d: Diagram, *arrays, sizes: dict | None = None, params: dict | None = None,
             reference: bool = True):
    """Run ``d`` on NumPy arrays.  Returns one array, or a tuple when ``cod`` has several.

    ``reference=True`` (default) computes in float64; ``False`` computes in each wire's dtype
    (bf16 and fp8 in float32).  A relabelled diagram runs its loop nest chunk by chunk.

    >>> import numpy as np, napkin_cat as nc
    >>> a, b, c = nc.axes("a b c")
    >>> A, B = np.ones((2, 3)), np.ones((3, 4))
    >>> nc.evaluate(nc.library.matmul(a=a, b=b, c=c), A, B).shape
    (2, 4)
    """
    if not isinstance(d, Diagram):
        raise TypingError(f"evaluate needs a Diagram, got {type(d).__name__}")
    check_call_options(d, sizes, params, "evaluate")
    if not isinstance(reference, bool):
        raise TypingError(f"evaluate: reference must be True or False, got {reference!r}")
    if len(arrays) == len(d.dom):
        arrays = tuple(_as_numpy(x, a) for x, a in zip(arrays, d.dom))
    check_inputs(d, arrays)
    bound = resolve_sizes(d, arrays, sizes)
    ctx = Ctx(bound, {}, reference, dict(params or {}))
    inputs = [x.astype(ctx.dtype(a.dtype), copy=True) for x, a in zip(arrays, d.dom)]
    for arr, x in zip(d.dom, inputs):
        concrete_shape(arr, bound)
    if d.schedule:
        outs = execute(d, inputs, ctx)
    else:
        env: list = inputs + [None] * (len(d.var_types()) - len(inputs))
        run_eqns(d, env, ctx)
        outs = [env[v] for v in d.outs]
    outs = [np.array(o, copy=True) for o in outs]
    return outs[0] if len(outs) == 1 else tuple(outs)


class Fp32Ctx(Ctx):
    """Every float wire computed in float32, whatever its dtype: a 16-bit kernel's registers."""

    def dtype(self, dt):
        return np.float32 if dt.kind == "float" else super().dtype(dt)


SIXTEEN = ("f16", "bf16")


def evaluate_operands_rounded(d: Diagram, *arrays, sizes: dict | None = None, toward_zero: bool = False) -> tuple:
    """``d`` (unrelabelled) in float32, every computed 16-bit wire a ``contract`` box reads rounded
    to its dtype: what a tensor-core kernel does with the operands it packs (a backward's ``P``
    and ``dS``), its other intermediates kept in fp32 registers.  The 16-bit kernel check's plain
    implementation in the kernel's precision (:mod:`.kernelcheck`).

    ``toward_zero``: each contraction of 16-bit operands (a tensor-core product) also moves its
    fp32 result one unit in the last place toward zero.  Tensor cores add their products with
    truncation, not rounding to nearest (measured on V100, T4 and A100 by Fasi, Higham, Mikaitis,
    Pranesh: "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021; an H200 kernel's error
    had one sign as well), so their error has a sign: where a difference cancels
    (the backward's ``dP - D`` with both near 1e6), a one-sided error of half an fp32 unit summed
    over every row moves dK far more than errors of both signs do (kernels/BENCHMARKS.md,
    "Session of 2026-11-28 (H200)")."""
    from ..ops.arrays import round_to_dtype
    d = d.unrelabelled()
    arrays = tuple(_as_numpy(x, a) for x, a in zip(arrays, d.dom))
    check_inputs(d, arrays)
    ctx = Fp32Ctx(resolve_sizes(d, arrays, sizes), {}, False, {})
    types = d.var_types()
    packed = {v for e in d.eqns if e.box.kind == "contract" for v in e.ins
              if v >= len(arrays) and types[v].dtype.name in SIXTEEN}
    env: list = [x.astype(ctx.dtype(a.dtype)) for x, a in zip(arrays, d.dom)] + [None] * (len(types) - len(arrays))
    for k, e in enumerate(d.eqns):
        run_eqns(d, env, ctx, (k,))
        truncated = toward_zero and e.box.kind == "contract" and all(types[v].dtype.name in SIXTEEN for v in e.ins)
        for v in d.eqn_outputs(k):
            if truncated:
                env[v] = np.nextafter(np.asarray(env[v], np.float32), np.float32(0))
            if v in packed:
                env[v] = np.asarray(round_to_dtype(env[v], types[v].dtype.name), dtype=np.float32)
    return tuple(np.asarray(env[v], dtype=np.float64) for v in d.outs)


# --------------------------------------------------------------------------- the tiled executor

def _concrete(size, sizes: dict, what: str) -> int:
    if isinstance(size, str):
        if size not in sizes:
            raise ShapeError(f"{what} size {size!r} is symbolic: pass sizes={{'{size}': n}}")
        return int(sizes[size])
    return int(size)


def device_block(axis: str, n: int, sizes: dict) -> int:
    """The block of ``axis`` (``n`` long) each device holds: ``n / devices``, which must divide."""
    if DEVICES not in sizes:
        raise ShapeError(f"axis {axis} is split over the devices: pass sizes={{{DEVICES!r}: number of devices}}")
    p = int(sizes[DEVICES])
    if p < 1 or n % p:
        raise ShapeError(f"axis {axis} of size {n} does not split over {DEVICES}={p}: every device "
                         f"holds an equal block, so the number of devices must divide {n}")
    return n // p


def chunk_starts(start: int, stop: int, step: int) -> range:
    """Where the chunks of ``[start, stop)`` begin; the last one may be ragged (shorter)."""
    return range(start, stop, step)


def execute(d: Diagram, inputs: list[np.ndarray], ctx: Ctx) -> list[np.ndarray]:
    """Run the loop nest literally, chunk by chunk (ragged last chunks included).  Each box
    runs through its own NumPy rule; accumulators through their init/update/finalise.

    A value is read at the chunk of the loops around the reader: one computed outside an inner
    loop is sliced to that loop's chunk, and an accumulator updated inside a loop over an axis
    its state carries updates the slice of that chunk."""
    ff = final_form(d)
    check_blocks(d, ctx.sizes)
    dd = ff.diagram
    types = dd.var_types()
    out_arrays = {}
    added = added_outputs(ff)   # summed across blocks: they start at zero, each block adds its part
    for pos, v in enumerate(dd.outs):
        arr = types[v]
        shape = tuple(ctx.sizes[a] for a in arr.axis_names)
        out_arrays.setdefault(v, np.full(shape, 0.0 if v in added else np.nan, dtype=ctx.dtype(arr.dtype)))
    ranges = {a.name: (0, ctx.sizes[a.name]) for a in dd.axes}
    env: dict[int, np.ndarray] = {}
    env_start: dict[int, tuple[int, ...]] = {}   # var -> global index of its position 0, per axis
    states: dict[int, dict] = {}
    state_ranges: dict[int, dict] = {}

    def slices(names):
        return tuple(slice(*ranges[n]) for n in names)

    def define(v, value):
        names = types[v].axis_names
        env[v] = value
        # a box without inputs (param, const) makes the whole axis whatever the loop
        env_start[v] = tuple(ranges[n][0] if value.shape[i] == ranges[n][1] - ranges[n][0] else 0
                             for i, n in enumerate(names))

    def read(v):
        x, names = env[v], types[v].axis_names
        sl = []
        for i, n in enumerate(names):
            s0, (lo, hi) = env_start[v][i], ranges[n]
            if (lo, hi) == (s0, s0 + x.shape[i]):
                sl.append(slice(None))
            elif s0 <= lo and hi <= s0 + x.shape[i]:
                sl.append(slice(lo - s0, hi - s0))
            else:  # a loop nest reading a chunk outside the loop that made it: a bug in the nest
                raise AssertionError(f"{types[v]} holds {n}[{s0}:{s0 + x.shape[i]}], read at {n}[{lo}:{hi}]")
        return x[tuple(sl)] if any(s != slice(None) for s in sl) else x

    device = [0]   # the device a split over the devices runs on (the shard of the grid loop)

    def run(nodes):
        for n in nodes:
            if isinstance(n, Loop):
                start, stop = ranges[n.axis]
                if n.step == DEVICES:
                    # each device's blocks in its layout; the ring: device i meets its own block
                    # first, then those of i-1, i-2, ... as they arrive (relabel/devices.py)
                    device_block(n.axis, stop - start, ctx.sizes)
                    visits = device_visits(layout_of(d, n.axis), n.kind, n.axis, start, stop, ctx.sizes, device[0])
                else:
                    step = _concrete(n.step, ctx.sizes, f"{n.kind} of {n.axis}")
                    if step < 1:
                        raise ShapeError(f"{n.kind} size for {n.axis} must be >= 1, got {step}")
                    visits = [(None, s, s + step) for s in chunk_starts(start, stop, step)]
                # chunks a mask removes for every row of the tile are skipped, as in the kernel
                lo, hi = visited(chunk_skips(ff, n), ranges, stop, IntAlgebra)
                for dev, s, reach in visits:
                    if reach <= lo or s >= hi:
                        continue
                    if dev is not None:
                        device[0] = dev
                    ranges[n.axis] = (s, min(reach, stop))
                    run(n.body)
                ranges[n.axis] = (start, stop)
            elif isinstance(n, Load):
                define(n.var, inputs[n.var][slices(dd.dom[n.var].axis_names)])
            elif isinstance(n, Compute):
                e = dd.eqns[n.eqn]
                ctx.offsets = {a: r[0] for a, r in ranges.items()}
                outs = apply_box(e.box, [read(v) for v in e.ins], ctx)
                for v, o in zip(dd.eqn_outputs(n.eqn), outs):
                    define(v, o)
            elif isinstance(n, Init):
                acc = ff.accumulators[n.acc]
                shapes = {s: tuple(ranges[a][1] - ranges[a][0] for a in axes_) for s, axes_, _ in acc.states()}
                states[n.acc] = acc_steps.init(acc, shapes, ctx)
                state_ranges[n.acc] = dict(ranges)
            elif isinstance(n, Update):
                acc = ff.accumulators[n.acc]
                ctx.offsets = {a: r[0] for a, r in ranges.items()}
                _update(acc, states[n.acc], state_ranges[n.acc], ranges,
                        [read(v) for v in dd.eqns[acc.eqn].ins], ctx)
            elif isinstance(n, Finalise):
                acc = ff.accumulators[n.acc]
                outs = acc_steps.finalise(acc, states.pop(n.acc), ctx)
                for v, o in zip(dd.eqn_outputs(acc.eqn), outs):
                    define(v, np.asarray(o, dtype=ctx.dtype(types[v].dtype)))
            elif isinstance(n, AddStore):
                out_arrays[n.var][slices(types[n.var].axis_names)] += read(n.var)
            elif isinstance(n, Store) and not n.flush:  # a flush writes back what is already written
                out_arrays[n.var][slices(types[n.var].axis_names)] = read(n.var)

    run(ff.body)
    return [out_arrays[v] for v in dd.outs]


def _update(acc: Accumulator, state: dict, at_init: dict, ranges: dict, ins, ctx) -> None:
    """Update ``state`` in place with one chunk; where a loop inside the accumulator's own
    partitions an axis of a state, only that chunk's slice of the state changes."""
    cuts = {}
    for name, axes_, _ in acc.states():
        if any(ranges[a] != at_init[a] for a in axes_):
            cuts[name] = tuple(slice(ranges[a][0] - at_init[a][0], ranges[a][1] - at_init[a][0]) for a in axes_)
    view = {k: (v[cuts[k]] if k in cuts else v) for k, v in state.items()}
    new = acc_steps.update(acc, view, ins, ctx)
    for k, v in new.items():
        if k in cuts:
            state[k][cuts[k]] = v
        else:
            state[k] = v
