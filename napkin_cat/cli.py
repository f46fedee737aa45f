"""``napkin``: the command line.

=========================================================  ===========================================
``napkin demo [--out DIR]``                                the whole pipeline on the library diagrams
``napkin draw attention --causal -o attention.svg``        a string diagram (.svg or .png)
``napkin check attention --stream x=s_x --tile q=g_q``     check_equivalent of a diagram and its
                                                           relabelling; exit 1 with a reproducer
``napkin cost attention --stream x=s_x --tile q=g_q``      transfers and memory per level, FLOPs per
``    --hw h100 --dtype f16 --sizes q=8192,x=8192,d=128``  unit, predicted time (``--optimize``)
``napkin lower attention --stream x=4 --tile q=4``         generate a numba.cuda kernel (runs in the
``    --sizes q=9,x=12,d=4 --emit kernel.py``              CUDA simulator without a GPU)
``napkin bench``                                           time generated kernels (needs a GPU)
``napkin goldens [--update]``                              diff (or rewrite) the golden kernels
``napkin imports [--png FILE]``                            check the package's import graph
=========================================================  ===========================================

``DIAGRAM`` is a library name (see :data:`napkin_cat.cli_args.LIBRARY`; ``--causal``,
``--window N``, ``--heads``, ``--batch`` where they make sense) or ``module:function`` (also
``file.py:function``): a function called with no argument that returns a Diagram.  Relabel
options ``--stream AXIS=SIZE``, ``--tile AXIS=SIZE``, ``--place ARRAY=LEVEL`` repeat and apply
in command-line order.

Exit status: 0 success; 1 a refused request (any :class:`~napkin_cat.core.errors.NapkinError`,
a path that cannot be written) or a failed check, one line on stderr (``napkin --debug CMD``
shows the traceback); 2 a usage error (or ``napkin bench`` without a GPU).

Built on typer and rich: typer turns annotated functions into subcommands with ``--help``,
repeatable options, choices and usage errors (exit 2) without a hand-written parser for eight
commands; rich draws the cost tables and the progress bar of ``check``.  Both import in a
fraction of a second, and no command imports sympy, hypothesis, numba, torch or matplotlib
before it runs, so ``napkin --help`` answers at once (``tests/test_cli.py`` checks it).
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperCommand

from . import cli_args as A
from . import cli_show as S


class _Command(TyperCommand):
    """Keeps the raw arguments, so relabel options apply in command-line order (the parser
    collects ``--stream`` and ``--tile`` into separate lists)."""

    def parse_args(self, ctx, args):
        ctx.meta["napkin.argv"] = list(args)
        return super().parse_args(ctx, args)


app = typer.Typer(name="napkin", help="FlashAttention on a Napkin: relabel diagrams, check, cost and lower them.",
                  add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})
command = app.command
HW = Enum("HW", {k: k for k in A.HARDWARE}, type=str)
DTypeName = Enum("DTypeName", {k: k for k in A.DTYPE_NAMES}, type=str)

# the options shared by draw, check, cost and lower
Dia = Annotated[str, typer.Argument(metavar="DIAGRAM", show_default=False,
                                    help=f"a library name ({', '.join(A.LIBRARY)}) or module:function")]
Causal = Annotated[bool, typer.Option("--causal", help="attention: a causal mask")]
Window = Annotated[Optional[int], typer.Option("--window", metavar="N", help="attention: keys i-N <= j <= i")]
Heads = Annotated[bool, typer.Option("--heads", help="attention: weave over a head axis h")]
Batch = Annotated[bool, typer.Option("--batch", help="attention: weave over a batch axis b")]
Stream = Annotated[Optional[list[str]], typer.Option(
    "--stream", metavar="AXIS=SIZE", show_default=False,
    help="stream an axis through fast memory: x=64, x=s_x (a symbol), x=64@SMEM; repeatable")]
Tile = Annotated[Optional[list[str]], typer.Option(
    "--tile", metavar="AXIS=SIZE", show_default=False, help="tile an axis across cores: q=64, q=g_q; repeatable")]
Place = Annotated[Optional[list[str]], typer.Option(
    "--place", metavar="ARRAY=LEVEL", show_default=False, help="place an array at a level: O=SMEM; repeatable")]
Sizes = Annotated[Optional[str], typer.Option("--sizes", metavar="NAME=N,...", show_default=False,
                                              help="axis (or tile/stream) sizes: q=8192,x=8192,d=128")]


def _diagram(ctx: typer.Context, spec, causal, window, heads, batch, stream, tile, place):
    """(the diagram, its relabelling) as the command line asks."""
    base = A.build(spec, causal=causal, window=window, heads=heads, batch=batch)
    steps = A.ordered_relabels(ctx.meta.get("napkin.argv"),
                               {"stream": stream or [], "tile": tile or [], "place": place or []})
    return base, A.apply_relabels(base, steps)


class _Guard:
    """Turns a refused request into one line on stderr and exit status 1, a usage error into
    exit status 2; ``napkin --debug`` lets the traceback through instead."""

    def __init__(self, ctx: typer.Context):
        self.ctx = ctx
        self.warnings = None

    def __enter__(self):
        import warnings
        self.warnings = warnings.catch_warnings()
        self.warnings.__enter__()
        # where kernels run is said by the command itself ("numba's CUDA simulator (no GPU found)")
        warnings.filterwarnings("ignore", message="no CUDA driver found")
        return self

    def __exit__(self, kind, e, tb):
        self.warnings.__exit__(None, None, None)
        if e is None or isinstance(e, (typer.Exit, typer.Abort, SystemExit, KeyboardInterrupt)):
            return False
        from .core.errors import NapkinError
        if self.ctx.meta.get("napkin.debug") or not isinstance(e, (A.UsageError, NapkinError, OSError)):
            return False
        if isinstance(e, A.UsageError):
            S.error(f"{e} (napkin {self.ctx.info_name} --help)")
            raise typer.Exit(2)
        text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
        if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in text:
            text += f": {e.filename}"
        S.error(f"{text} (napkin --debug {self.ctx.info_name} ... shows the traceback)")
        raise typer.Exit(1)


def _version(value: bool):
    if value:
        from . import __version__
        print(f"napkin {__version__}")
        raise typer.Exit()


@app.callback()
def _main(ctx: typer.Context,
          debug: Annotated[bool, typer.Option("--debug", help="show the traceback of an error")] = False,
          version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="print the version and exit")] = False):
    """FlashAttention on a Napkin: diagrams -> relabel -> loop nest -> NumPy check, cost, numba.cuda."""
    ctx.meta["napkin.debug"] = debug


@command()
def demo(ctx: typer.Context, out: Annotated[Path, typer.Option(help="folder for the pictures")] = Path("napkin_demo")):
    """Run the whole pipeline on the library diagrams: build, draw, evaluate, derive FlashAttention, cost, lower."""
    from .cli_demo import demo as run_demo
    with _Guard(ctx):
        code = run_demo(out)
    raise typer.Exit(code)


@command(cls=_Command)
def draw(ctx: typer.Context, diagram: Dia,
         out: Annotated[Path, typer.Option("-o", "--out", help="the picture: .svg or .png", show_default=False)],
         causal: Causal = False, window: Window = None, heads: Heads = False, batch: Batch = False,
         stream: Stream = None, tile: Tile = None, place: Place = None):
    """Draw DIAGRAM (relabelled, if asked) as a string diagram."""
    with _Guard(ctx):
        _, d = _diagram(ctx, diagram, causal, window, heads, batch, stream, tile, place)
        d.draw(str(out))
        S.say(f"{d}\ndrawn: {out}")


@command(cls=_Command)
def check(ctx: typer.Context, diagram: Dia, causal: Causal = False, window: Window = None, heads: Heads = False,
          batch: Batch = False, stream: Stream = None, tile: Tile = None, place: Place = None,
          examples: Annotated[Optional[int], typer.Option(help="examples to draw (default 60, 20 with --lowered)",
                                                          min=1, show_default=False)] = None,
          lowered: Annotated[bool, typer.Option("--lowered", help="also lower and run a kernel per example "
                                                "(the CUDA simulator without a GPU)")] = False,
          sizes: Sizes = None,
          max_size: Annotated[int, typer.Option(min=1, help="largest drawn axis size")] = 12,
          seed: Annotated[Optional[int], typer.Option(help="a fixed Hypothesis seed")] = None):
    """Check that DIAGRAM and its relabelling compute the same function (exit 1 with a reproducer if not)."""
    with _Guard(ctx):
        base, relabelled = _diagram(ctx, diagram, causal, window, heads, batch, stream, tile, place)
        fixed = A.parse_sizes(sizes)
        S.say(f"a: {base}\nb: {relabelled}")
        if lowered:
            from .cli_bench import gpu_present
            S.say("kernels run on " + ("the GPU" if gpu_present() else "numba's CUDA simulator (no GPU found)"))
        import napkin_cat as nc
        try:
            with S.progress_bar():
                report = nc.check_equivalent(base, relabelled, examples=examples, lowered=lowered,
                                             sizes=fixed or None, max_size=max_size, seed=seed, progress=True)
        except nc.EquivalenceError as e:
            S.say(str(e))
            S.error("the diagrams differ: the counterexample and its reproducer are above")
            raise typer.Exit(1)
        S.say(f"OK: {report}")


@command(cls=_Command)
def cost(ctx: typer.Context, diagram: Dia, causal: Causal = False, window: Window = None, heads: Heads = False,
         batch: Batch = False, stream: Stream = None, tile: Tile = None, place: Place = None,
         hw: Annotated[HW, typer.Option(help="hardware profile")] = HW.h100,
         dtype: Annotated[DTypeName, typer.Option(help="element type of every array")] = DTypeName.f16,
         sizes: Sizes = None,
         optimize: Annotated[bool, typer.Option("--optimize", help="search the tile/stream sizes that minimise "
                                                "the transfers into SMEM under its capacity")] = False,
         full: Annotated[bool, typer.Option("--full", help="print long symbolic expressions in full")] = False):
    """Transfers and memory per level, FLOPs per unit and the predicted time of DIAGRAM's relabelling."""
    with _Guard(ctx):
        _, d = _diagram(ctx, diagram, causal, window, heads, batch, stream, tile, place)
        given = A.parse_sizes(sizes)
        if optimize and not given:
            raise A.UsageError("--optimize needs --sizes")
        import napkin_cat as nc
        profile, dt = A.hardware(hw.value), A.dtype(dtype.value)
        c = nc.cost(d)
        S.say(f"{d}")
        best = c.optimize(given, hw=profile, dtype=dt) if optimize else None
        timing = c.time(profile, {**given, **(best.tiles if best else {})}, dt) if given else None
        tiles = dict(best.tiles) if best else dict(timing.tiles) if timing else {}
        S.cost_tables(c, given, tiles, dt, full)
        if best is not None:
            S.say(f"optimum ({'exhaustive' if best.exhaustive else 'search'}): {best}")
        if timing is not None:
            S.say(f"predicted: {timing}")
        else:
            S.say("give --sizes for numbers and a predicted time")


