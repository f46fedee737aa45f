"""Block-table reads of :class:`.emit.Emitter` (:class:`~napkin_cat.ops.index_support.BlockAtom`):
per tile and chunk, whether a block table's entries over them all keep or all mask, read from
the table's slice of the block's batch or head (``b``, or the query head ``h * G + g`` of
grouped-query heads) where the block holds one, so the stream loop skips the chunk or the mask's
arithmetic (:meth:`.emit_loads.Loads._chunk_flags`).
"""

from __future__ import annotations

from itertools import product

from .emit_kinds import aux_read
from .source import CodeAlgebra, Source, render_code
from .unswitch import WarpEntry

SPANNED_ENTRIES = 4
"""A tile x chunk over at most this many blocks of a table, a static count of them (the tile's
extent a multiple of the block's), reads its entries one by one; more, or a count that varies:
loops over the blocks."""

_CMP_CODE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}


class TableReads:
    """The block-table part of the renderer (see the module docstring)."""

    def _block_atom(self, at, eqn: int, pred, over, r0, r1, c0, c1, src: Source):
        """``(full, empty)`` identifiers of a block-table comparison over the tile x chunk
        (``over``: their axes): its entries (indices clamped into the table, as the gather reads
        it) all hold / all fail."""
        k = self.consts
        e = self.dd.eqns[eqn]
        v = dict(zip((t.name for t in pred.auxes), e.ins[1:]))[at.table.name]
        lead_axes, axes = self.types[v].axis_names[:len(at.lead)], self.types[v].axis_names[len(at.lead):]
        lead = self._lead_entry(lead_axes, at.lead)
        if lead is None:     # the block spans several batches or heads: no one slice to read
            return False, False
        stem = f"{at.table.name}_"
        full, empty = self.names.fresh(stem + "full"), self.names.fresh(stem + "empty")
        spans = self._spanned_entries(axes, at, over, (r0, c0))
        if spans is not None:   # a static few entries: each read once per chunk, whichever comparisons use it
            entries, tests = self._chunk_entries, []
            for one in spans:
                one = (*lead, *one)
                if (v, one) not in entries:
                    entries[v, one] = self.names.fresh(stem + "entry")
                    src(f"{entries[v, one]} = {aux_read(self, v, dict(zip(lead_axes + axes, one)))}")
                tests.append(f"{entries[v, one]} {_CMP_CODE[at.cmp]} {k.f(float(at.c))}")
            if len(tests) == 1:    # the tile and the chunk each inside one table block
                src(f"{full} = {tests[0]}")
                src(f"{empty} = not {full}")
                # the comparison's value at every entry (.unswitch); its slice's indices in the key too
                self.full_flags[(*over, pred, (at, tuple(k.key() for k in at.lead)))] = full
                return full, empty
            src(f"{full} = {' and '.join(tests)}  # the {len(tests)} entries of the table over the tile and chunk")
            src(f"{empty} = not ({' or '.join(tests)})")
        # the tile over several blocks: each warp's entry where its rows lie inside one (.unswitch)
        self.full_flags[(*over, pred, ("warp", at, tuple(k.key() for k in at.lead)))] = \
            WarpEntry(v, (*lead_axes, *axes), tuple(lead), at, over, (r0, c0))
        if spans is not None:
            return full, empty
        src(f"{full} = True  # the table's blocks over the tile and chunk, past SPANNED_ENTRIES or not a "
            f"static count: read in loops")
        src(f"{empty} = True")
        env = dict(zip(lead_axes, lead))
        loops = []
        for ax_, blk, lo, hi in ((axes[0], at.rows, r0, r1), (axes[1], at.cols, c0, c1)):
            last = k.u(self.sizes[ax_] - 1)
            first = render_code(lo // blk, k.u)
            end = render_code(CodeAlgebra.sat_sub(hi, 1) // blk, k.u)
            var = self.names.fresh(f"i_{ax_}")
            env[ax_] = var
            loops.append(f"for {var} in range(min({first}, {last}), min({end}, {last}) + {k.u(1, 'U1')}):")
        with src.block(loops[0]):
            with src.block(loops[1]):
                test = f"{aux_read(self, v, env)} {_CMP_CODE[at.cmp]} {k.f(float(at.c))}"
                with src.block(f"if {test}:"):
                    src(f"{empty} = False")
                with src.block("else:"):
                    src(f"{full} = False")
        return full, empty

    def _lead_entry(self, axes, leads):
        """The leading indices of a table of each batch or head (``axes``, selected by the index
        expressions ``leads`` over the diagram's axes: ``b``, or ``h * G + g`` under grouped-query
        heads) as code, where the block holds one index of each axis they read (tiled by 1), else
        None; clamped into the table, as the gather reads it."""
        k = self.consts
        out = []
        for ax_, lead in zip(axes, leads):
            names = lead.leaves("idx")
            if any(n not in self.ax or self.ax[n].cap != 1 for n in names):
                return None
            if lead.op == "idx":
                code = self.gidx(lead.value, {})
            else:
                leaf = lambda n: f"int64({self.gidx(n.value, {})})" if n.op == "idx" else str(self.sizes[n.value])
                code = f"max({lead.to_code(leaf, lambda v: str(int(v)), None)}, 0)"
            out.append(f"uint32(min({code}, {k.u(self.sizes[ax_] - 1)}))")
        return tuple(out)

    def _spanned_entries(self, axes, at, over, starts):
        """The table indices of each entry a tile x chunk reads, where each extent is a multiple
        of the table's block or divides it and there are at most :data:`SPANNED_ENTRIES` of them
        (the tile starts at a multiple of its extent, so at one of the block), else None; clamped
        into the table (a ragged end reads its last entry again, which changes neither test)."""
        k = self.consts
        per_axis = []
        for ax_, blk, axis, lo in zip(axes, (at.rows, at.cols), over, starts):
            cap = self.ax[axis].cap
            if self.ax[axis].role not in ("grid", "stream") or (cap % blk and blk % cap):
                return None
            first, last = render_code(lo // blk, k.u), k.u(self.sizes[ax_] - 1)
            per_axis.append([f"uint32(min({first}{f' + {k.u(m)}' if m else ''}, {last}))"
                             for m in range(max(1, cap // blk))])
        out = list(product(*per_axis))
        return out if len(out) <= SPANNED_ENTRIES else None

    def entry_test(self, v: int, axes, idx, at, reads: dict, src: Source) -> str:
        """A flag: comparison ``at`` of table ``v``'s entry at ``idx`` (code, over ``axes``), the
        entry read once into ``reads`` (``{(v, idx): identifier}``)."""
        if (v, idx) not in reads:
            reads[v, idx] = self.names.fresh(f"{at.table.name}_warp")
            src(f"{reads[v, idx]} = {aux_read(self, v, dict(zip(axes, idx)))}  # this warp's rows lie inside one "
                f"block of {at.table.name}: its entry")
        flag = self.names.fresh(f"{at.table.name}_holds")
        src(f"{flag} = {reads[v, idx]} {_CMP_CODE[at.cmp]} {self.consts.f(float(at.c))}")
        return flag
