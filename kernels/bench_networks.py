"""Whole networks as generated kernels against torch: a transformer block, a convolution, a
residual block, a U-Net and a vision transformer.

    NUMBA_ENABLE_CUDASIM=0 python3 -u kernels/bench_networks.py --out $OUT     # H100, about 1 min
    NUMBA_ENABLE_CUDASIM=0 python3 -u kernels/bench_networks.py --cases block_f16 --budget-s 0 --out $OUT
    NUMBA_ENABLE_CUDASIM=0 python3 -u kernels/bench_networks.py --cases vit_f32,resnet_f32,unet_f32 \
        --budget-s 0 --out $OUT                                                # the architectures
    NUMBA_ENABLE_CUDASIM=1 python kernels/bench_networks.py --tiny --check-only   # CPU, under a minute
    python kernels/bench_networks.py --plan                # CPU: the GPU plans, nothing compiled

The first command is the one to run on an H100 (a 560 s limit).  Measured on an H100 (this
repository's kernels/BENCHMARKS.md): the fp32 block's 8 kernels compile and run in 24 s, the
16-bit block's 8 in 46-49 s, the residual block's 6 in 5 s, the U-Net's 15 in 11 s, the ViT's 13 in
17 s; ``--budget-s`` skips a case whose estimated compiles (``COMPILE_S`` per kernel, twice
those figures, and ``TORCH_COMPILE_S``) would pass the budget.
Cases (``--cases``, comma-separated, in the order given; the default first):

* ``block_f32``: ``nc.library.transformer_block(1024, 512, 8, 64, 2048)`` (pre-norm, GELU, one
  sequence of 1024 tokens, d = 512, 8 heads of 64, MLP 2048), lowered by ``nc.lower`` into
  several kernels (8 when planned on the CPU); peers: the same block in eager torch
  (``F.layer_norm``, one fused QKV ``F.linear``, ``F.scaled_dot_product_attention``, ``F.gelu``),
  that function under ``torch.compile`` (dynamo's recompile limits raised as in
  ``bench.compiled_flex``) and ``torch.nn.TransformerEncoderLayer(norm_first=True)`` in
  inference mode (its fused fast path where torch takes it), all with the same weights;
* ``conv_f32``: ``nc.library.conv2d(64, 64, 56, 56, kernel=3, padding=1, batch=8)`` against
  ``F.conv2d`` (cuDNN, ``cudnn.benchmark`` on);
* more, not run by default: ``block_f16``, ``block_bf16``, ``block_causal_f32``,
  ``block_b2_f32`` (a batch axis of 2), ``block_2048_f32`` (2048 tokens), ``conv_f16``;
* the architectures of ``nc.library``, not run by default, each against its function in
  :mod:`torch_networks` in eager torch and under ``torch.compile``, with the same weights:
  ``resnet_f32``, ``resnet_block(64, None, 56, 56, batch=8)`` (identity shortcut, batch norms
  at inference; 6 kernels when planned on the CPU); ``unet_f32``, ``unet(3, 2, 128, 128,
  (16, 32), batch=8)`` (3 channels in, 2 classes, one pooling; 15 kernels); ``vit_f32``,
  ``vit(3, 224, 224, 16, 384, 6, 64, 1536, 1000, batch=8)`` (ViT-S/16 with one block; 13
  kernels: its 59 equations need the cut search's per-equation budget,
  ``lowering.multi.PIECES_PER_EQUATION``).

For each case: the plan (``nc.lower(d, verify=False)``: the number of kernels, their grids and
shared memory, the planning seconds), the compile (the first launch of every kernel, seconds
apart from any timing), then the check: the generated result on seeded random inputs (weights
scaled by 1/sqrt(fan-in), biases and the norms' shifts non-zero) against the network in torch in
float64 on the same (rounded) inputs, ``rel_err`` = max abs error / max |reference|; a case over
its tolerance (``TOL``) is not timed.  Times are medians of CUDA-event timings of back-to-back
calls after a warm-up (``bench.cuda_time``); TF32 is off for torch's matmuls and cuDNN, so every
fp32 row is fp32 arithmetic.  A case that ``nc.lower`` refuses records the refusal's text as its
result.  Progress lines carry seconds since start; ``networks.json`` under ``--out`` is written
after every step (a run stopped by its time limit keeps what it measured); the table is last.

``--tiny``: the same cases at toy sizes on the CPU under numba's CUDA simulator, lowered for a
GPU of ``TINY_SMEM`` bytes of shared memory per block (so the block is cut into kernels, as at
its real size), run and checked against the float64 torch reference and the NumPy oracle
(``nc.evaluate``), which checks the reference itself; no timing, no ``torch.compile``.  The
toy U-Net is lowered under 4096 bytes (5 kernels), the toy ViT under the device's own limit (one
kernel: at toy sizes nearly every piece fits, and under 8192 bytes its cut search lowers more
than its 708 candidate pieces).
``--plan``: each case planned as for a GPU (the kernels' source is generated, nothing is
compiled or run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

import torch  # noqa: E402

# without an explicit choice, the simulator where torch sees no GPU (bench.py would take the hardware)
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0" if torch.cuda.is_available() else "1")

import numpy as np  # noqa: E402

import napkin_cat as nc  # noqa: E402
from bench import cuda_time  # noqa: E402
from napkin_cat.core import DTYPES  # noqa: E402
from torch_networks import encoder_layer, fan_in, flops, torch_form  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
TOL = {"f32": 1e-4, "f16": 2e-2, "bf16": 8e-2}          # rel_err a case must stay under to be timed
# seconds to compile (and first run) one kernel of a network: on an H100 the fp32 cases took
# 0.8-3.0 s per kernel, the 16-bit block 5.7-6.2 s (kernels/BENCHMARKS.md), doubled for margin
COMPILE_S = {"f32": 6.0, "f16": 12.0, "bf16": 12.0}
TORCH_COMPILE_S = 60.0                                   # torch.compile of the block, about
TINY_SMEM = 8192   # --tiny: shared memory per block, small enough that the block cuts into kernels


class Case(NamedTuple):
    """A network at one size: ``kind`` "block" (sizes t, d, h, e, f, batch), "conv" (n, c, o,
    hw), "resnet" (n, c, hw), "unet" (n, c, k, hw, widths) or "vit" (n, c, hw, patch, d, h, e,
    f, k, layers), ``n`` the batch; ``tiny_smem``: the shared memory per block ``--tiny`` lowers
    for (None: the simulator's device, whose limit the toy sizes fit in one kernel)."""

    kind: str
    dtype: str
    sizes: dict
    tiny: dict
    causal: bool = False
    tiny_smem: int | None = TINY_SMEM


BLOCK = dict(t=1024, d=512, h=8, e=64, f=2048, batch=1)
BLOCK_TINY = dict(t=16, d=16, h=2, e=8, f=32, batch=1)
CONV = dict(n=8, c=64, o=64, hw=56)
CONV_TINY = dict(n=2, c=4, o=4, hw=6)
RESNET = dict(n=8, c=64, hw=56)
RESNET_TINY = dict(n=2, c=8, hw=8)
UNET = dict(n=8, c=3, k=2, hw=128, widths=(16, 32))
UNET_TINY = dict(n=2, c=3, k=2, hw=8, widths=(4, 8))
VIT = dict(n=8, c=3, hw=224, patch=16, d=384, h=6, e=64, f=1536, k=1000, layers=1)
VIT_TINY = dict(n=2, c=3, hw=8, patch=4, d=16, h=2, e=8, f=32, k=5, layers=1)
CASES = {
    "block_f32": Case("block", "f32", BLOCK, BLOCK_TINY),
    "conv_f32": Case("conv", "f32", CONV, CONV_TINY),
    "block_f16": Case("block", "f16", BLOCK, BLOCK_TINY),
    "block_bf16": Case("block", "bf16", BLOCK, BLOCK_TINY),
    "block_causal_f32": Case("block", "f32", BLOCK, BLOCK_TINY, causal=True),
    "block_b2_f32": Case("block", "f32", {**BLOCK, "batch": 2}, {**BLOCK_TINY, "batch": 2}),
    "block_2048_f32": Case("block", "f32", {**BLOCK, "t": 2048}, BLOCK_TINY),
    "conv_f16": Case("conv", "f16", CONV, CONV_TINY),
    "resnet_f32": Case("resnet", "f32", RESNET, RESNET_TINY),
    "unet_f32": Case("unet", "f32", UNET, UNET_TINY, tiny_smem=4096),
    "vit_f32": Case("vit", "f32", VIT, VIT_TINY, tiny_smem=None),
}
DEFAULT = "block_f32,conv_f32"
T0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f} s]", *a, flush=True)


