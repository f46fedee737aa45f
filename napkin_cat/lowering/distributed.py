"""Beyond one GPU: ``nc.torch_op(d)`` for a diagram split over the devices, on torch.distributed.

One process per GPU (started by ``torchrun``), each holding its blocks of the split axes: the
``op`` takes the shards and returns this device's outputs.  What runs comes from the final form:

``ring``     ``tile(q, DEVICES).stream(x, DEVICES)``: the streamed inputs rotate around the ring
             of devices (batched point-to-point send/recv, double-buffered: the next block
             travels while this one is computed).  Each step computes this device's partial
             result on the block it holds, ``(O_j, L_j)`` (the diagram with its row logsumexp,
             :func:`~napkin_cat.ops.residuals.with_logsumexp`), and folds it into the state with the
             online-softmax accumulator: the state ``(O, L)`` is ``(o / z, mu + log z)``, and a
             partial is a one-column chunk with score ``L_j`` and value ``O_j``.  A sum
             accumulator (a matmul streamed over the devices) folds by adding.
``gather``   ``stream(x, DEVICES)`` alone: each device folds its own block, then the partial
             states are all-gathered and folded in rank order (every device gets the output).
``sharded``  ``tile(q, DEVICES)`` alone: no communication; the other inputs are replicated.

Masks and biases read global indices (causal, window, ALiBi, ``nc.mask_mod`` / ``nc.bias_mod``):
for each pair of a query piece and a key piece a device holds, the host knows their global
offsets and classifies the pair from the mask's derived block sparsity
(:func:`~napkin_cat.relabel.devices.block_view`): *empty* (a mask on the ring's stream removes
all of it: nothing is computed, the block still travels), *full* (the mask keeps all of it: the
diagram runs without it) or *partial* (the mask, shifted to the pair's offsets: ``causal(c)``
becomes ``causal(c + q0 - x0)``, an index expression reads ``i + q0``, ``j + x0``).  Each
distinct block diagram is one kernel (a causal ring compiles two: the shifted mask on the
diagonal blocks, none on the others).  Refused, with a :class:`LoweringError` naming it: a mask
or bias gathering from an auxiliary tensor over a split axis (a device holds only its block of
it, the gather reads global indices), and an input carrying both split axes.

The layout of a split (``tile(q, "devices", order="zigzag")``, :mod:`napkin_cat.relabel.devices`)
says which pieces of the axis each device's shard holds: contiguous, one block per device, or
zig-zag, chunks ``r`` and ``2W - 1 - r`` of ``2W`` concatenated (causal work balanced).
:func:`shard` cuts full inputs into a rank's shards, :func:`unshard` puts the ranks' outputs
back together.

The per-device work is the diagram's relabelings inside a device, bound at the block sizes:
the generated kernel (``nc.lower``, verified) on CUDA tensors of float32, float16 or bfloat16
(16-bit shards: the block's diagram retyped to read them in 16 bits on tensor cores and to write
its partial ``(O_j, L_j)`` in fp32, which the fold reads; the output is returned in the shards'
dtype), the same kernel in numba's simulator on CPU tensors while it is active (``simulate``, as
:func:`~napkin_cat.torch_op`'s), and the tiled NumPy executor otherwise (float64 in float64; gloo
on the CPU).  ``op.last_path`` says which (``"ring:gpu"``, ``"ring:simulator"``,
``"ring:executor"``, ...).

Shards that require a gradient make the op differentiable (:mod:`.distributed_backward`): the
forward keeps each row's ``(O, L)``, and ``backward()`` runs FlashAttention-2's backward block
by block against them, the key blocks rotating again with their gradient accumulators, which
end on the devices that hold the blocks.  ``op.last_backward_path`` (``"ring:gpu-fa2"``,
``"ring:executor-fa2"``, ...) and ``op.last_backward_blocks`` say what ran.  With 16-bit shards the
gradients are added up, and travel around the ring, in fp32, and are returned in the shards' dtype.

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> ring = nc.library.attention(q=q, x=x, d=d).tile(q, "devices").stream(x, "devices")
>>> plan = device_plan(ring.stream(x, 16).tile(q, 32))
>>> plan.kind, plan.tiled, plan.ring, plan.fold, str(plan.local)
('ring', 'q', 'x', 'online_softmax', 'Q[q d] f32, K[x d] f32, V[x d] f32 -> O[q d] f32, L[q] f32  | stream(x, 16), tile(q, 32)')
>>> causal = nc.library.attention(q=q, x=x, d=d, causal=True)
>>> zig = causal.tile(q, "devices", order="zigzag").stream(x, "devices", order="zigzag")
>>> plan = device_plan(zig)
>>> plan.layouts, len(plan.skips)
(('zigzag', 'zigzag'), 1)
>>> import numpy as np
>>> Q = np.arange(16.0).reshape(8, 2)
>>> shard(zig, (Q, Q, Q), world=2, rank=1)[0][:, 0]          # chunks 1 and 2 of 4: rows 2, 3, 4, 5
array([ 4.,  6.,  8., 10.])
>>> parts = [shard(zig, (Q, Q, Q), 2, r)[0] for r in (0, 1)]
>>> bool((unshard(zig, parts, 2) == Q).all())
True
>>> try:
...     nc.torch_op(ring)(*[__import__("torch").ones(4, 2)] * 3)
... except nc.NapkinError as e:
...     print(str(e).split(";")[0])
torch_op(Q[q d] f32, K[x d] f32, V[x d] f32 -> O[q d] f32  | tile(q, devices), stream(x, devices)) runs one process per device and finds no process group
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.diagram import Diagram
from ..core.errors import LoweringError, NapkinError, ShapeError, TypingError
from ..core.hierarchy import DEVICES
from ..core.types import DTYPES
from ..ops.kinds import spec
from ..ops.residuals import with_logsumexp
from ..relabel.balance import ring_skips
from ..relabel.devices import CHUNKS, block_view, layout_of, mask_key, pieces
from ..relabel.loopnest import final_form
from ..relabel.rules import device_splits
from .distributed_backward import SplitBackward, SplitFunction, cut_to
from .torch_dtypes import HALF_DTYPES, KERNEL_DTYPE, REFERENCE_DTYPE, _host, _launch, kernel_path, state_dtype

FOLDS = {"online_softmax": "online_softmax", "sum_contract": "sum"}
KERNEL_DTYPES = (KERNEL_DTYPE, *HALF_DTYPES)                  # shards the generated kernels take
SHARD_DTYPES = (*KERNEL_DTYPES, REFERENCE_DTYPE)


@dataclass(frozen=True)
class DevicePlan:
    """How a diagram split over the devices runs: ``kind`` (ring, gather, sharded), the axes
    split (``tiled``, ``ring``), the per-device diagram ``local`` (its relabelings inside a
    device; with the logsumexp outputs an online-softmax fold reads), the ``fold``, the
    ``layouts`` of the tiled and ring axes, and ``skips``: the masks (by
    :func:`~napkin_cat.relabel.devices.mask_key`) that empty a block they remove whole."""

    kind: str
    tiled: str | None
    ring: str | None
    local: Diagram
    fold: str | None
    outputs: int
    layouts: tuple[str, str] = ("contiguous", "contiguous")
    skips: tuple[str, ...] = ()
    block: Diagram | None = None


def device_plan(d: Diagram) -> DevicePlan | None:
    """The plan of a diagram split over the devices; None when ``d`` is not split.  Raises
    :class:`LoweringError` naming what the runtime cannot run."""
    splits = device_splits(d)
    if not splits:
        return None
    tiled, ring = splits.get("tile"), splits.get("stream")
    plain = d.unrelabelled()
    split = {a for a in (tiled, ring) if a}
    both = [arr for arr in plain.dom if tiled and ring and arr.has(tiled) and arr.has(ring)]
    if both:
        raise LoweringError(f"torch_op({d.short()}): input {both[0]} carries both {tiled} (tiled over the "
                            f"devices) and {ring} (rotating around the ring); the ring moves inputs without "
                            f"the tiled axis only")
    for e in plain.eqns:
        if not spec(e.box).indexed:
            continue
        for aux in e.box.dom[1:]:
            if split & set(aux.axis_names):
                raise LoweringError(f"torch_op({d.short()}): {e.box.name} gathers from {aux}, which carries "
                                    f"{sorted(split & set(aux.axis_names))[0]}, split over the devices: a device "
                                    f"holds only its block of {aux.name}, and the gather reads it at global "
                                    f"indices; give the auxiliary tensor an axis of its own")
    inner = tuple(r for r in d.schedule if r.size != DEVICES)
    fold, local = None, plain
    if ring is not None:
        rules = {a.rule for a in final_form(d).accumulators if a.axis == ring}
        folds = {FOLDS.get(r) for r in rules}
        if None in folds or len(folds) != 1:
            raise LoweringError(f"torch_op({d.short()}): the stream of {ring} over the devices folds with "
                                f"{sorted(rules)}; the runtime folds partial results with one of {sorted(FOLDS)}")
        (fold,) = folds
        if fold == "online_softmax":
            local = with_logsumexp(plain)
            if len(local.cod) != 2 * len(d.cod) or len(d.cod) != 1:
                raise LoweringError(f"torch_op({d.short()}): the ring folds one softmax-contraction output "
                                    f"with its logsumexp; this diagram has {len(d.cod)} outputs")
    if ring is None and len(d.cod) == 1 and with_logsumexp(plain) is not None:
        local = with_logsumexp(plain)       # sharded attention keeps L for its backward
    local = Diagram(local.dom, local.cod, local.eqns, local.outs, inner)
    block = Diagram(plain.dom, plain.cod, plain.eqns, plain.outs, inner)
    kind = "ring" if tiled and ring else ("gather" if ring else "sharded")
    skips = tuple(mask_key(k.row, k.col, k.pred) for k in ring_skips(d))
    layouts = (layout_of(d, tiled) if tiled else "contiguous", layout_of(d, ring) if ring else "contiguous")
    return DevicePlan(kind, tiled, ring, local, fold, len(d.cod), layouts, skips, block)


# --------------------------------------------------------------------------- shards of full arrays

def _cat(parts, dim: int):
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts, dim)
    return np.concatenate(parts, dim)


def _split_axes(d: Diagram) -> dict[str, str]:
    return {a: layout_of(d, a) for a in device_splits(d).values()}


def shard(d: Diagram, arrays, world: int, rank: int) -> tuple:
    """The shards of the full input ``arrays`` (NumPy arrays or tensors) that device ``rank``
    of ``world`` passes to ``nc.torch_op(d)``: each axis split over the devices cut to the
    pieces that rank holds in its layout (:func:`~napkin_cat.relabel.devices.pieces`)."""
    if len(arrays) != len(d.dom):
        raise ShapeError(f"shard({d.short()}): {len(d.dom)} inputs ({', '.join(map(str, d.dom))}), got {len(arrays)}")
    split = _split_axes(d)
    out = []
    for arr, t in zip(d.dom, arrays):
        if len(t.shape) != len(arr.axes):
            raise ShapeError(f"shard({d.short()}): {arr} has {len(arr.axes)} axes, got shape {tuple(t.shape)}")
        for k, name in enumerate(arr.axis_names):
            if name in split:
                idx = (slice(None),) * k
                try:
                    got = pieces(split[name], t.shape[k], world, rank)
                except ShapeError as e:
                    raise ShapeError(f"shard({d.short()}): input {arr}, axis {name}: {e}") from None
                t = _cat([t[idx + (slice(s, s + n),)] for s, n in got], k)
        out.append(t)
    return tuple(out)


def unshard(d: Diagram, outputs, world: int):
    """The full output of ``d`` from the ranks' outputs (``outputs[r]``: rank ``r``'s output, or
    its tuple of outputs): the pieces of an axis split over the devices put back in place; an
    output without one (every rank holds all of it) is rank 0's."""
    if len(outputs) != world:
        raise ShapeError(f"unshard({d.short()}): one output per rank, {world} ranks, got {len(outputs)}")
    split = _split_axes(d)
    many = isinstance(outputs[0], tuple)
    per_rank = [o if many else (o,) for o in outputs]
    full = []
    for i, arr in enumerate(d.cod):
        got = per_rank[0][i]
        k = next((k for k, name in enumerate(arr.axis_names) if name in split), None)
        if k is not None:      # (global start, the rank's output cut to that piece), sorted
            layout, n = split[arr.axis_names[k]], got.shape[k] * world
            parts = []
            for r in range(world):
                at = 0
                for s, m in pieces(layout, n, world, r):
                    parts.append((s, per_rank[r][i][(slice(None),) * k + (slice(at, at + m),)]))
                    at += m
            got = _cat([t for _, t in sorted(parts, key=lambda p: p[0])], k)
        full.append(got)
    return tuple(full) if many else full[0]


