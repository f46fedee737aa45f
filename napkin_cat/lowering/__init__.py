"""Lowering to numba.cuda: ``nc.lower(d)`` -> a :class:`Kernel` generated from ``d``'s loop nest.

>>> import numpy as np, napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> flash = nc.library.attention(q=q, x=x, d=d).stream(x, 3).tile(q, 4)
>>> kernel = nc.lower(flash.bind({q: 5, x: 7, d: 4}), threads=16)
>>> kernel.launch
Launch(grid=(2, 1, 1), block=(16, 1, 1), dynamic_smem_bytes=...)
>>> "cuda.syncthreads()" in kernel.source
True

``kernel(Q, K, V)`` runs it on numpy arrays (copied to and from the device), torch CUDA tensors
or numba device arrays (zero copy, through ``__cuda_array_interface__``); outputs are allocated
like the inputs unless ``out=`` is given.  Under ``NUMBA_ENABLE_CUDASIM=1``: the simulator.

Stages, imports pointing one way:
``schedule``  completes the relabelling and builds the final form once (:class:`~.schedule.Schedule`);
``planner``   turns it into a frozen kernel IR (:mod:`.plan`: :class:`~.plan.KernelPlan`);
``emit``      renders the plan, with ``emit_threads`` (thread mappings, the CUDA-core engine),
              ``emit_kinds`` (one emitter per box kind) and ``emit_acc`` (one per accumulator
              kind); ``codegen.generate`` runs planner then emitter.

Tensor cores: a contraction's plan names its engine (:data:`~.plan.ENGINES`): ``"cuda_core"``, or ``"mma"``
where the inputs are fp16 / bf16 and the shapes fit ``mma.sync.m16n8k16`` (:mod:`.emit_mma`); the kernel's
``notes`` say which contraction runs where, and why not.  A mask that reads data gets its block table
derived at each launch (:mod:`.tabled`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ..core.diagram import Diagram
from ..core.errors import LoweringError, RelabelError, ShapeError
from . import io
from .calls import (_Prepared, _TorchFastPath, _check_array, _empty_like, _flat_input, _flat_output, _kind,  # noqa: F401
                    copy_into, padded_shape, padded_store, unpadded)
from .tma import map_args

__all__ = ["lower", "Kernel", "Launch", "MultiKernel", "TabledKernel", "TableChoice"]

TARGETS = ("numba.cuda",)
SELF_CHECK_RUNS = 2   # inputs every lowered kernel is run on against the oracle before lower() returns it


@dataclass(frozen=True)
class Launch:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dynamic_smem_bytes: int


def lower(d: Diagram, target: str = "numba.cuda", tiles: dict | None = None, threads: int | None = None,
          *, name: str | None = None, micro: tuple[int, int] | None = None, fastmath: bool = True,
          prefetch: bool | str = False, hw=None, verify: bool | int = True, fp32: str = "fma",
          check_inputs=None) -> "Kernel":
    """Generate a numba.cuda kernel for ``d`` (every axis size bound).

    ``tiles``: ``{axis or symbol: size}`` for tiled axes (tile size) and streamed axes (chunk); sizes not
    given (and symbolic block sizes of a relabelled ``d``) come from the cost model or a heuristic
    (:mod:`napkin_cat.lowering.schedule`).  ``threads``: threads per block (the schedule's for the kernel's
    kind on a GPU, others where given ``tiles`` need them for tensor cores: :mod:`.tile_threads`; 16 under the
    simulator).  ``micro``: force the register micro-tile ``(rows, cols)``. ``fastmath``: compile with fast
    (approximate) exp / division.  ``prefetch``: fetch each chunk's inputs into registers one chunk ahead
    (global loads overlap the compute, at the price of registers); ``prefetch="double"``: two shared-memory
    buffers per chunked input, one barrier per chunk; ``prefetch="auto"``: ``"double"`` where the inputs are
    16-bit (filled by cp.async), the register estimate stays within a thread's registers and the shared memory
    fits, else none (:func:`~.planner.auto_prefetch`).  ``fp32``: how an fp32 kernel multiplies: ``"fma"``
    (fp32 FMAs on CUDA cores) or ``"3xtf32"`` (tensor cores, three tf32 products each: fp32-level error, as
    SDPA's fp32 kernels; :data:`~.planner.TF32X3`). ``verify``: before it is returned, the kernel runs against
    the NumPy float64 oracle on ``SELF_CHECK_RUNS`` inputs (``True``) or that many (an int) at its bound
    sizes; a difference raises :class:`~napkin_cat.core.errors.EquivalenceError` with code that reproduces it;
    ``verify=False`` skips it and ``kernel.verified`` says so (``nc.check_equivalent(oracle, kernel)`` draws
    far more inputs either way).  ``check_inputs``: for a diagram whose inputs are related (a backward part's
    ``L`` is the logsumexp of its ``Q K^T``), ``check_inputs(rng, draw)`` makes the self-check's inputs
    (``d.dom``'s order) from ``draw(rng, shape)`` as its producer would give them
    (:func:`~.backward_forms.residual_inputs`), else each is drawn alone.

    Where one fused kernel does not do (refused, or over the shared memory of the device or of
    ``hw``) or ``place(wire, "HBM")`` asks for it, the result is a :class:`~.multi.MultiKernel`:
    several kernels launched in order, cut where the cost model moves the fewest HBM bytes.

    Raises :class:`~napkin_cat.core.errors.LoweringError` naming what cannot lower and why.
    """
    if target not in TARGETS:
        raise LoweringError(f"unknown lowering target {target!r}; known: {list(TARGETS)}")
    if not isinstance(d, Diagram):
        raise LoweringError(f"lower needs a Diagram, got {type(d).__name__}")
    outer = [r for r in d.schedule if r.op in ("tile", "stream") and r.level not in ("SMEM", "registers")]
    if outer:
        raise LoweringError(f"{outer[0].op}({outer[0].axis}) at level {outer[0].level}: a kernel launch has "
                            f"no loop above its thread blocks; levels above SMEM model which blocks share "
                            f"a cache (use them with nc.cost) and are left out of the diagram you lower")
    from ..core.hardware import Hardware
    if hw is not None and not isinstance(hw, Hardware):
        raise LoweringError(f"lower: hw must be a hardware profile such as nc.hardware.H100, got {hw!r}")
    if not (isinstance(verify, bool) or isinstance(verify, int) and verify >= 0):   # a number of runs
        raise LoweringError(f"lower: verify must be True, False or a number of runs >= 0, got {verify!r}")
    runs = SELF_CHECK_RUNS if verify is True else int(verify)
    if check_inputs is not None:
        from ..verify.kernelcheck import check_self_check_inputs
        check_self_check_inputs(check_inputs, verify, runs)
    check_fp32(d, fp32)
    opts = dict(tiles=tiles, threads=threads, name=name, micro=micro, fastmath=fastmath, prefetch=prefetch, hw=hw, fp32=fp32)
    from . import runtime, tabled   # a mask that reads data: its block table derived per launch
    kernel = tabled.lower_with_tables(d, opts, _lower_any, lambda: _gpu_present(runtime))
    if runs:
        from ..verify.kernelcheck import self_check
        forms = getattr(kernel, "forms", ())   # a choice made at each launch (.tabled): each form
        memo: dict = {}                        # ... on the same oracle answers
        for n, k in enumerate(forms):
            k.notes += (self_check(k, runs, check_inputs, memo),)
            k.verified = True
            kernel.notes += (f"Form {n + 1}: {k.notes[-1]}",)
        if not forms:
            kernel.notes += (self_check(kernel, runs, check_inputs),)
        kernel.verified = True
    else:
        kernel.notes += ("Not verified: lower(..., verify=False); run nc.check_equivalent(oracle, kernel).",)
    return kernel


def _lower_any(d: Diagram, opts: dict):
    """One fused kernel for ``d``, or several in order where one does not do."""
    from .multi import lower_split, wants_split
    try:
        return lower_split(d, opts, _lower_one) if wants_split(d) else _lower_one(d, **opts)
    except (LoweringError, RelabelError) as e:
        return lower_split(d, opts, _lower_one, e)


def check_fp32(d: Diagram, fp32) -> None:
    """``fp32`` is one of :data:`.plan.FP32_ENGINES`, and ``"3xtf32"`` only for an fp32 kernel (a
    16-bit one multiplies on tensor cores already: the option would be ignored)."""
    from .plan import FP32_ENGINES, kernel_dtype
    if fp32 not in FP32_ENGINES:
        raise LoweringError(f"lower: fp32 must be one of {FP32_ENGINES} (fp32 FMAs on CUDA cores, or "
                            f"tensor cores by 3xTF32), got {fp32!r}")
    if fp32 == "3xtf32" and kernel_dtype(d) != "f32":
        raise LoweringError(f"lower: fp32='3xtf32' chooses how fp32 kernels multiply; {d.short()} is a "
                            f"{kernel_dtype(d)} kernel, on tensor cores already")


def _lower_one(d: Diagram, tiles=None, threads=None, name=None, micro=None, fastmath=True, prefetch=False,
               hw=None, fp32="fma") -> "Kernel":
    """One fused kernel for ``d`` (arguments checked by :func:`lower`), not yet verified."""
    from ..relabel.row_terms import drop_row_terms
    from .plan import kernel_dtype
    from .planner import tf32x3
    # a bias's terms that the softmax divides out cost nothing; in 16-bit kernels only, whose inputs'
    # rounding dwarfs what the kept term's size costs in fp32 (row_terms.SWITCH)
    d, dropped = drop_row_terms(d) if kernel_dtype(d) != "f32" else (d, ())
    with tf32x3(fp32 == "3xtf32"):
        kernel = _lower_planned(d, tiles, threads, name, micro, fastmath, prefetch, hw)
    kernel.options["fp32"] = fp32
    kernel.notes += dropped
    return kernel


def _lower_planned(d: Diagram, tiles, threads, name, micro, fastmath, prefetch, hw) -> "Kernel":
    from . import aux_whole, planner, producer, runtime, tile_threads
    from .codegen import generate
    from .schedule import choose
    from .wgmma_plan import awaited_copying_warpgroup

    simulate = not _gpu_present(runtime)
    sched = choose(d, tiles, threads, simulate=simulate, hw=hw)
    kname = name or _default_name(sched.diagram)

    def make(pf, s=sched):   # what the schedule chose and changed (loop order) follow the planner's notes
        return generate(s.diagram, kname, s.threads, s.batch_axes, fastmath=fastmath, micro=micro,
                        prefetch=pf, ff=s.final_form, notes=(f"Block sizes: {s.how}.", *s.notes))
    gen = make(prefetch)
    if threads is None and tiles and not simulate:   # given blocks the default threads cannot split (.tile_threads)
        sched, gen = tile_threads.refit(sched, gen, lambda T: choose(d, tiles, T, simulate=simulate, hw=hw), make, prefetch)
    limits = runtime.device_limits() if "numba.cuda" in sys.modules else runtime.H100_DEFAULTS
    limit = min(limits.max_shared_per_block_optin, hw.smem_per_block_optin if hw else 1 << 30)   # a profile's too
    smem = gen.plan.smem_bytes
    if smem > limit and prefetch == "auto" and gen.plan.prefetch:   # 'auto': the second buffers only where they fit
        gen = make(False)
        smem = gen.plan.smem_bytes
    if smem > limit:
        raise LoweringError(f"{d.short()} with {sched.diagram._sched_str()} needs {smem} bytes of shared memory per "
                            f"block ({gen.buffers()}); the limit is {limit}: use smaller tiles or chunks")
    if awaited_copying_warpgroup(gen.plan, gen.extra_threads, planner.WGMMA):   # "auto" planned on one
        with producer.switched_off():
            kernel = _lower_planned(d, tiles, threads, name, micro, fastmath, prefetch, hw)
        kernel.notes += tuple(n for n in gen.notes if n.startswith("Copying warpgroup: none"))
        return kernel
    if not simulate:   # auxiliary tensors whole where that costs no blocks per SM
        sched, gen = aux_whole.widened(sched, gen, lambda s: make(gen.plan.prefetch, s), limits, limit)
    launch = Launch(gen.plan.launch.grid, (sched.threads + gen.extra_threads, 1, 1), gen.plan.smem_bytes)
    kernel = Kernel(sched.diagram, gen.source, kname, launch, sched, gen)
    kernel.options = {"threads": sched.threads, "micro": micro, "fastmath": fastmath, "prefetch": prefetch,
                      "name": kname}
    return kernel


def _gpu_present(runtime) -> bool:
    """Whether kernels will run on a GPU, without importing numba.cuda (that import fixes the
    process's choice of simulator or hardware): generating source must not make it."""
    if runtime.simulator_active():
        return False
    if "numba.cuda" in sys.modules:
        return runtime.gpu_available()
    return runtime.driver_present()


def _default_name(d: Diagram) -> str:
    return "kernel_" + "_".join(a.name for a in d.cod[0].axes)[:40] if len(d.cod) else "kernel"


class Kernel:
    """A generated kernel: ``.source`` (numba.cuda Python), ``.launch`` (grid, block, dynamic
    shared memory), ``.diagram`` (the relabelled diagram it computes) and ``__call__``."""

    def __init__(self, diagram: Diagram, source: str, name: str, launch: Launch, schedule, gen):
        self.diagram, self.source, self.name, self.launch, self.schedule = diagram, source, name, launch, schedule
        self.in_shapes = tuple(tuple(a.size for a in arr.axes) for arr in diagram.dom)
        self.out_shapes = tuple(tuple(a.size for a in arr.axes) for arr in diagram.cod)
        self.in_io = tuple(arr.dtype.name for arr in diagram.dom)     # what each array holds (.io)
        self.out_io = tuple(arr.dtype.name for arr in diagram.cod)
        self.mappings = gen.mappings()
        from .atomics import zero_args
        self.zero_args = zero_args(diagram)   # outputs the blocks add into: zero-filled at each launch
        from .staged_add import out_pads
        self.out_pads = out_pads(getattr(gen, "plan", None), len(diagram.cod))   # staged rows: allocated padded
        from .tma import inputs as tma_inputs
        self.tma = tma_inputs(getattr(gen, "plan", None)) if "_tmap):" in source else ()   # a map parameter each
        self.notes: tuple[str, ...] = gen.notes   # what the generator chose, and what was verified
        self.verified = False                            # compared with the oracle by lower()
        self.options: dict = {}                          # the lower() options that rebuild it
        self._dispatcher, self._launchers = None, {}
        self._fast = None   # _TorchFastPath after a first call on torch CUDA tensors (GPU)

    def __repr__(self) -> str:
        return (f"Kernel({self.name}: {self.diagram}, grid={self.launch.grid}, "
                f"block={self.launch.block}, smem={self.launch.dynamic_smem_bytes} B)")

    def _repr_html_(self) -> str:
        """Jupyter's view: the launch configuration, the notes (what was chosen and verified)
        and the source, highlighted with pygments when it is installed."""
        from html import escape
        try:
            from pygments import highlight
            from pygments.formatters import HtmlFormatter
            from pygments.lexers import PythonLexer
            code = highlight(self.source, PythonLexer(), HtmlFormatter(noclasses=True, nowrap=False))
        except ImportError:
            code = f"<pre>{escape(self.source)}</pre>"
        rows = [("diagram", str(self.diagram)), ("grid", str(self.launch.grid)), ("block", str(self.launch.block)),
                ("dynamic shared memory", f"{self.launch.dynamic_smem_bytes} B"),
                ("verified against the oracle", "yes" if self.verified else "no")]
        table = "".join(f"<tr><th style='text-align:left;padding-right:1em'>{escape(k)}</th><td>{escape(v)}</td></tr>"
                        for k, v in rows)
        notes = "".join(f"<li>{escape(n)}</li>" for n in self.notes)
        return (f"<div class='napkin-kernel'><p><b>kernel {escape(self.name)}</b></p><table>{table}</table>"
                f"<ul>{notes}</ul><details><summary>source ({len(self.source.splitlines())} lines)</summary>"
                f"{code}</details></div>")

    @property
    def dispatcher(self):
        """The ``cuda.jit`` dispatcher (compiled at the first call)."""
        if self._dispatcher is None:
            from .runtime import compile_kernel
            self._dispatcher = compile_kernel(self.source, self.name, self.launch.dynamic_smem_bytes)
        return self._dispatcher

    def _launcher(self, stream):
        key = id(stream) if stream is not None else 0
        lc = self._launchers.get(key)
        if lc is None:
            from .runtime import Launcher
            lc = Launcher(self.dispatcher, self.launch.grid, self.launch.block, stream or 0,
                          self.launch.dynamic_smem_bytes, zero_args=self.zero_args)
            self._launchers[key] = (lc, stream)
            return lc
        return lc[0]

    def __call__(self, *arrays, out=None, stream=None):
        """Run the kernel; the outputs have the type of the inputs (torch in, torch out on the
        same device; numpy in, numpy out; numba device arrays in, device arrays out), at every
        call.  On a GPU, after the first call on torch CUDA tensors, calls with float32,
        contiguous tensors of the kernel's shapes on that device (and ``stream=None``) take
        :class:`_TorchFastPath`: the same checks, done cheaply, and a packed driver launch."""
        fast = self._fast
        if fast is not None and stream is None and fast.dispatcher is self._dispatcher and fast.packed:
            result = fast(arrays, out)
            if result is not None:
                return result
        from . import runtime

        kinds = self._check_call(arrays, stream)
        sim = runtime.simulator_active()
        keep = []   # converted copies of torch inputs: alive until the launch
        args = [_flat_input(x, kind, sim, stream, keep, t) for x, kind, t in zip(arrays, kinds, self.in_io)]
        outs, stores, after = self._outputs(arrays, kinds, out, sim)
        out_kinds = [_kind(o) for o in stores]
        for o, kind, t in zip(stores, out_kinds, self.out_io):
            args.append(_flat_output(io.kernel_view(o, t), kind, sim))
        args += map_args(self, args, sim)   # the tensor maps of the inputs TMA copies (.tma)
        if stream is None and "torch_cuda" in kinds and not sim:
            launcher = self._torch_launcher(runtime)
        else:
            launcher = self._launcher(stream)
        launcher(*args)
        for o, view in after:
            copy_into(o, view)
        del keep   # torch frees them in stream order: after the launch on torch's stream
        if (stream is None and not sim and (fast is None or fast.dispatcher is not self._dispatcher)
                and all(k == "torch_cuda" for k in kinds + out_kinds)):
            self._fast = _TorchFastPath.build(self, launcher, args, arrays)
        outs = [io.finish(o, t) for o, t in zip(outs, self.out_io)]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _torch_launcher(self, runtime):
        """The Launcher for torch's current stream: one per stream handle (a new numba stream
        object per call would be a new Launcher per call)."""
        import torch
        handle = int(torch.cuda.current_stream().cuda_stream)
        if handle == 0:
            return self._launcher(None)
        key = ("torch", handle)
        lc = self._launchers.get(key)
        if lc is None:
            from .runtime import Launcher
            numba_stream = runtime.stream_from_torch()
            lc = (Launcher(self.dispatcher, self.launch.grid, self.launch.block, numba_stream,
                           self.launch.dynamic_smem_bytes, zero_args=self.zero_args), numba_stream)
            self._launchers[key] = lc
        return lc[0]

    def prepare(self, *arrays, out=None, stream=None):
        """A zero-argument callable that launches on these arrays (converted once): for timing
        loops, where the per-call conversions would be host time in every measurement.  On a
        GPU, with nothing to copy back and the default stream, calls after the first go
        through a :class:`~.runtime.PackedLaunch`."""
        from . import runtime
        kinds = self._check_call(arrays, stream)
        sim = runtime.simulator_active()
        keep = []   # converted copies of torch inputs
        args = [_flat_input(x, k, sim, stream, keep, t) for x, k, t in zip(arrays, kinds, self.in_io)]
        outs, stores, after = self._outputs(arrays, kinds, out, sim)
        args += [_flat_output(io.kernel_view(o, t), _kind(o), sim) for o, t in zip(stores, self.out_io)]
        args += map_args(self, args, sim)
        launcher = self._launcher(stream)
        packable = not (sim or stream is not None
                        or any(getattr(a, runtime.HOST_ATTR, None) is not None for a in args))
        return _Prepared(launcher, args, keep + stores, packable, after)   # outputs too: views keep nothing alive

    def _check_call(self, arrays, stream) -> list[str]:
        """Refuse what the kernel cannot read, before anything is converted or launched: the
        number of arrays, each array's kind (numpy, torch, CUDA array), real dtype and shape."""
        if len(arrays) != len(self.in_shapes):
            names = ", ".join(a.name for a in self.diagram.dom)
            raise ShapeError(f"kernel {self.name} takes {len(self.in_shapes)} arrays ({names}), "
                             f"got {len(arrays)}")
        if isinstance(stream, (str, bytes, bool, float, list, tuple, dict)):
            raise ShapeError(f"kernel {self.name}: stream must be None or a CUDA stream, got {stream!r}")
        kinds = [_kind(a) for a in arrays]
        for arr, x, kind, shape in zip(self.diagram.dom, arrays, kinds, self.in_shapes):
            _check_array(f"input {arr}", x, kind)
            if tuple(x.shape) != shape:
                raise ShapeError(f"input {arr}: expected shape {shape}, got {tuple(x.shape)}")
        return kinds

    def _outputs(self, arrays, kinds, out, sim):
        """(what the caller gets, what the kernel writes, copies owed after the launch): the same
        arrays but where the kernel pads an output's rows (``out_pads``, :mod:`.staged_add`)."""
        outs = self._given_or_new(arrays, kinds, out, sim)
        if not any(self.out_pads):
            return outs, outs, ()
        gets, stores, after = [], [], []
        for o, pad, shape, arr, t in zip(outs, self.out_pads, self.out_shapes, self.diagram.cod, self.out_io):
            if pad and out is not None:
                store = padded_store(f"out= for {arr}", o, _kind(o), pad, sim, t)
                after.append((o, unpadded(store, shape[-1])))
            elif pad:
                store = o                          # allocated padded: the caller gets the view
                o = unpadded(store, shape[-1])
            else:
                store = o
            gets.append(o)
            stores.append(store)
        return gets, stores, after

    def _given_or_new(self, arrays, kinds, out, sim):
        if out is not None:
            several = isinstance(out, tuple) or (isinstance(out, list) and all(hasattr(o, "shape") for o in out))
            outs = list(out) if several else [out]
            if len(outs) != len(self.out_shapes):
                raise ShapeError(f"kernel {self.name} has {len(self.out_shapes)} outputs, out= gave {len(outs)}")
            for o, shape, arr, t in zip(outs, self.out_shapes, self.diagram.cod, self.out_io):
                what = f"out= for {arr}"
                kind = _kind(o)
                _check_array(what, o, kind)
                io.check_out(what, o, shape, t, kind)
                if kind == "numpy" and not (o.flags.c_contiguous and o.flags.writeable):
                    raise ShapeError(f"{what}: expected a C-contiguous, writeable array")
                if kind in ("torch_cpu", "torch_cuda") and (not o.is_contiguous() or o.requires_grad):
                    raise ShapeError(f"{what}: expected a contiguous tensor that does not require grad")
            return outs
        like = next((a for a, k in zip(arrays, kinds) if k in ("torch_cuda", "device")), None)
        if like is None:
            like = next((a for a, k in zip(arrays, kinds) if k == "torch_cpu"), None)
        return [_empty_like(like, padded_shape(shape, p), sim, t)
                for shape, p, t in zip(self.out_shapes, self.out_pads, self.out_io)]

    def compiled_info(self) -> dict:
        """Registers, local memory and shared memory of the compiled kernel (GPU only)."""
        from .runtime import kernel_function
        disp = self.dispatcher
        if not disp.overloads:
            return {}
        sig = next(iter(disp.overloads))
        attrs = kernel_function(disp, sig).attrs
        return {"registers": attrs.regs, "local_bytes": attrs.local, "static_smem": attrs.shared}


def _late(name: str):
    """``runtime.<name>()`` at call time (importing runtime imports numba.cuda)."""
    def call():
        from . import runtime
        return getattr(runtime, name)()
    return call


from ..verify import backend as _backend  # noqa: E402 -- the table verification reads kernels through

from .multi import MultiKernel  # noqa: E402
from .tabled import TableChoice, TabledKernel  # noqa: E402
_backend.register(lower=lower, Kernel=Kernel, MultiKernel=MultiKernel, TabledKernel=TabledKernel, TableChoice=TableChoice,
                  simulator_active=_late("simulator_active"), driver_present=_late("driver_present"), Launch=Launch)