# ------------------------------------------------------------------------------ diagrams, inputs

def diagram(case: Case, s: dict):
    dt, L = DTYPES[case.dtype], nc.library
    if case.kind == "block":
        batch = nc.Axis("b", s["batch"]) if s["batch"] > 1 else None
        return L.transformer_block(s["t"], s["d"], s["h"], s["e"], s["f"], causal=case.causal, batch=batch, dtype=dt)
    b, hw = nc.Axis("b", s["n"]), s["hw"]    # images: always a batch axis
    if case.kind == "conv":
        return L.conv2d(s["c"], s["o"], hw, hw, kernel=3, padding=1, batch=b, dtype=dt)
    if case.kind == "resnet":
        return L.resnet_block(s["c"], None, hw, hw, batch=b, dtype=dt)
    if case.kind == "unet":
        return L.unet(s["c"], s["k"], hw, hw, s["widths"], batch=b, dtype=dt)
    return L.vit(s["c"], hw, hw, s["patch"], s["d"], s["h"], s["e"], s["f"], s["k"], layers=s["layers"], batch=b,
                 dtype=dt)


def inputs(d, seed: int, device) -> dict:
    """Seeded float64 inputs by name, in the diagram's layouts: ``X`` standard normal, weights
    scaled by 1/sqrt(fan-in), norms' scales 1 + 0.1 N(0, 1), batch norms' variances
    exp(0.1 N(0, 1)), everything else (shifts, biases, means, the class token, the position
    embedding) 0.1 N(0, 1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for arr in d.dom:
        shape = tuple(a.size for a in arr.axes)
        v = torch.randn(shape, generator=g, device=device, dtype=torch.float64)
        name = arr.name
        if name.endswith("_gamma"):
            v = 1 + 0.1 * v
        elif name.endswith("_var"):
            v = torch.exp(0.1 * v)
        elif name == "X":
            pass
        elif "_W" in name or name == "W":
            v = v / math.sqrt(fan_in(name, shape))
        else:
            v = 0.1 * v
        out[name] = v
    return out


# ------------------------------------------------------------------------------ torch's side

def reference(case: Case, s: dict, W: dict):
    """What ``case`` computes, by torch on the tensors ``W`` (diagram layouts) in their dtype."""
    fn, args = torch_form(case.kind, s, W, case.causal)
    return fn(*args)


def compiled(fn):
    """``torch.compile(fn)`` with dynamo's recompile limits raised (as ``bench.compiled_flex``)."""
    cfg = torch._dynamo.config
    cfg.cache_size_limit = 1024
    for name, n in (("recompile_limit", 1024), ("accumulated_cache_size_limit", 4096),
                    ("accumulated_recompile_limit", 4096)):
        if hasattr(cfg, name):
            setattr(cfg, name, n)
    return torch.compile(fn, dynamic=False)