# --------------------------------------------------------------------------- folding partials

def _align(t: torch.Tensor, src: tuple, dst: tuple) -> torch.Tensor:
    """``t`` over axes ``src`` viewed over ``dst`` (a subset, same order: size-1 where absent)."""
    shape = [t.shape[src.index(n)] if n in src else 1 for n in dst]
    return t.reshape(shape)


def fold_online_softmax(state, part, names: tuple, stat: tuple):
    """Fold the partial ``(O_j, L_j)`` into the state ``(O, L)``: the online-softmax update
    (``mu' = max(mu, L_j)``, ``z' = e^(mu - mu') z + e^(L_j - mu')``, ``o' = e^(mu - mu') o +
    e^(L_j - mu') O_j``) of the state ``(mu, z, o) = (L, 1, O)``, finalised.  A row that no block
    has seen (``L = -inf``) keeps ``O = 0``, as the oracle does."""
    if state is None:
        return part
    (o, lse), (oj, lj) = state, part
    mu = torch.maximum(lse, lj)
    safe = torch.where(mu == -torch.inf, torch.zeros_like(mu), mu)
    a, b = torch.exp(lse - safe), torch.exp(lj - safe)
    z = a + b
    out = (_align(a, stat, names) * o + _align(b, stat, names) * oj) / _align(torch.where(z != 0, z, 1), stat, names)
    return out, safe + torch.log(z)


