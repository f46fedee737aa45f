"""The backward of a diagram split over the devices: ring attention's gradients, block by block.

The forward (:class:`~.distributed.DistributedOp`) leaves each device with its rows' final state:
the outputs and, for an online-softmax fold, the row logsumexp ``L`` over *all* the keys.  With
that ``L`` the backward of FlashAttention-2 is additive over key blocks: for queries ``i`` and the
keys of block ``j``, ``P_ij = exp(S_ij - L_i)`` are the global probabilities and
``D_i = rowsum(dO_i * O_i)`` reads the global output, so

* ``dQ_i  = sum_j dS_ij K_j``: the sum over the blocks a device sees of the block backward's dQ;
* ``dK_j, dV_j = sum_i ...``: the sum over the devices' query rows of the block backward's dK, dV.

The block backward is the single-device one (``backward_op``: :class:`~.torch_op.TorchOp` of the
block's diagram, its masks shifted to the pair's global offsets by
:func:`~napkin_cat.relabel.devices.block_view`), fed the block's inputs, the global ``O`` and
``L`` of this device's rows and their ``dO``: the generated backward kernels on float32 CUDA
tensors (FlashAttention-2's two parts, lowered), the NumPy executor otherwise.  How the
contributions meet follows the final form's split:

``ring``     the key blocks rotate as in the forward; each travels with the accumulator of its
             gradients (``dK_j, dV_j``), which every device adds its rows' share to, so after
             ``world`` steps (and ``world`` sends of the accumulator) each block's gradient is
             back on the device that holds the block.  ``dQ`` stays where its rows are.
``gather``   each device differentiates its own key blocks against the global state; ``dQ``
             (every device holds all of ``Q``) is summed over the devices (all-reduce).
``sharded``  each device differentiates its rows against all the keys; the gradients of the
             inputs every device holds whole (``K``, ``V``) are summed over the devices.

An input that every device holds whole gets, on every rank, the gradient of the whole op (the
ranks' contributions all-reduced), as one device would compute it.  Blocks a mask removes whole
are skipped, as in the forward; a pair's masked block runs the shifted mask's backward.
A stream summed over the devices (a matmul's ``stream(b, devices)``) needs no residual: each
block's backward is its own.
"""

from __future__ import annotations

import torch

from ..core.diagram import Diagram
from ..core.errors import LoweringError
from .torch_dtypes import HALF_DTYPES, TORCH_DTYPES, state_dtype


