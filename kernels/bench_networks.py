"""Whole networks as generated kernels against torch: a transformer block and a convolution.

    NUMBA_ENABLE_CUDASIM=0 python3 -u kernels/bench_networks.py --out $OUT     # H100, about 5 min
    NUMBA_ENABLE_CUDASIM=0 python3 -u kernels/bench_networks.py --cases block_f16 --budget-s 0 --out $OUT
    NUMBA_ENABLE_CUDASIM=1 python kernels/bench_networks.py --tiny --check-only   # CPU, under a minute
    python kernels/bench_networks.py --plan                # CPU: the GPU plans, nothing compiled

The first command is the one to run on an H100 (a 560 s limit: each fp32 kernel compiles in
about 25 s, each 16-bit one in 40-80 s: the fp32 block's 8 kernels, torch.compile's and the
convolution's one fit; the 16-bit block, 9 kernels, is a run of its own, which may not finish
within 560 s: ``--budget-s 0`` tries anyway, and the JSON keeps every finished step).
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
  ``block_b2_f32`` (a batch axis of 2), ``block_2048_f32`` (2048 tokens), ``conv_f16``.

For each case: the plan (``nc.lower(d, verify=False)``: the number of kernels, their grids and
shared memory, the planning seconds), the compile (the first launch of every kernel, seconds
apart from any timing), then the check: the generated result on seeded random inputs (weights
scaled by 1/sqrt(fan-in), biases and the layer norms' shifts non-zero) against the block in
float64 on the same (rounded) inputs, ``rel_err`` = max abs error / max |reference|; a case over
its tolerance (``TOL``) is not timed.  Times are medians of CUDA-event timings of back-to-back
calls after a warm-up (``bench.cuda_time``); TF32 is off for torch's matmuls and cuDNN, so every
fp32 row is fp32 arithmetic.  A case that ``nc.lower`` refuses records the refusal's text as its
result.  Progress lines carry seconds since start; ``networks.json`` under ``--out`` is written
after every step (a run stopped by its time limit keeps what it measured); the table is last.

``--tiny``: the same cases at toy sizes on the CPU under numba's CUDA simulator, lowered for a
GPU of ``TINY_SMEM`` bytes of shared memory per block (so the block is cut into kernels, as at
its real size), run and checked against the float64 torch reference and the NumPy oracle
(``nc.evaluate``), which checks the reference itself; no timing, no ``torch.compile``.
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
import torch.nn.functional as F  # noqa: E402

import napkin_cat as nc  # noqa: E402
from bench import cuda_time  # noqa: E402
from napkin_cat.core import DTYPES  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
TOL = {"f32": 1e-4, "f16": 2e-2, "bf16": 8e-2}          # rel_err a case must stay under to be timed
COMPILE_S = {"f32": 25.0, "f16": 60.0, "bf16": 60.0}    # seconds to compile one kernel (H100, measured)
TORCH_COMPILE_S = 60.0                                   # torch.compile of the block, about
TINY_SMEM = 8192   # --tiny: shared memory per block, small enough that the block cuts into kernels


class Case(NamedTuple):
    """A network at one size: ``kind`` "block" (sizes t, d, h, e, f, batch) or "conv" (n, c, o, hw)."""

    kind: str
    dtype: str
    sizes: dict
    tiny: dict
    causal: bool = False


BLOCK = dict(t=1024, d=512, h=8, e=64, f=2048, batch=1)
BLOCK_TINY = dict(t=16, d=16, h=2, e=8, f=32, batch=1)
CONV = dict(n=8, c=64, o=64, hw=56)
CONV_TINY = dict(n=2, c=4, o=4, hw=6)
CASES = {
    "block_f32": Case("block", "f32", BLOCK, BLOCK_TINY),
    "conv_f32": Case("conv", "f32", CONV, CONV_TINY),
    "block_f16": Case("block", "f16", BLOCK, BLOCK_TINY),
    "block_bf16": Case("block", "bf16", BLOCK, BLOCK_TINY),
    "block_causal_f32": Case("block", "f32", BLOCK, BLOCK_TINY, causal=True),
    "block_b2_f32": Case("block", "f32", {**BLOCK, "batch": 2}, {**BLOCK_TINY, "batch": 2}),
    "block_2048_f32": Case("block", "f32", {**BLOCK, "t": 2048}, BLOCK_TINY),
    "conv_f16": Case("conv", "f16", CONV, CONV_TINY),
}
DEFAULT = "block_f32,conv_f32"
T0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f} s]", *a, flush=True)


# ------------------------------------------------------------------------------ diagrams, inputs

def diagram(case: Case, s: dict):
    dt = DTYPES[case.dtype]
    if case.kind == "block":
        batch = nc.Axis("b", s["batch"]) if s["batch"] > 1 else None
        return nc.library.transformer_block(s["t"], s["d"], s["h"], s["e"], s["f"], causal=case.causal,
                                            batch=batch, dtype=dt)
    return nc.library.conv2d(s["c"], s["o"], s["hw"], s["hw"], kernel=3, padding=1, batch=nc.Axis("b", s["n"]),
                             dtype=dt)


def fan_in(name: str, shape: tuple) -> int:
    """Inputs summed into one output of the weight ``name`` (layouts of the library's diagrams)."""
    if name == "W":                      # conv W[o c kh kw]
        return math.prod(shape[1:])
    if name == "attn_Wo":                # W[h e d]
        return shape[0] * shape[1]
    return shape[0]                      # attn_W{q,k,v}[d h e], mlp_W1[d f], mlp_W2[f d]


def inputs(d, seed: int, device) -> dict:
    """Seeded float64 inputs by name, in the diagram's layouts: ``X`` standard normal, weights
    scaled by 1/sqrt(fan-in), layer norm scales 1 + 0.1 N(0, 1), shifts and biases 0.1 N(0, 1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for arr in d.dom:
        shape = tuple(a.size for a in arr.axes)
        v = torch.randn(shape, generator=g, device=device, dtype=torch.float64)
        name = arr.name
        if name.endswith("_gamma"):
            v = 1 + 0.1 * v
        elif name == "X":
            pass
        elif "_W" in name or name == "W":
            v = v / math.sqrt(fan_in(name, shape))
        else:
            v = 0.1 * v
        out[name] = v
    return out


# ------------------------------------------------------------------------------ torch's side

def torch_params(W: dict) -> dict:
    """The block's weights in torch's layouts (``F.linear``'s ``[out, in]``, QKV fused)."""
    d = W["attn_Wq"].shape[0]
    proj = [W[f"attn_W{n}"].reshape(d, -1).T for n in "qkv"]
    return {"ln1_w": W["ln1_gamma"], "ln1_b": W["ln1_beta"], "ln2_w": W["ln2_gamma"], "ln2_b": W["ln2_beta"],
            "in_w": torch.cat(proj).contiguous(), "in_b": torch.cat([W[f"attn_b{n}"].reshape(-1) for n in "qkv"]),
            "out_w": W["attn_Wo"].reshape(-1, d).T.contiguous(), "out_b": W["attn_bo"],
            "w1": W["mlp_W1"].T.contiguous(), "b1": W["mlp_b1"], "w2": W["mlp_W2"].T.contiguous(), "b2": W["mlp_b2"]}


def block_forward(X, P: dict, heads: int, causal: bool, eps: float = 1e-5):
    """The pre-norm block in torch: ``X1 = X + MHA(LN1(X))``, ``Y = X1 + MLP(LN2(X1))``, GELU (erf)."""
    dm = X.shape[-1]
    A = F.layer_norm(X, (dm,), P["ln1_w"], P["ln1_b"], eps)
    qkv = F.linear(A, P["in_w"], P["in_b"]).unflatten(-1, (3, heads, -1))     # [.. t 3 h e]
    q, k, v = (z.transpose(-3, -2) for z in qkv.movedim(-3, 0))               # [.. h t e]
    O = F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(-3, -2).flatten(-2)
    X1 = X + F.linear(O, P["out_w"], P["out_b"])
    B = F.layer_norm(X1, (dm,), P["ln2_w"], P["ln2_b"], eps)
    return X1 + F.linear(F.gelu(F.linear(B, P["w1"], P["b1"])), P["w2"], P["b2"])


def encoder_layer(P: dict, heads: int):
    """``torch.nn.TransformerEncoderLayer`` holding ``P`` (batch first; inputs ``[b t d]``)."""
    dm, ff = P["in_w"].shape[1], P["w1"].shape[0]
    layer = torch.nn.TransformerEncoderLayer(dm, heads, ff, dropout=0.0, activation="gelu", batch_first=True,
                                             norm_first=True, device=P["w1"].device, dtype=P["w1"].dtype).eval()
    with torch.no_grad():
        for mod, w, b in ((layer.self_attn, "in_w", "in_b"), (layer.self_attn.out_proj, "out_w", "out_b"),
                          (layer.linear1, "w1", "b1"), (layer.linear2, "w2", "b2"),
                          (layer.norm1, "ln1_w", "ln1_b"), (layer.norm2, "ln2_w", "ln2_b")):
            if mod is layer.self_attn:
                mod.in_proj_weight.copy_(P[w]), mod.in_proj_bias.copy_(P[b])
            else:
                mod.weight.copy_(P[w]), mod.bias.copy_(P[b])
    return layer


def reference(case: Case, s: dict, W: dict):
    """What ``case`` computes, by torch on the tensors ``W`` (diagram layouts) in their dtype."""
    if case.kind == "block":
        return block_forward(W["X"], torch_params(W), s["h"], case.causal)
    return F.conv2d(W["X"], W["W"], W["bias"], padding=1)


def compiled(fn):
    """``torch.compile(fn)`` with dynamo's recompile limits raised (as ``bench.compiled_flex``)."""
    cfg = torch._dynamo.config
    cfg.cache_size_limit = 1024
    for name, n in (("recompile_limit", 1024), ("accumulated_cache_size_limit", 4096),
                    ("accumulated_recompile_limit", 4096)):
        if hasattr(cfg, name):
            setattr(cfg, name, n)
    return torch.compile(fn, dynamic=False)


def flops(case: Case, s: dict) -> float:
    if case.kind == "conv":
        return 2.0 * s["n"] * s["o"] * s["c"] * 9 * s["hw"] ** 2
    t, dm, he, f = s["t"], s["d"], s["h"] * s["e"], s["f"]
    attn = 4.0 * t * t * he * (0.5 if case.causal else 1.0)
    return s["batch"] * (2.0 * t * dm * 3 * he + attn + 2.0 * t * he * dm + 4.0 * t * dm * f)


def rel(got, want) -> tuple[float, float]:
    """(max abs error, max abs error / max |want|), in float64."""
    err = float((got.double() - want).abs().max())
    return err, err / max(float(want.abs().max()), 1e-30)


# ------------------------------------------------------------------------------ one case

def kernels_of(k) -> tuple:
    return getattr(k, "kernels", (k,))


def tiny_hw():
    """An H100 with ``TINY_SMEM`` bytes of shared memory per block: toy sizes cut into kernels
    as the realistic ones do on the GPU (one fused kernel fits otherwise)."""
    import dataclasses
    return dataclasses.replace(nc.hardware.H100, smem_per_block_optin=TINY_SMEM)


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
        row["smem_limit"] = TINY_SMEM
    d, k = plan(case, s, row, tiny_hw() if args.tiny else None)
    save(row)
    if k is None:
        log(f"{name}: refused: {row['refused'][:300]}")
        return row
    log(f"{name}: {row['kernels']} kernels planned in {row['plan_s']:.1f} s")
    gpu = not args.tiny
    if gpu and args.budget_s:
        need = row["kernels"] * COMPILE_S[case.dtype] + (TORCH_COMPILE_S if case.kind == "block" else 0)
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
    row["tflops"] = flops(case, s) / row["ours_ms"] / 1e9
    return row


def timings(case: Case, s: dict, Wd: dict, run, reps: int, save, row: dict) -> None:
    """Milliseconds of the generated kernels and of torch's peers on the same inputs, into ``row``."""
    row["ours_ms"] = cuda_time(run, reps=reps, budget_s=2.0)
    save(row)
    log(f"  ours {row['ours_ms']:.3f} ms")
    peers = {}
    with torch.inference_mode():
        if case.kind == "conv":
            torch.backends.cudnn.benchmark = True
            peers["cudnn"] = lambda: F.conv2d(Wd["X"], Wd["W"], Wd["bias"], padding=1)
        else:
            P = torch_params(Wd)
            X = Wd["X"]
            peers["eager"] = lambda: block_forward(X, P, s["h"], case.causal)
            if s["h"] * s["e"] == s["d"]:   # nn.MultiheadAttention's heads are d / h wide
                layer = encoder_layer(P, s["h"])
                Xb = X if X.dim() == 3 else X[None]
                mask = torch.nn.Transformer.generate_square_subsequent_mask(s["t"], device=X.device, dtype=X.dtype) \
                    if case.causal else None
                peers["nn"] = lambda: layer(Xb, src_mask=mask, is_causal=case.causal)
            fn = compiled(block_forward)
            t0 = time.perf_counter()
            try:
                fn(X, P, s["h"], case.causal)
                torch.cuda.synchronize()
                row["torch_compile_s"] = time.perf_counter() - t0
                peers["compiled"] = lambda: fn(X, P, s["h"], case.causal)
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
