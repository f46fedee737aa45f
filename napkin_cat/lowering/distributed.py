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

The per-device work is the diagram's relabelings inside a device, bound at the block sizes:
the generated kernel on float32 CUDA tensors (``nc.lower``, verified), the tiled NumPy executor
otherwise (float64 in float64; gloo on the CPU).  ``op.last_path`` says which
(``"ring:gpu"``, ``"ring:executor"``, ...).  Forward only: an input that requires a gradient is
refused (the ring's backward is not written).

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> ring = nc.library.attention(q=q, x=x, d=d).tile(q, "devices").stream(x, "devices")
>>> plan = device_plan(ring.stream(x, 16).tile(q, 32))
>>> plan.kind, plan.tiled, plan.ring, plan.fold, str(plan.local)
('ring', 'q', 'x', 'online_softmax', 'Q[q d] f32, K[x d] f32, V[x d] f32 -> O[q d] f32, L[q] f32  | stream(x, 16), tile(q, 32)')
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
from ..core.errors import LoweringError, ShapeError, TypingError
from ..core.hierarchy import DEVICES
from ..ops.kinds import spec
from ..ops.residuals import with_logsumexp
from ..relabel.loopnest import final_form
from ..relabel.rules import device_splits

FOLDS = {"online_softmax": "online_softmax", "sum_contract": "sum"}


@dataclass(frozen=True)
class DevicePlan:
    """How a diagram split over the devices runs: ``kind`` (ring, gather, sharded), the axes
    split (``tiled``, ``ring``), the per-device diagram ``local`` (its relabelings inside a
    device; with the logsumexp outputs an online-softmax fold reads) and the ``fold``."""

    kind: str
    tiled: str | None
    ring: str | None
    local: Diagram
    fold: str | None
    outputs: int


def device_plan(d: Diagram) -> DevicePlan | None:
    """The plan of a diagram split over the devices; None when ``d`` is not split.  Raises
    :class:`LoweringError` naming what the runtime cannot run."""
    splits = device_splits(d)
    if not splits:
        return None
    tiled, ring = splits.get("tile"), splits.get("stream")
    plain = d.unrelabelled()
    for e in plain.eqns:
        if spec(e.box).indexed:
            raise LoweringError(f"torch_op({d.short()}): {e.box.name} reads global indices, and each device "
                                f"runs its blocks at local ones (the kernels take no block offsets yet); "
                                f"nc.evaluate and nc.check_equivalent run this split on one machine")
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
    local = Diagram(local.dom, local.cod, local.eqns, local.outs, inner)
    kind = "ring" if tiled and ring else ("gather" if ring else "sharded")
    return DevicePlan(kind, tiled, ring, local, fold, len(d.cod))


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
    docstring.  ``last_path``: ``"<kind>:<gpu|executor>"``; ``notes``: what was chosen and why."""

    def __init__(self, d: Diagram, tiles: dict, threads, verify, group=None):
        self.diagram, self.plan = d, device_plan(d)
        self.tiles, self.threads, self.verify, self.group = tiles, threads, verify, group
        self.last_path: str | None = None
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
        local: dict[str, int] = {}
        for arr, t in zip(d.dom, shards):
            if not isinstance(t, torch.Tensor):
                raise ShapeError(f"{self!r}: input {arr}: expected a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in (torch.float32, torch.float64) or t.dtype != shards[0].dtype:
                raise TypingError(f"{self!r}: input {arr} is {t.dtype}; the shards share one dtype, "
                                  f"torch.float32 (kernels) or torch.float64 (reference executor)")
            if t.device != shards[0].device:
                raise ShapeError(f"{self!r}: input {arr} is on {t.device}, {d.dom[0]} on {shards[0].device}")
            if t.requires_grad and torch.is_grad_enabled():
                raise LoweringError(f"{self!r}: input {arr} requires a gradient; the backward of a split "
                                    f"over the devices is not written (run it under torch.no_grad())")
            if t.dim() != len(arr.axes):
                raise ShapeError(f"{self!r}: shard of {arr}: expected {len(arr.axes)} axes, got shape {tuple(t.shape)}")
            for ax, n in zip(arr.axes, t.shape):
                split = ax.name in (plan.tiled, plan.ring)
                if not ax.symbolic:
                    if split and ax.size % world:
                        raise ShapeError(f"{self!r}: axis {ax.name} = {ax.size} does not split over "
                                         f"{world} devices (the world size must divide it)")
                    want = ax.size // world if split else ax.size
                    if n != want:
                        raise ShapeError(f"{self!r}: shard of {arr}: axis {ax.name} should be {want} "
                                         f"({ax.name} = {ax.size}{f' over {world} devices' if split else ''}), "
                                         f"got shape {tuple(t.shape)}")
                if local.setdefault(ax.name, int(n)) != n:
                    raise ShapeError(f"{self!r}: shard of {arr}: axis {ax.name} is {n} here and "
                                     f"{local[ax.name]} in another input shard")
        return local

    # ---- the work of one device
    def _compute(self, sizes: dict, tensors) -> tuple[torch.Tensor, ...]:
        first = tensors[0]
        local = self.plan.local
        names = {a.name for a in local.axes}
        bound = local.bind({k: v for k, v in sizes.items() if k in names})
        key = tuple(sorted(sizes.items()))
        if first.device.type == "cuda" and first.dtype == torch.float32:
            from . import lower
            if ("kernel", key) not in self._cache:
                self._cache[("kernel", key)] = lower(bound, tiles=self.tiles or None, threads=self.threads,
                                                     verify=self.verify)
            outs = self._cache[("kernel", key)](*(t.contiguous() for t in tensors))
            self._path = "gpu"
            return outs if isinstance(outs, tuple) else (outs,)
        from ..verify.executor import evaluate
        from .schedule import choose
        if ("schedule", key) not in self._cache:
            self._cache[("schedule", key)] = choose(bound, self.tiles or None, self.threads, simulate=False).diagram
        outs = evaluate(self._cache[("schedule", key)], *(t.detach().cpu().numpy() for t in tensors),
                        reference=first.dtype == torch.float64)
        outs = outs if isinstance(outs, tuple) else (outs,)
        self._path = "executor"
        return tuple(torch.as_tensor(np.ascontiguousarray(o)).to(first.device, first.dtype) for o in outs)

    def _fold(self, state, part):
        if self.plan.fold == "sum":
            return tuple(part) if state is None else tuple(s + p for s, p in zip(state, part))
        o, lse = self.plan.local.cod[0], self.plan.local.cod[1]
        return fold_online_softmax(state, part, o.axis_names, lse.axis_names)

    def __call__(self, *shards):
        rank, world = self._world()
        sizes = self._check(shards, world)
        plan = self.plan
        with torch.no_grad():
            if plan.kind == "sharded":
                state = self._compute(sizes, shards)
            elif plan.kind == "gather":
                state = self._gather(self._compute(sizes, shards), world)
            else:
                state = self._ring(sizes, shards, rank, world)
        self.last_path = f"{plan.kind}:{self._path}"
        outs = state[:plan.outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)

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

    def _ring(self, sizes: dict, shards, rank: int, world: int):
        """``world`` steps; at step ``t`` this device holds the block of rank ``rank - t`` and
        sends it on to ``rank + 1`` while computing on it (two buffers: one computed on, one
        received into)."""
        import torch.distributed as dist
        moving = [i for i, a in enumerate(self.diagram.dom) if a.has(self.plan.ring) and not a.has(self.plan.tiled)]
        shapes = [shards[i].shape for i in moving]
        counts = [shards[i].numel() for i in moving]
        cur = torch.cat([shards[i].reshape(-1) for i in moving])
        spare = torch.empty_like(cur)
        peer = lambda r: dist.get_global_rank(self.group, r) if self.group is not None else r  # noqa: E731
        send_to, recv_from = peer((rank + 1) % world), peer((rank - 1) % world)
        state = None
        for step in range(world):
            reqs = []
            if step + 1 < world:
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, cur, send_to, self.group),
                                               dist.P2POp(dist.irecv, spare, recv_from, self.group)])
            views = list(shards)
            for i, part in zip(moving, torch.split(cur, counts)):
                views[i] = part.view(shapes[moving.index(i)])
            state = self._fold(state, self._compute(sizes, views))
            for r in reqs:
                r.wait()
            cur, spare = spare, cur
        return state