# --------------------------------------------------------------------------- the op

class DistributedOp:
    """``op(*shards)`` on every rank of the default process group (or ``group``): see the module
    docstring.  ``last_path``: ``"<kind>:<gpu|executor>"``; ``notes``: what was chosen and why;
    ``last_blocks``: how many block pairs of the last call were ``empty`` (skipped), ``full``
    (run without their mask) and ``partial``."""

    def __init__(self, d: Diagram, tiles: dict, threads, verify, group=None, backward_op=None, prefetch=False,
                 simulate: bool | None = None):
        self.diagram, self.plan, self.prefetch, self.simulate = d, device_plan(d), prefetch, simulate
        self.tiles, self.threads, self.verify, self.group = tiles, threads, verify, group
        self.last_path: str | None = None
        self.last_blocks: dict[str, int] = {}
        self.last_backward_path: str | None = None
        self.last_backward_blocks: dict[str, int] = {}
        self._backward = SplitBackward(self, self.plan.block, backward_op)
        self.notes: list[str] = []
        self._cache: dict = {}

    def __repr__(self) -> str:
        return f"torch_op({self.diagram})"

    # ---- checks, before anything is computed
    def _world(self) -> tuple[int, int]:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise LoweringError(f"{self!r} runs one process per device and finds no process group; start "
                                f"it with torchrun (torchrun --nproc_per_node 2 script.py) and call "
                                f"torch.distributed.init_process_group('nccl' or 'gloo') first")
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def _check(self, shards, world: int) -> dict[str, int]:
        """Local sizes per axis name; refuses wrong counts, dtypes, devices and shard shapes."""
        d, plan = self.diagram, self.plan
        if len(shards) != len(d.dom):
            raise ShapeError(f"{self!r} takes {len(d.dom)} shards ({', '.join(map(str, d.dom))}), got {len(shards)}")
        chunks = {a: CHUNKS[lay] for a, lay in zip((plan.tiled, plan.ring), plan.layouts) if a}
        local: dict[str, int] = {}
        for arr, t in zip(d.dom, shards):
            if not isinstance(t, torch.Tensor):
                raise ShapeError(f"{self!r}: input {arr}: expected a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in SHARD_DTYPES or t.dtype != shards[0].dtype:
                raise TypingError(f"{self!r}: input {arr} is {t.dtype}; the shards share one dtype, "
                                  f"torch.float32, torch.float16 or torch.bfloat16 (kernels) or "
                                  f"torch.float64 (reference executor)")
            if t.device != shards[0].device:
                raise ShapeError(f"{self!r}: input {arr} is on {t.device}, {d.dom[0]} on {shards[0].device}")
            if t.dim() != len(arr.axes):
                raise ShapeError(f"{self!r}: shard of {arr}: expected {len(arr.axes)} axes, got shape {tuple(t.shape)}")
            for ax, n in zip(arr.axes, t.shape):
                k = chunks.get(ax.name)
                how = "" if k in (None, 1) else f" in 2 x {world} zig-zag chunks"
                if k and (ax.size if not ax.symbolic else n * world) % (k * world):
                    raise ShapeError(f"{self!r}: axis {ax.name} = {ax.size if not ax.symbolic else n * world} does "
                                     f"not split over {world} devices{how} ({k * world} must divide it)")
                if not ax.symbolic:
                    want = ax.size // world if k else ax.size
                    if n != want:
                        raise ShapeError(f"{self!r}: shard of {arr}: axis {ax.name} should be {want} "
                                         f"({ax.name} = {ax.size}{f' over {world} devices' if k else ''}), "
                                         f"got shape {tuple(t.shape)}")
                if local.setdefault(ax.name, int(n)) != n:
                    raise ShapeError(f"{self!r}: shard of {arr}: axis {ax.name} is {n} here and "
                                     f"{local[ax.name]} in another input shard")
        return local

    # ---- the work of one device on one block pair
    def _compute(self, local: Diagram, key: tuple, sizes: dict, tensors) -> tuple[torch.Tensor, ...]:
        """One block pair's partial outputs, in :func:`state_dtype` of the inputs (16-bit inputs:
        the kernel reads them in 16 bits, on tensor cores, and writes fp32 partials for the fold)."""
        first = tensors[0]
        names = {a.name for a in local.axes}
        sizes = {k: v for k, v in sizes.items() if k in names}
        key = (key, first.dtype, tuple(sorted(sizes.items())))
        if self._path != "executor":
            from . import lower
            typed = self._typed(local, first.dtype)
            if ("kernel", key) not in self._cache:
                self._cache[("kernel", key)] = lower(typed.bind(sizes), tiles=self.tiles or None,
                                                     threads=self.threads, verify=self.verify,
                                                     prefetch=self.prefetch)
            return _launch(self._cache[("kernel", key)], [t.contiguous() for t in tensors], typed)
        from ..verify.executor import evaluate
        if ("schedule", key) not in self._cache:
            self._cache[("schedule", key)] = self._schedule(local, key, sizes)
        outs = evaluate(self._cache[("schedule", key)], *_host(tensors), reference=first.dtype != KERNEL_DTYPE)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return tuple(torch.as_tensor(np.ascontiguousarray(o)).to(first.device, state_dtype(first.dtype))
                     for o in outs)

    @staticmethod
    def _typed(local: Diagram, dtype: torch.dtype) -> Diagram:
        """A block's diagram for inputs of ``dtype``: 16-bit inputs, fp32 outputs (the partials
        folded across blocks, as FlashAttention's ring implementations keep them)."""
        if dtype not in HALF_DTYPES:
            return local
        from .backward_forms import at_dtype
        return at_dtype(local, DTYPES[HALF_DTYPES[dtype]], {a.name: DTYPES["f32"] for a in local.cod})

    def _schedule(self, local: Diagram, key: tuple, sizes: dict) -> Diagram:
        """The executor's relabelings of a block's diagram: those chosen once for the device's
        diagram at these sizes (a block's variant differs only in its masks' offsets), applied
        verb by verb, or chosen afresh where one does not apply."""
        from .backward_parts import relabel_like
        from .schedule import choose
        base = ("schedule", ((), *key[1:]))
        if base not in self._cache:
            self._cache[base] = choose(self.plan.local.bind(sizes), self.tiles or None, self.threads,
                                       simulate=False).diagram
        if key == base[1]:
            return self._cache[base]
        try:
            return relabel_like(local.bind(sizes).unrelabelled(), self._cache[base].schedule)
        except NapkinError:
            return choose(local.bind(sizes), self.tiles or None, self.threads, simulate=False).diagram

    def _fold(self, state, part):
        if self.plan.fold is None:        # sharded: one block of the columns, nothing to fold
            return part
        if self.plan.fold == "sum":
            return tuple(part) if state is None else tuple(s + p for s, p in zip(state, part))
        o, lse = self.plan.local.cod[0], self.plan.local.cod[1]
        return fold_online_softmax(state, part, o.axis_names, lse.axis_names)

    def _empty(self, sizes: dict, like: torch.Tensor):
        """The state of rows no block reached: zeros (and a logsumexp of ``-inf``)."""
        out = []
        for i, arr in enumerate(self.plan.local.cod):
            fill = -torch.inf if self.plan.fold == "online_softmax" and i == 1 else 0.0
            out.append(torch.full(tuple(sizes[n] for n in arr.axis_names), fill, dtype=state_dtype(like.dtype),
                                  device=like.device))
        return tuple(out)

    def _pieces(self, which: int, totals: dict, world: int, rank: int):
        """``(global start, local start, length)`` of the pieces of the tiled (0) or ring (1) axis
        that ``rank`` holds; ``[None]`` (the whole axis) when that axis is not split."""
        axis = (self.plan.tiled, self.plan.ring)[which]
        if axis is None:
            return [None]
        out, at = [], 0
        for s, n in pieces(self.plan.layouts[which], totals[axis], world, rank):
            out.append((s, at, n))
            at += n
        return out

    def block_pairs(self, d: Diagram, tag: str, tensors, moving: dict, rows, cols, sizes: dict, totals: dict,
                    counts: dict):
        """Every (row piece, column piece) pair this device meets: ``(row piece index, block
        sizes, the block's view of d, the inputs cut to the block, the cut)``, where ``tensors``
        are the shards with the ring's moving inputs replaced by ``moving``.  Each pair is counted
        in ``counts`` as ``empty`` (not yielded: a mask removes it whole), ``full`` (run without
        the mask), ``partial`` or ``unmasked``; views are cached under ``tag``."""
        plan = self.plan
        for a, rp in enumerate(rows):
            for cp in cols:
                ranges, cut, block = {}, {}, dict(sizes)
                for axis, p in ((plan.tiled, rp), (plan.ring, cp)):
                    if p is not None:
                        ranges[axis], cut[axis], block[axis] = (p[0], p[0] + p[2]), (p[1], p[2]), p[2]
                key = (tag, tuple(sorted(ranges.items())))
                if key not in self._cache:
                    self._cache[key] = block_view(d, ranges, totals, plan.skips)
                view = self._cache[key]
                kind = "empty" if view.empty else "full" if view.key and all(k == ("drop",) for k in view.key) \
                    else "partial" if view.key else "unmasked"
                counts[kind] = counts.get(kind, 0) + 1
                if view.empty:
                    continue
                views = [cut_to(moving.get(i, t), arr, cut) for i, (arr, t) in enumerate(zip(self.diagram.dom, tensors))]
                yield a, block, view, views, cut

    def _blocks(self, states: list, tensors, moving: dict, rows, cols, sizes: dict, totals: dict) -> None:
        """Fold every (row piece, column piece) pair into ``states`` (one per row piece)."""
        for a, block, view, views, _ in self.block_pairs(self.plan.local, "forward view", tensors, moving, rows,
                                                        cols, sizes, totals, self.last_blocks):
            states[a] = self._fold(states[a], self._compute(view.diagram, view.key, block, views))

    def __call__(self, *shards):
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in shards):
            outs = SplitFunction.apply(self, *shards)
        else:
            outs = self._run(shards)[0]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _run(self, shards):
        """``(outputs, per row piece states, local sizes, global sizes, rank, world)``."""
        rank, world = self._world()
        sizes = self._check(shards, world)
        plan = self.plan
        split = {a for a in (plan.tiled, plan.ring) if a}
        totals = {a: n * world if a in split else n for a, n in sizes.items()}
        rows = self._pieces(0, totals, world, rank)
        self.last_blocks = {}
        self._path = kernel_path(self, shards[0].dtype, shards[0].device, self.simulate)
        with torch.no_grad():
            states = [None] * len(rows)
            if plan.kind == "ring":
                self._ring(states, sizes, totals, shards, rows, rank, world)
            else:
                self._blocks(states, shards, {}, rows, self._pieces(1, totals, world, rank), sizes, totals)
            for a, rp in enumerate(rows):
                if states[a] is None:
                    states[a] = self._empty({**sizes, **({plan.tiled: rp[2]} if rp else {})}, shards[0])
            if plan.kind == "gather":
                states = [self._gather(states[0], world)]
        self.last_path = f"{plan.kind}:{self._path}"
        outs = []
        for i in range(plan.outputs):
            arr = plan.local.cod[i]
            k = arr.axis_names.index(plan.tiled) if plan.tiled in arr.axis_names else None
            out = states[0][i] if k is None or len(states) == 1 else torch.cat([s[i] for s in states], k)
            outs.append(out.to(shards[0].dtype) if arr.dtype.kind == "float" else out)
        return tuple(outs), states, sizes, totals, rank, world

    def _gather(self, part, world: int):
        import torch.distributed as dist
        state = None
        gathered = []
        for t in part:
            bufs = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(bufs, t.contiguous(), group=self.group)
            gathered.append(bufs)
        for j in range(world):
            state = self._fold(state, tuple(g[j] for g in gathered))
        return state

    def _ring(self, states: list, sizes: dict, totals: dict, shards, rows, rank: int, world: int) -> None:
        """``world`` steps; at step ``t`` this device holds the block of rank ``rank - t`` and
        sends it on to ``rank + 1`` while computing on it (two buffers: one computed on, one
        received into).  An empty block pair is not computed; its block travels all the same."""
        import torch.distributed as dist
        moving = [i for i, a in enumerate(self.diagram.dom) if a.has(self.plan.ring) and not a.has(self.plan.tiled)]
        shapes = [shards[i].shape for i in moving]
        counts = [shards[i].numel() for i in moving]
        cur = torch.cat([shards[i].reshape(-1) for i in moving])
        spare = torch.empty_like(cur)
        peer = lambda r: dist.get_global_rank(self.group, r) if self.group is not None else r  # noqa: E731
        send_to, recv_from = peer((rank + 1) % world), peer((rank - 1) % world)
        for step in range(world):
            reqs = []
            if step + 1 < world:
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, cur, send_to, self.group),
                                               dist.P2POp(dist.irecv, spare, recv_from, self.group)])
            held = {i: part.view(shapes[j]) for j, (i, part) in enumerate(zip(moving, torch.split(cur, counts)))}
            cols = self._pieces(1, totals, world, (rank - step) % world)
            self._blocks(states, shards, held, rows, cols, sizes, totals)
            for r in reqs:
                r.wait()
            cur, spare = spare, cur
