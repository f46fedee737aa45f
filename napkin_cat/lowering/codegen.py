"""Generic numba.cuda code generation from a final form (fp32): :func:`generate`.

Nothing here knows an algorithm by name: the kernel is read off the loop nest
(:meth:`napkin_cat.core.Diagram.loop_nest`), box by box through :data:`CODEGEN_RULES` (one
entry per box kind, keyed exactly like :data:`napkin_cat.ops.kinds.SPECS`) and
accumulator by accumulator through :data:`ACC_CODEGEN` (keyed like
:data:`napkin_cat.relabel.accumulators.ACC_RULES`).

How the loop nest maps onto the GPU
    * grid loops (tiled axes) -> ``blockIdx.x``, flattened; axes tiled by 1 that the lowering
      added for untiled weaved axes (batch, heads, groups) -> ``blockIdx.y``;
    * stream loops -> ``for`` loops inside the block; each chunk of every input that the loop
      partitions is staged in shared memory by all threads (cooperative, coalesced loads) and
      the block synchronises (``cuda.syncthreads``) before it is read;
    * inside a block every equation is a *phase*: a parallel loop over the elements of its
      output tile, distributed over the threads, with contractions and reductions as inner
      loops over the contracted axes.

Stages
    * :mod:`.planner` -> a frozen :class:`~.plan.KernelPlan` (:mod:`.plan`: axes and their roles,
      targets and thread mappings, accumulator plans, fused scores, shared buffers, launch);
    * :mod:`.emit` renders it: :mod:`.emit_threads` (mappings as loops, contractions on the engine
      the plan names, group reductions), :mod:`.emit_kinds` (:data:`CODEGEN_RULES`, one entry per
      box kind) and :mod:`.emit_acc` (:data:`ACC_CODEGEN`, one entry per accumulator kind).

Rules that keep the GPU busy (each read off the loop nest, none keyed on a diagram)
    * **scores in registers** (:class:`~.plan.FusedScores`): a normalising accumulator (online softmax,
      normalised contraction) whose score input is a contraction read by nothing else, when one
      ``TY x TX`` thread grid serves both micro-tiles (same rows per thread, the ``TX`` lanes of a
      row an aligned group of one warp): row max / sum by lane reductions (warp shuffles; shared
      memory under the simulator), ``o *= delta`` in registers, the weights through a
      warp-private staging area (``syncwarp``), one block barrier per chunk after the loads;
    * **unrolled reduction steps**: a micro-tile's innermost reduction loop is written out
      ``CONTRACTION_UNROLL`` times per iteration when its step count is static;
    * **loads**: fixed trip counts (all loads in flight before the first store); consecutive
      threads walk global order (coalesced), and a chunk buffer laid out transposed gets rows
      padded by ``TRANSPOSE_PAD`` floats (16-byte alignment kept, stores spread over banks);
    * ``prefetch=True``: each chunk's inputs are fetched into registers one chunk ahead;
      ``prefetch="double"``: two shared buffers per chunked input, chunk c + 1 fetched into
      registers while chunk c is computed, then stored into the other buffer: one barrier per
      chunk;
    * **launch bounds**: as many blocks per SM as shared memory allows when the register
      estimate fits (never below ``REGISTER_FLOOR`` registers), so the compiler keeps to them;
    * **longest blocks first**: when a causal mask bounds a stream loop by the tile's rows, the
      grid is one dimension with that tile index slowest and reversed.

Accumulator states live where the final form's levels say: ``registers`` -> in the registers of
the threads that own the elements (the update's thread mapping is fixed for the whole stream
loop), ``SMEM`` (or above) -> shared memory.  Ragged tiles and chunks are handled by
zero-filled loads, loop bounds on the valid part of a chunk, and bounds checks on stores.
Masks and index biases read global indices (tile or chunk start plus local index).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.diagram import Diagram
from ..relabel.loopnest import FinalForm
from .emit import render
from .emit_acc import ACC_CODEGEN
from .emit_kinds import CODEGEN_RULES
from .plan import KernelPlan
from .planner import plan_kernel

__all__ = ["generate", "Generated", "CODEGEN_RULES", "ACC_CODEGEN"]


@dataclass(frozen=True)
class Generated:
    """A generated kernel before it is wrapped: its plan, source text, the notes in its
    docstring and the identifiers of its shared buffers."""

    plan: KernelPlan
    source: str
    notes: tuple[str, ...]
    buffer_names: dict
    extra_threads: int = 0      # a copying warpgroup's, launched after the plan's threads (.producer)
    blocks: int = 1             # blocks per SM its launch bounds ask for

    def buffers(self) -> str:
        """The shared buffers with their sizes, for messages."""
        return ", ".join(f"{self.buffer_names[k]} {4 * b.size} B" for k, b in self.plan.buffers.items())

    def mappings(self) -> dict[str, str]:
        """Each target's name -> its thread mapping, described."""
        types = self.plan.types
        return {types[t.var].name: t.mapping.describe() for t in self.plan.targets.values()}


def generate(d: Diagram, name: str, threads: int, batch_axes=(), *, fastmath: bool = True,
             micro: tuple[int, int] | None = None, prefetch: bool | str = False, unroll: int | None = None,
             ff: FinalForm | None = None, notes: tuple[str, ...] = ()) -> Generated:
    """Plan and render one kernel for ``d`` (relabelled, every size bound; ``ff`` its final form
    when the caller has it).  ``notes`` follow the planner's own in the kernel's docstring."""
    plan = plan_kernel(d, name, threads, batch_axes, fastmath=fastmath, micro=micro, prefetch=prefetch,
                       unroll=unroll, ff=ff)
    notes = (*plan.notes, *notes)
    source, names, notes, extra, blocks = render(plan, notes)
    return Generated(plan, source, notes, names, extra, blocks)