def rel(got, want) -> tuple[float, float]:
    """(max abs error, max abs error / max |want|), in float64."""
    err = float((got.double() - want).abs().max())
    return err, err / max(float(want.abs().max()), 1e-30)


# ------------------------------------------------------------------------------ one case

def kernels_of(k) -> tuple:
    return getattr(k, "kernels", (k,))


def tiny_hw(smem: int | None):
    """An H100 with ``smem`` bytes of shared memory per block (``Case.tiny_smem``): toy sizes cut
    into kernels as the realistic ones do on the GPU (one fused kernel fits otherwise); None:
    the simulator's device as it is."""
    import dataclasses
    return None if smem is None else dataclasses.replace(nc.hardware.H100, smem_per_block_optin=smem)


def plan(case: Case, s: dict, row: dict, hw=None):
    """``nc.lower`` of the case, or None with the refusal in ``row``."""
    d = diagram(case, s)
    t0 = time.perf_counter()
    try:
        k = nc.lower(d, verify=False, hw=hw)   # checked below against float64, before any timing
    except nc.NapkinError as e:
        row["refused"] = f"{type(e).__name__}: {e}"
        row["plan_s"] = time.perf_counter() - t0
        return d, None
    row["plan_s"] = time.perf_counter() - t0
    row["kernels"] = len(kernels_of(k))
    row["launches"] = [{"name": kk.name, "grid": kk.launch.grid, "threads": kk.launch.block[0],
                        "smem_bytes": kk.launch.dynamic_smem_bytes} for kk in kernels_of(k)]
    row["notes"] = list(k.notes)
    return d, k