class SplitBackward:
    """The gradients of one call of a split op (see the module docstring).  ``op``: the
    :class:`~.distributed.DistributedOp`; ``block``: its per-device diagram without the fold's
    extra outputs; ``backward_op``: the single-device op class that differentiates a block."""

    def __init__(self, op, block: Diagram, backward_op):
        self.op, self.block, self.backward_op = op, block, backward_op
        self._ops: dict = {}
        self.last_path: str | None = None
        self.last_blocks: dict[str, int] = {}

    def _block_op(self, view):
        """The single-device op of a block's diagram (one per distinct shifted mask)."""
        if view.key not in self._ops:
            op = self.op
            self._ops[view.key] = self.backward_op(view.diagram, dict(op.tiles or {}), op.threads, op.simulate, op.verify)
        return self._ops[view.key]

    def run(self, shards, states, douts, needs, sizes: dict, totals: dict, rank: int, world: int):
        """The gradients of the inputs flagged in ``needs`` (None for the others): ``shards``
        and ``states`` as the forward had them, ``douts`` the outputs' cotangents."""
        plan, op = self.op.plan, self.op
        wrt = tuple(i for i, n in enumerate(needs) if n)
        first = shards[0]
        acc = state_dtype(first.dtype)          # 16-bit shards: their gradients added up in fp32
        grads = {i: torch.zeros_like(shards[i], dtype=acc) for i in wrt}
        rows = op._pieces(0, totals, world, rank)
        self.last_blocks, self.last_path = {}, None
        cots = self._row_cotangents(douts, states, rows, sizes, first)
        moving = [i for i, a in enumerate(op.diagram.dom)
                  if plan.kind == "ring" and a.has(plan.ring) and not a.has(plan.tiled)]
        if plan.kind == "ring" and world > 1:
            self._ring(grads, shards, states, cots, moving, wrt, rows, sizes, totals, rank, world)
        else:
            cols = op._pieces(1, totals, world, rank)
            self._pairs(grads, grads, shards, {}, states, cots, wrt, rows, cols, sizes, totals)
        split = {a for a in (plan.tiled, plan.ring) if a}
        whole = [i for i in wrt if not split & set(op.diagram.dom[i].axis_names)]
        if whole and world > 1:
            import torch.distributed as dist
            for i in whole:
                dist.all_reduce(grads[i], group=op.group)
        return tuple(grads[i].to(shards[i].dtype) if i in grads else None for i in range(len(shards)))

    def _row_cotangents(self, douts, states, rows, sizes: dict, like):
        """Each row piece's cotangents of the op's outputs (zeros for an unused output)."""
        plan = self.op.plan
        out = []
        for a, rp in enumerate(rows):
            mine = []
            for i in range(plan.outputs):
                arr, st = plan.local.cod[i], states[a][i]
                g = douts[i]
                if g is None:
                    mine.append(torch.zeros_like(st))
                    continue
                k = arr.axis_names.index(plan.tiled) if plan.tiled in arr.axis_names else None
                mine.append(g if k is None or rp is None or len(rows) == 1 else g.narrow(k, rp[1], rp[2]))
            out.append(tuple(t.to(like.dtype).contiguous() for t in mine))
        return out

    def _pairs(self, grads, ring_grads, shards, held: dict, states, cots, wrt, rows, cols, sizes, totals):
        """Add every (row piece, column piece) pair's block gradients: into ``grads`` for the
        inputs that stay, into ``ring_grads`` for the blocks in ``held`` (the moving inputs)."""
        plan, op = self.op.plan, self.op
        state_names = [a.name for a in plan.local.cod]
        for a, block, view, views, cut in op.block_pairs(self.block, "backward view", shards, held, rows, cols,
                                                         sizes, totals, self.last_blocks):
            bop = self._block_op(view)
            names = {x.name for x in view.diagram.axes}
            bsizes = tuple(sorted((k, n) for k, n in block.items() if k in names and _symbolic(view.diagram, k)))
            bplan = bop.backward_plan(wrt, bsizes, views[0].dtype)
            named = dict(zip((x.name for x in op.diagram.dom), views))
            named.update(zip(state_names, states[a]))
            wires = {w.name: w for w in bplan.diagram.dom}
            named = {n: _as_wire(t, wires.get(n), views[0].dtype) for n, t in named.items()}
            missing = [n for n in bplan.saves if n not in named]
            if missing:
                raise LoweringError(f"{op!r}: the backward of a block reads {', '.join(missing)}, which the "
                                    f"forward over the devices does not keep (it keeps "
                                    f"{', '.join(state_names)} per row)")
            saved = tuple(named[n].contiguous() for n in bplan.saves)
            got = bop.backward(bsizes, wrt, saved, cots[a], views[0].dtype)
            self.last_path = bop.last_backward_path
            for i, g in zip(wrt, got):
                arr = op.diagram.dom[i]
                target = ring_grads[i] if i in held else grads[i]
                cut_to(target, arr, cut).add_(g.to(target.dtype))

    def _ring(self, grads, shards, states, cots, moving, wrt, rows, sizes, totals, rank: int, world: int):
        """``world`` steps; at step ``t`` this device holds key block ``rank - t``.  While it
        computes that block's share, the next key block arrives (as in the forward) and so does
        the accumulator of the held block's gradients, which the previous device finished at its
        step ``t - 1``; the share is added to it and sent on.  After the last step each
        accumulator travels once more, to the device that holds its block.  Sends to and
        receives from a neighbour are posted in the same order on both sides (accumulator,
        then key block), as NCCL and gloo match them."""
        import torch.distributed as dist
        group = self.op.group
        peer = lambda r: dist.get_global_rank(group, r) if group is not None else r  # noqa: E731
        send_to, recv_from = peer((rank + 1) % world), peer((rank - 1) % world)
        p2p = lambda ops: dist.batch_isend_irecv([dist.P2POp(f, t, r, group) for f, t, r in ops])  # noqa: E731
        shapes = [shards[i].shape for i in moving]
        counts = [shards[i].numel() for i in moving]
        cur = torch.cat([shards[i].reshape(-1) for i in moving])
        spare = torch.empty_like(cur)
        acc_of = [i for i in moving if i in grads]
        widths = [shards[i].numel() for i in acc_of]
        acc = state_dtype(shards[0].dtype)      # the accumulators travel in the dtype they add in
        acc_in = shards[0].new_empty(sum(widths), dtype=acc)
        sending = []
        for step in range(world):
            ops = [(dist.irecv, acc_in, recv_from)] if step and acc_of else []
            if step + 1 < world:
                ops += [(dist.isend, cur, send_to), (dist.irecv, spare, recv_from)]
            reqs = p2p(ops) if ops else []
            held = {i: part.view(shapes[j]) for j, (i, part) in enumerate(zip(moving, torch.split(cur, counts)))}
            share = shards[0].new_zeros(sum(widths), dtype=acc)
            ring_grads = {i: part.view(shards[i].shape) for i, part in zip(acc_of, torch.split(share, widths))}
            cols = self.op._pieces(1, totals, world, (rank - step) % world)
            self._pairs(grads, ring_grads, shards, held, states, cots, wrt, rows, cols, sizes, totals)
            for r in reqs:
                r.wait()
            if acc_of:
                if step:
                    share += acc_in
                for r in sending:
                    r.wait()
                sending = p2p([(dist.isend, share, send_to)])
            cur, spare = spare, cur
        if acc_of:            # the accumulators' last hop: home
            for r in p2p([(dist.irecv, acc_in, recv_from)]):
                r.wait()
            for r in sending:
                r.wait()
            for i, part in zip(acc_of, torch.split(acc_in, widths)):
                grads[i].copy_(part.view(shards[i].shape))


