"""How a copying warpgroup (:mod:`.producer`) copies a stream loop's chunk and waits for it:
``cp.async`` groups, or tensor copies completing on each chunk buffer's mbarrier (:mod:`.tma`)."""

from __future__ import annotations

from . import tma


class Copies:
    """How the copying warpgroup copies a chunk (:meth:`issue`) and waits for it (:meth:`landed`):
    ``cp.async`` groups, or tensor copies completing on each buffer's mbarrier (:mod:`.tma`; the
    mbarriers initialised here, ``count`` the visited chunk's position, for their parity: the
    caller's own counter where it passes one, else one kept here)."""

    def __init__(self, em, lp, loads, bufs, stages: int, bar: int, threads: int, src, count: str | None = None):
        self.em, self.lp, self.loads, self.bufs, self.stages, self.src = em, lp, loads, bufs, stages, src
        self.tensor, k = tma.copied(bufs), em.consts
        self.count = count or em.names.fresh(f"pchunk_{em.ax[lp.axis].name}")
        if self.tensor:   # named barrier ``bar`` of the ``threads`` copying threads orders the initialisation
            tma.init(em, stages, bar, threads, src)
            if count is None:
                src(f"{self.count} = {k.u(0, 'U0')}  # chunk c's position among the chunks visited")

    def issue(self, start: str, copy: str) -> None:
        if self.tensor:
            return tma.issue_chunk(self.em, self.lp, self.loads, self.bufs, start, copy, self.src)
        self.em._issue_chunk(self.lp, self.loads, self.bufs, start, copy, self.src)

    def landed(self, copy: str, chunk: str, ahead: list[str], hi: str) -> None:
        """Wait for chunk ``chunk``'s copies into buffer ``copy`` (``ahead``: the chunks issued after it)."""
        k, src = self.em.consts, self.src
        if self.tensor:
            return tma.wait(self.em, copy, f"({chunk}) // {k.u(self.stages, f'U{self.stages}')} % {k.u(2, 'U2')}", src)
        if self.stages == 2:
            src("cp_async_wait_all()  # this warpgroup's copies of the chunk have landed")
        else:
            wait_but(ahead, hi, src)
        src("fence_proxy_async()  # ... and are visible to the tensor cores")

    def next(self) -> None:
        if self.tensor:
            self.src(f"{self.count} += {self.em.consts.u(1, 'U1')}")


def wait_but(ahead: list[str], hi: str, src) -> None:
    """Wait for the oldest committed group of copies: ``ahead`` are the starts of the chunks that
    may have been issued after it, nearest first (a group for each one below ``hi``)."""
    for depth in range(len(ahead), 0, -1):
        with src.block(f"{'if' if depth == len(ahead) else 'elif'} {ahead[depth - 1]} < {hi}:"):
            src(f"cp_async_wait{depth}()  # the oldest chunk's copies have landed; {depth} more in flight")
    if not ahead:
        src("cp_async_wait_all()")
        return
    with src.block("else:"):
        src("cp_async_wait_all()")