def run_case(name: str, case: Case, args, save) -> dict:
    s = case.tiny if args.tiny else case.sizes
    row = {"case": name, "kind": case.kind, "dtype": case.dtype, "causal": case.causal, "sizes": s,
           "tol": TOL[case.dtype]}
    log(f"{name}: planning {case.kind} {s} {case.dtype} ...")
    if args.tiny:
        row["smem_limit"] = case.tiny_smem
    d, k = plan(case, s, row, tiny_hw(case.tiny_smem) if args.tiny else None)
    save(row)
    if k is None:
        log(f"{name}: refused: {row['refused'][:300]}")
        return row
    log(f"{name}: {row['kernels']} kernels planned in {row['plan_s']:.1f} s")
    gpu = not args.tiny
    if gpu and args.budget_s:
        need = row["kernels"] * COMPILE_S[case.dtype] + (TORCH_COMPILE_S if case.kind != "conv" else 0)
        if time.perf_counter() - T0 + need > args.budget_s:
            row["skipped"] = (f"about {need:.0f} s of compiles would pass --budget-s {args.budget_s:.0f} "
                              f"({time.perf_counter() - T0:.0f} s gone)")
            log(f"{name}: skipped: {row['skipped']}")
            return row
    device = "cuda" if gpu else "cpu"
    W64 = inputs(d, args.seed, device)
    dt = TORCH[case.dtype]
    Wd = {n: v.to(dt) for n, v in W64.items()}            # what the kernels and torch's peers read
    want = reference(case, s, {n: v.double() for n, v in Wd.items()})
    args_ = [Wd[a.name] for a in d.dom]
    t0 = time.perf_counter()
    if gpu:   # as timed below: prepared once, into out=
        out = torch.full(tuple(want.shape), float("nan"), dtype=dt, device=device)
        run = k.prepare(*args_, out=out)
        run()
        torch.cuda.synchronize()
        got = out
    elif dt != torch.bfloat16:   # the simulator reads numpy
        out = np.full(tuple(want.shape), np.nan, dtype=np.float16 if dt == torch.float16 else np.float32)
        k.prepare(*(a.numpy() for a in args_), out=out)()
        got = torch.from_numpy(out)
    else:   # numpy has no bf16: the float32 values it holds, out as float32
        got = torch.from_numpy(np.asarray(k(*(a.float().numpy() for a in args_))))
    row["compile_s" if gpu else "simulate_s"] = time.perf_counter() - t0
    row["max_abs_err"], row["rel_err"] = rel(got, want)
    row["ok"] = bool(row["rel_err"] < TOL[case.dtype])   # NaN fails
    try:   # torch in the same dtype, as a yardstick
        with torch.inference_mode():
            _, row["torch_rel_err"] = rel(reference(case, s, Wd), want)
    except Exception as e:  # noqa: BLE001 - e.g. a 16-bit op torch lacks on the CPU
        row["torch_rel_err"], row["torch_error"] = float("nan"), f"{type(e).__name__}: {str(e)[:200]}"
    if args.tiny:   # the NumPy oracle checks the kernel and the torch reference at once
        oracle = torch.from_numpy(np.asarray(nc.evaluate(d, *(W64[a.name].to(dt).double().numpy() for a in d.dom))))
        _, row["oracle_rel_err"] = rel(got, oracle)
        _, row["reference_vs_oracle"] = rel(want.cpu(), oracle)
    save(row)
    log(f"{name}: {'compiled and ran' if gpu else 'simulated'} in "
        f"{row.get('compile_s', row.get('simulate_s')):.1f} s; rel_err {row['rel_err']:.1e} (torch {case.dtype} "
        f"{row['torch_rel_err']:.1e}, tol {TOL[case.dtype]:.0e}) -> {'ok' if row['ok'] else 'FAILED'}")
    if not row["ok"] or args.check_only or not gpu:
        return row
    del want
    timings(case, s, Wd, run, args.reps, save, row)
    row["tflops"] = flops(case.kind, s, case.causal) / row["ours_ms"] / 1e9
    return row