@command(cls=_Command)
def lower(ctx: typer.Context, diagram: Dia, causal: Causal = False, window: Window = None, heads: Heads = False,
          batch: Batch = False, stream: Stream = None, tile: Tile = None, place: Place = None,
          sizes: Sizes = None,
          threads: Annotated[Optional[int], typer.Option(min=1, help="threads per block (default: chosen)")] = None,
          emit: Annotated[Optional[Path], typer.Option(help="write the kernel source to this file ('-': stdout)",
                                                       show_default=False)] = None,
          verify: Annotated[Optional[bool], typer.Option(
              "--verify/--no-verify", show_default=False,
              help="run the kernel against the NumPy oracle (default: on a GPU, or in the simulator when small)")]
          = None):
    """Generate a numba.cuda kernel for DIAGRAM's relabelling; without a GPU it runs in numba's CUDA simulator."""
    with _Guard(ctx):
        _, d = _diagram(ctx, diagram, causal, window, heads, batch, stream, tile, place)
        given = A.parse_sizes(sizes)
        if not given:
            raise A.UsageError("lower needs --sizes (every axis, e.g. --sizes q=9,x=12,d=4)")
        import napkin_cat as nc
        from .lowering.devices import driver_present, simulator_active
        gpu = driver_present() and not simulator_active()
        bound = d.bind(given)
        small = max((_elements(arr) for arr in (*bound.dom, *bound.cod)), default=0) <= 4096
        note = None
        if verify is None:
            verify = gpu or small
            if not verify:
                note = ("not run here: too large for the CUDA simulator (--verify runs it anyway; "
                        "napkin check --lowered draws small sizes)")
        where = "a GPU" if gpu else "numba's CUDA simulator (no GPU found)"
        if verify:
            S.say(f"checking the kernel against the NumPy oracle on {where} ...")
        k = nc.lower(bound, threads=threads, verify=verify)
        S.lowered(k, where, note)
        if emit is not None:
            if str(emit) == "-":
                S.say(k.source, end="")
            else:
                emit.write_text(k.source)
                S.say(f"source: {emit}")