def cut_to(t: torch.Tensor, arr, cut: dict) -> torch.Tensor:
    """``t`` (over ``arr``'s axes) narrowed to the pieces in ``cut`` (axis -> (start, length))."""
    for k, name in enumerate(arr.axis_names):
        if name in cut and (cut[name][0], cut[name][1]) != (0, t.shape[k]):
            t = t.narrow(k, *cut[name])
    return t


def _as_wire(t: torch.Tensor, wire, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in the dtype of the backward's input ``wire`` when the shards are 16-bit (``dtype``):
    that plan reads ``O`` in 16 bits and ``L`` in fp32, and the forward keeps both in fp32."""
    if wire is None or wire.dtype.kind != "float" or dtype not in HALF_DTYPES:
        return t
    return t.to(TORCH_DTYPES.get(wire.dtype.name, t.dtype))


def _symbolic(d: Diagram, name: str) -> bool:
    return any(a.name == name and a.symbolic for a in d.axes)


class SplitFunction(torch.autograd.Function):
    """``apply(op, *shards)``: the forward over the devices, its gradients by :class:`SplitBackward`."""

    @staticmethod
    def forward(ctx, op, *shards):
        outs, states, sizes, totals, rank, world = op._run(shards)
        flat = [t for s in states for t in s]
        ctx.save_for_backward(*shards, *flat)
        ctx.op, ctx.n, ctx.widths = op, len(shards), [len(s) for s in states]
        ctx.sizes, ctx.totals, ctx.rank, ctx.world = sizes, totals, rank, world
        return outs

    @staticmethod
    def backward(ctx, *douts):
        saved = ctx.saved_tensors
        shards, flat = saved[: ctx.n], list(saved[ctx.n:])
        states = []
        for w in ctx.widths:
            states.append(tuple(flat[:w]))
            flat = flat[w:]
        op = ctx.op
        grads = op._backward.run(shards, states, douts, ctx.needs_input_grad[1:], ctx.sizes, ctx.totals,
                                 ctx.rank, ctx.world)
        op.last_backward_path = f"{op.plan.kind}:{op._backward.last_path or 'skipped'}"
        op.last_backward_blocks = dict(op._backward.last_blocks)
        for bop in op._backward._ops.values():      # a block's refused lowering, a host copy
            op.notes.extend(n for n in bop.notes if n not in op.notes)
        return (None, *grads)