def timings(case: Case, s: dict, Wd: dict, run, reps: int, save, row: dict) -> None:
    """Milliseconds of the generated kernels and of torch's peers on the same inputs, into ``row``."""
    row["ours_ms"] = cuda_time(run, reps=reps, budget_s=2.0)
    save(row)
    log(f"  ours {row['ours_ms']:.3f} ms")
    peers = {}
    torch.backends.cudnn.benchmark = True    # cuDNN's fastest algorithm for every convolution
    with torch.inference_mode():
        fn, fargs = torch_form(case.kind, s, Wd, case.causal)   # weights in torch's layouts, once
        if case.kind == "conv":
            peers["cudnn"] = lambda: fn(*fargs)
        else:
            peers["eager"] = lambda: fn(*fargs)
            if case.kind == "block" and s["h"] * s["e"] == s["d"]:   # nn.MultiheadAttention's heads are d / h wide
                X, P = fargs[:2]
                layer = encoder_layer(P, s["h"])
                Xb = X if X.dim() == 3 else X[None]
                mask = torch.nn.Transformer.generate_square_subsequent_mask(s["t"], device=X.device, dtype=X.dtype) \
                    if case.causal else None
                peers["nn"] = lambda: layer(Xb, src_mask=mask, is_causal=case.causal)
            cfn = compiled(fn)
            t0 = time.perf_counter()
            try:
                cfn(*fargs)
                torch.cuda.synchronize()
                row["torch_compile_s"] = time.perf_counter() - t0
                peers["compiled"] = lambda: cfn(*fargs)
            except Exception as e:  # noqa: BLE001 - a peer that cannot run is recorded, not fatal
                row["compiled_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        for peer, f in peers.items():
            try:
                row[f"{peer}_ms"] = cuda_time(f, reps=reps, budget_s=2.0)
                row[f"x_{peer}"] = row[f"{peer}_ms"] / row["ours_ms"]
            except Exception as e:  # noqa: BLE001
                row[f"{peer}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            save(row)
            log(f"  {peer} {row.get(f'{peer}_ms', float('nan')):.3f} ms")


# ------------------------------------------------------------------------------ main

def environment(gpu: bool) -> dict:
    import numba
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "numba": numba.__version__,
           "numpy": np.__version__, "python": platform.python_version(), "napkin_cat": nc.__version__,
           "tf32": False, "simulator": os.environ.get("NUMBA_ENABLE_CUDASIM")}
    if gpu:
        p = torch.cuda.get_device_properties(0)
        env.update(device=torch.cuda.get_device_name(0), sm_count=p.multi_processor_count)
    else:
        env.update(device=f"CPU ({platform.machine()}), numba's CUDA simulator")
    return env


@contextlib.contextmanager
def planned_for_a_gpu():
    """Lowering plans as for a GPU (block sizes from the cost model), without one: the kernels'
    source is generated and never compiled (tests/test_networks_realistic.py does the same)."""
    import napkin_cat.lowering as lowering
    was = lowering._gpu_present
    lowering._gpu_present = lambda runtime: True
    try:
        yield
    finally:
        lowering._gpu_present = was


def plan_only(names, results, save):
    with planned_for_a_gpu():
        for name in names:
            case = CASES[name]
            row = {"case": name, "dtype": case.dtype, "sizes": case.sizes}
            plan(case, case.sizes, row)
            results["cases"].append(row)
            save()
            if "refused" in row:
                log(f"{name}: refused: {row['refused'][:400]}")
                continue
            log(f"{name}: {row['kernels']} kernels in {row['plan_s']:.1f} s: " +
                ", ".join(f"{r['name']} grid {r['grid']} smem {r['smem_bytes']}" for r in row["launches"]))


def table(rows) -> str:
    def ms(r, k):
        return f"{r[k]:.3f}" if isinstance(r.get(k), float) else "-"

    def x(r, k):
        return f"{r[k]:.2f}x" if isinstance(r.get(k), float) else "-"

    lines = ["| case | dtype | kernels | plan s | compile (sim) s | rel err | ours ms | TFLOP/s | eager ms "
             "| compiled ms | nn ms | cuDNN ms | eager/ours | compiled/ours | cuDNN/ours |",
             "|" + "---|" * 15]
    for r in rows:
        head = f"| {r['case']} | {r['dtype']} "
        if "refused" in r or "error" in r:
            what = "refused" if "refused" in r else "error"
            lines.append(head + f"| {what}: {r[what][:200]} |")
            continue
        if "skipped" in r:
            lines.append(head + f"| {r['kernels']} | {r['plan_s']:.1f} | skipped: {r['skipped']} |")
            continue
        err = f"{r['rel_err']:.1e}{'' if r.get('ok') else ' FAILED'}" if "rel_err" in r else "-"
        comp = r.get("compile_s", r.get("simulate_s"))
        tf = f"{r['tflops']:.1f}" if "tflops" in r else "-"
        lines.append(head + f"| {r['kernels']} | {r['plan_s']:.1f} | {comp:.1f} | {err} | {ms(r, 'ours_ms')} | {tf} "
                     f"| {ms(r, 'eager_ms')} | {ms(r, 'compiled_ms')} | {ms(r, 'nn_ms')} | {ms(r, 'cudnn_ms')} "
                     f"| {x(r, 'x_eager')} | {x(r, 'x_compiled')} | {x(r, 'x_cudnn')} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=DEFAULT, help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--tiny", action="store_true", help="toy sizes under the simulator: check only (CPU)")
    ap.add_argument("--check-only", action="store_true", help="plan, compile and check; no timing")
    ap.add_argument("--plan", action="store_true", help="plan each case as for a GPU (CPU), nothing compiled")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions (medians)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=530.0,
                    help="skip a case whose compiles (estimated from its kernels) would end past this many "
                         "seconds from the start (0: no limit)")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "kernels")))
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    from napkin_cat.lowering.devices import simulator_active
    gpu = torch.cuda.is_available() and not simulator_active()
    if not (gpu or args.tiny or args.plan):
        ap.error("realistic sizes need a CUDA GPU, and there is none (or numba.cuda is its simulator, "
                 "NUMBA_ENABLE_CUDASIM=1): use --tiny or --plan")
    if args.tiny and not simulator_active():
        ap.error("--tiny runs the kernels in numba's CUDA simulator: set NUMBA_ENABLE_CUDASIM=1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("networks_plan.json" if args.plan else "networks_tiny.json" if args.tiny else "networks.json")
    results = {"environment": environment(gpu and not args.tiny), "options": vars(args), "cases": []}
    log(json.dumps(results["environment"]))

    def save(row=None):
        if row is not None and (not results["cases"] or results["cases"][-1] is not row):
            results["cases"].append(row)
        path.write_text(json.dumps(results, indent=1, default=str))

    if args.plan:
        plan_only(names, results, save)
        return results
    for name in names:
        try:
            row = run_case(name, CASES[name], args, save)
        except Exception as e:  # noqa: BLE001 - recorded with the case, the run goes on
            row = results["cases"][-1] if results["cases"] and results["cases"][-1].get("case") == name \
                else {"case": name, "dtype": CASES[name].dtype}
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            log(f"{name}: ERROR {row['error']}")
        save(row)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"\nnetworks, {results['environment']['device']} (JSON: {path})")
    print(table(results["cases"]), flush=True)
    return results


if __name__ == "__main__":
    res = main()
    sys.exit(0 if all(r.get("ok", True) and "error" not in r for r in res["cases"]) else 1)