def _elements(arr) -> int:
    n = 1
    for a in arr.axes:
        n *= a.size if isinstance(a.size, int) else 1
    return n


@command()
def bench(ctx: typer.Context,
          out: Annotated[Path, typer.Option(help="folder for benchmarks.json")] = Path("."),
          full: Annotated[bool, typer.Option("--full", help="every size (kernels/bench.py without --quick)")] = False):
    """Time generated kernels on a GPU (kernels/bench.py --quick in a checkout; a small attention timing otherwise)."""
    with _Guard(ctx):
        from .cli_bench import run_bench
        raise typer.Exit(run_bench(out, full))


@command()
def goldens(ctx: typer.Context,
            update: Annotated[bool, typer.Option("--update", help="rewrite the golden files")] = False,
            dir: Annotated[Optional[Path], typer.Option("--dir", help="the folder of golden kernels "
                                                        "(default: kernels/ of the checkout)")] = None):
    """Diff (or rewrite) the golden kernels in kernels/: exit 1 on a difference."""
    from .lowering.goldens import main as goldens_main
    with _Guard(ctx):
        raise typer.Exit(goldens_main((["--update"] if update else []) + (["--dir", str(dir)] if dir else [])))


@command()
def imports(ctx: typer.Context,
            png: Annotated[Optional[Path], typer.Option(help="also draw the stage graph to this PNG")] = None):
    """Check the package's import graph: stages point one way, no cycle, no module over 600 lines."""
    from .imports import main as imports_main
    with _Guard(ctx):
        raise typer.Exit(imports_main(["--png", str(png)] if png else []))


def main(argv=None) -> int:
    """The console script ``napkin``: runs the app and returns its exit status; a malformed
    command line is one line on stderr and status 2."""
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
    try:
        code = app(args=list(sys.argv[1:] if argv is None else argv), prog_name="napkin", standalone_mode=False)
    except NoArgsIsHelpError as e:
        print(e.ctx.get_help())
        return 0
    except UsageError as e:
        where = e.ctx.command_path if e.ctx is not None else "napkin"
        S.error(f"{e.format_message()} ({where} --help)")
        return e.exit_code
    except ClickException as e:
        S.error(e.format_message())
        return e.exit_code
    except typer.Abort:
        S.error("aborted")
        return 1
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
