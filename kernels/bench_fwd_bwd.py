"""Forward + backward attention through ``nc.torch_op``, checked and timed against its peers.

    NUMBA_ENABLE_CUDASIM=0 python kernels/bench_fwd_bwd.py --cases "f16,4096,64,0;f16,4096,64,1" --out DIR
        [--backward auto|one|two|both]

Each case ``dtype,N,d,causal[,gG]`` (dtype f16, bf16 or f32; B*H heads merged into one axis ``h``,
``--bh``, default 32 for N <= 4096 and 16 above, the forward table's sizes; ``gG``: grouped-query
attention, B*H query heads sharing B*H / G key/value heads, the peers through ``enable_gqa``) runs

    op = nc.torch_op(attention(heads=h, causal=...).stream(x, "s_x").tile(q, "g_q").tile(h, 1))
    O = op(Q, K, V); dQ, dK, dV = torch.autograd.grad(O, (Q, K, V), dO)

on CUDA tensors: the generated forward with its logsumexp, then the generated backward in the
form ``--backward`` names (``nc.torch_op(..., backward=...)``): ``auto`` (default) the one the cost
model predicts faster, ``one`` the one kernel adding dQ across key tiles with fp32 atomics
(``op.last_backward_path == "gpu-fa2-atomic"``), ``two`` FlashAttention-2's two kernels
(``"gpu-fa2"``); ``both`` runs ``auto`` and also times forward + backward with each form forced
(``ours_one_ms``, ``ours_two_ms``) beside the cost model's two backward predictions
(``predicted_one_ms``, ``predicted_two_ms``). Block sizes chosen by ``nc.lower``.  Before timing,
O, dQ, dK and dV are checked against torch autograd in float64 on the same (rounded) inputs, all
heads, a few heads at a time (``err``: max abs error / max |ref| over the four).  Peers in the same run, same inputs and dtype: SDPA (default backend),
FlexAttention (``torch.compile(flex_attention)``, dynamo's cache limits raised, causal through
``create_block_mask``) and naive torch (``softmax(Q K^T / sqrt(d)) V``, autograd).  Times are
CUDA-event medians of the whole forward + backward (and of the forward alone), each timing one
call between its events, so the host's latency before the first kernel and any GPU idle while the
host prepares the backward count; ``*_steady_ms`` time ``--steady`` back-to-back calls per pair of
events (default 10), where the host's work overlaps the GPU's as in a training loop; extra memory is
the peak of ``torch.cuda.max_memory_allocated`` during forward + backward above what was
allocated before (inputs, dO), the gradients included.  ``--prefetch auto|none|regs|double`` (default auto, the op's own) is passed
to ``nc.torch_op`` (every kernel of the op: the next chunk into registers, or two shared-memory
buffers per chunked input filled by ``cp.async``).  ``ours_kernels``: the CUDA time per kernel of
one forward + backward (``torch.profiler``, CUPTI: the generated kernels and torch's own, by
name, milliseconds per call averaged over 5 calls), so a slow total names its kernel.  Progress goes to stdout as it happens
(flushed); the table is printed last; ``fwd_bwd.json`` under ``--out`` has every field.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.lowering import column_values, emit, emit_mma, emit_states, paired_stores, planner, producer, unswitch, wgmma, wgmma_plan  # noqa: E402
from bench import compiled_flex, cuda_time, environment, kernel_ms  # noqa: E402

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
FORMS = {"auto": None, "one": "one kernel", "two": "two kernels", "both": None}
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def flash(causal: bool, groups: int = 1):
    """Attention on heads ``h`` (key/value heads, each shared by ``groups`` query heads ``g``
    where ``groups > 1``: grouped-query attention, ``Q[h g q d]``), relabelled as FlashAttention."""
    q, x, d, h, g = nc.axes("q x d h g")
    att = nc.library.attention(q=q, x=x, d=d, heads=h, causal=causal, **({"groups": g} if groups > 1 else {}))
    return att.stream(x, "s_x").tile(q, "g_q").tile(h, 1)


def reference(Q, K, V, dO, causal, chunk=4):
    """float64 O and gradients, ``chunk`` key/value heads at a time (N x N scores per head);
    ``Q``, ``dO`` ``[h q d]``, or ``[h g q d]`` with ``g`` query heads per key/value head."""
    outs = [[], [], [], []]
    scale = 1 / math.sqrt(Q.shape[-1])
    grouped = Q.dim() == 4
    for s in range(0, Q.shape[0], chunk):
        q, k, v = (t[s:s + chunk].double().requires_grad_() for t in (Q, K, V))
        sc = torch.einsum("hgqd,hxd->hgqx" if grouped else "hqd,hxd->hqx", q, k) * scale
        if causal:
            n = sc.shape[-1]
            sc = sc.masked_fill(torch.ones(n, n, dtype=torch.bool, device=sc.device).triu(1), -math.inf)
        o = torch.einsum("hgqx,hxd->hgqd" if grouped else "hqx,hxd->hqd", torch.softmax(sc, -1), v)
        g = torch.autograd.grad(o, (q, k, v), dO[s:s + chunk].double())
        for lst, t in zip(outs, (o.detach(),) + g):
            lst.append(t)
        del sc, o, g
    return [torch.cat(lst) for lst in outs]


def rel(a, b) -> float:
    return float((a.detach().double() - b).abs().max() / b.abs().max().clamp_min(1e-30))


def flex_fn():
    from torch.nn.attention.flex_attention import create_block_mask
    return compiled_flex(), create_block_mask


STEADY = 10
"""Back-to-back calls per timing of the steady-state columns (``*_steady_ms``, ``--steady``)."""


def heads4(Q, K, V, dO):
    """``[1, heads, N, d]`` tensors for the peers, the query heads of a group next to each other
    (query head ``h * G + g`` uses key/value head ``h``, as ``enable_gqa`` reads them); the groups."""
    G = Q.shape[1] if Q.dim() == 4 else 1
    q4, k4, v4 = (t.detach().reshape(1, -1, *t.shape[-2:]).requires_grad_() for t in (Q, K, V))
    return q4, k4, v4, dO.reshape(1, -1, *dO.shape[-2:]), G


def peers(Q, K, V, dO, causal) -> dict:
    """Forward and forward + backward times of SDPA, FlexAttention and naive torch (an isolated
    call, and back-to-back calls: ``*_steady_ms``); grouped heads through their ``enable_gqa``."""
    F = torch.nn.functional
    q4, k4, v4, d4, G = heads4(Q, K, V, dO)
    gqa = {"enable_gqa": True} if G > 1 else {}
    res = {}

    def sdpa():
        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, **gqa)

    def naive():
        s = (q4 @ k4.repeat_interleave(G, 1).transpose(-1, -2)) / math.sqrt(Q.shape[-1])
        if causal:
            n = s.shape[-1]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), -math.inf)
        return torch.softmax(s, -1) @ v4.repeat_interleave(G, 1)

    fns = {"sdpa": sdpa, "naive": naive}
    try:
        fn, make_mask = flex_fn()
        N = Q.shape[-2]
        bm = make_mask(lambda b, h, i, j: i >= j, None, None, N, N, device="cuda") if causal else None
        fns["flex"] = lambda: fn(q4, k4, v4, block_mask=bm, **gqa)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run is recorded, not fatal
        res["flex_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    for name, f in fns.items():
        try:
            res[f"{name}_fwd_ms"] = cuda_time(lambda: f())
            res[f"{name}_ms"] = cuda_time(lambda: torch.autograd.grad(f(), (q4, k4, v4), d4))
            if STEADY > 1:
                res[f"{name}_steady_ms"] = cuda_time(lambda: torch.autograd.grad(f(), (q4, k4, v4), d4), inner=STEADY)
            res[f"{name}_extra_mib"] = peak_extra(lambda: torch.autograd.grad(f(), (q4, k4, v4), d4))
        except torch.cuda.OutOfMemoryError:
            res[f"{name}_error"] = "out of memory"
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            res[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return res


def peak_extra(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return (peak - base) / 2 ** 20


PREFETCH = {"none": False, "regs": True, "double": "double", "auto": "auto"}


def kernel_breakdown(fn, calls: int = 5) -> dict:
    """CUDA milliseconds per call of each kernel ``fn`` launches (torch.profiler, CUPTI), the ten
    longest, names cut to 60 characters."""
    out = {}
    for name, ms in kernel_ms(fn, calls).items():
        out[name[:60]] = round(out.get(name[:60], 0.0) + ms, 4)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:10])


def case(dt: str, N: int, D: int, causal: bool, BH: int, check: bool, backward: str = "auto",
         prefetch: str = "auto", tiles: dict | None = None, with_peers: bool = True, fp32: str = "fma",
         groups: int = 1) -> dict:
    t0 = time.perf_counter()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = (BH // groups, groups) if groups > 1 else (BH,)      # BH query heads, BH / groups key/value heads
    Q, K, V, dO = (torch.randn(*heads, N, D, device="cuda", generator=g).to(DTYPES[dt])
                   for heads in (rows, rows[:1], rows[:1], rows))
    Q, K, V = (t.requires_grad_() for t in (Q, K, V))
    tiles = dict(tiles or {})
    threads = tiles.pop("threads", None)
    op = nc.torch_op(flash(causal, groups), tiles=tiles or None, threads=threads, verify=False, backward=FORMS[backward],
                     prefetch=PREFETCH[prefetch], fp32=fp32)
    O = op(Q, K, V)
    grads = torch.autograd.grad(O, (Q, K, V), dO)
    torch.cuda.synchronize()
    choice = op.backward_choice
    res = {"dtype": dt, "N": N, "d": D, "causal": causal, "BH": BH, "groups": groups, "prefetch": prefetch, "tiles": tiles or {}, "threads": threads,
           "path": op.last_path,
           "backward_path": op.last_backward_path, "notes": list(getattr(op, "notes", [])),
           "backward_form": choice and choice.form, "backward_why": choice and choice.why,
           "compile_s": time.perf_counter() - t0}
    for key, form in (("one", "one kernel"), ("two", "two kernels")):
        if choice is not None and choice.seconds(form) is not None:
            res[f"predicted_{key}_ms"] = choice.seconds(form) * 1e3
    if check:
        want = reference(Q.detach(), K.detach(), V.detach(), dO, causal)
        res["errs"] = {n: rel(a, b) for n, a, b in zip(("O", "dQ", "dK", "dV"), (O,) + grads, want)}
        res["err"] = max(res["errs"].values())
        q4, k4, v4, d4, _ = heads4(Q, K, V, dO)   # SDPA's own error, same data
        s_out = torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=causal,
                                                                 **({"enable_gqa": True} if groups > 1 else {}))
        s_grads = torch.autograd.grad(s_out, (q4, k4, v4), d4)
        res["sdpa_err"] = max(rel(a.reshape(b.shape), b) for a, b in zip((s_out,) + s_grads, want))
        del want, q4, k4, v4, s_out, s_grads
    del O, grads
    res["ours_fwd_ms"] = cuda_time(lambda: op(Q, K, V))
    res["ours_ms"] = cuda_time(lambda: torch.autograd.grad(op(Q, K, V), (Q, K, V), dO))
    if STEADY > 1:   # back to back: the host's work per call overlaps the GPU's (a training loop)
        res["ours_steady_ms"] = cuda_time(lambda: torch.autograd.grad(op(Q, K, V), (Q, K, V), dO), inner=STEADY)
    res["ours_extra_mib"] = peak_extra(lambda: torch.autograd.grad(op(Q, K, V), (Q, K, V), dO))
    try:
        res["ours_kernels"] = kernel_breakdown(lambda: torch.autograd.grad(op(Q, K, V), (Q, K, V), dO))
    except Exception as e:  # noqa: BLE001 - the profiler is optional; the timings above stand
        res["ours_kernels"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    if backward == "both":   # each form forced, timed the same way
        for key, form in (("one", "one kernel"), ("two", "two kernels")):
            forced = nc.torch_op(flash(causal, groups), tiles=tiles or None, threads=threads, verify=False, backward=form,
                                 prefetch=PREFETCH[prefetch], fp32=fp32)
            res[f"ours_{key}_ms"] = cuda_time(lambda: torch.autograd.grad(forced(Q, K, V), (Q, K, V), dO))
            res[f"backward_path_{key}"] = forced.last_backward_path
    if with_peers:
        res.update(peers(Q, K, V, dO, causal))
    flops = 4 * BH * N * N * D * (0.5 if causal else 1) * 3.5   # forward 2 matmuls, backward 5
    res["ours_tflops"] = flops / res["ours_ms"] / 1e9
    return res


def steady_ratio(r: dict) -> str:
    """FlexAttention's steady-state time over ours (back-to-back calls), or '-'."""
    a, b = r.get("flex_steady_ms"), r.get("ours_steady_ms")
    return f"{a / b:.2f}x" if isinstance(a, float) and isinstance(b, float) else "-"


def switch_value(old, v):
    """A tunable's value from ``NAME=0|1``: a switch that is a bool or a mode name (``"auto"``)
    becomes ``False`` / ``True``; a number keeps its type; a word is the mode (``HAND_OVER=block``)."""
    if not str(v).lstrip("-").isdigit():
        return str(v)
    return bool(int(v)) if isinstance(old, (bool, str)) and str(v) in ("0", "1") else type(old)(v)


def main(argv=None):
    global STEADY
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="f16,4096,64,0;f16,4096,64,1",
                    help="semicolon list of dtype,N,d,causal[,gG] (gG: G query heads per key/value head)")
    ap.add_argument("--bh", type=int, default=0, help="B*H (0: 32 for N <= 4096, else 16)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--backward", choices=sorted(FORMS), default="auto",
                    help="the backward's form: auto (the cost model's), one, two, or both timed")
    ap.add_argument("--prefetch", choices=sorted(PREFETCH), default="auto",
                    help="nc.torch_op(prefetch=...): auto (the op's default: double where registers allow), none, "
                         "regs (next chunk into registers), double (cp.async)")
    ap.add_argument("--tiles", default="", help="semicolon list of block choices, each a comma list of "
                    "symbol=size (the op's blocks: s_x, g_q forward; g_x, s_q the dK, dV kernel; g_q, s_x dQ; "
                    "threads=N: nc.torch_op(threads=N), every kernel's threads per block); "
                    "every case runs once per choice, peers with the first; an upper-case NAME=0|1 in a "
                    "choice sets that tunable of napkin_cat.lowering.planner for the choice (FRAG_OPERANDS=0: "
                    "the backward's P and dS through shared memory, as before that pass; HOIST_REGISTERS=0: no row "
                    "fragments held in registers across the stream loops); TF32X3=1: nc.torch_op(fp32='3xtf32'), "
                    "fp32 kernels on tensor cores by 3xTF32")
    ap.add_argument("--steady", type=int, default=STEADY,
                    help="back-to-back calls per timing of the steady-state columns (the host's work per call "
                         "overlapping the GPU's, as in a training loop); 1: none. The other columns time one call "
                         "between events, its host latency included")
    ap.add_argument("--out", default=str(ROOT / "kernels"))
    args = ap.parse_args(argv)
    STEADY = args.steady
    choices = [{k: int(v) if v.lstrip("-").isdigit() else v for k, v in (kv.split("=") for kv in c.split(",") if kv)}
               for c in args.tiles.split(";")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"environment": environment(), "cases": []}
    print(json.dumps(results["environment"]), flush=True)
    for spec in args.cases.split(";"):
        dt, N, D, c, *grp = spec.split(",")
        N, D, causal = int(N), int(D), c.strip() in ("1", "yes", "true", "causal")
        groups = int(grp[0].lstrip("g")) if grp else 1
        BH = args.bh or (32 if N <= 4096 else 16)
        for n, tiles in enumerate(choices):
            switches = {k: v for k, v in tiles.items() if k.isupper()}
            fp32 = "3xtf32" if switches.pop("TF32X3", 0) else "fma"   # an option of the op, not a tunable
            blocks = {k: v for k, v in tiles.items() if not k.isupper()}
            home = {k: next(m for m in (planner, emit_mma, producer, emit, emit_states, column_values, paired_stores, wgmma, wgmma_plan, unswitch) if hasattr(m, k)) for k in switches}
            saved = {k: getattr(home[k], k) for k in switches}
            try:
                for k, v in switches.items():
                    setattr(home[k], k, switch_value(saved[k], v))
                r = case(dt, N, D, causal, BH, not args.no_check, args.backward, args.prefetch, blocks, n == 0, fp32, groups)
            except Exception as e:  # noqa: BLE001 - recorded with the case, the run goes on
                r = {"dtype": dt, "N": N, "d": D, "causal": causal, "groups": groups, "tiles": blocks,
                     "error": f"{type(e).__name__}: {str(e)[:300]}"}
            finally:
                for k, v in saved.items():
                    setattr(home[k], k, v)
            r["switches"] = {**switches, **({"TF32X3": 1} if fp32 == "3xtf32" else {})}
            results["cases"].append(r)
            print(json.dumps(r), flush=True)
            (out / "fwd_bwd.json").write_text(json.dumps(results, indent=1))
            torch.cuda.empty_cache()
    print("\n| dtype | N | d | causal | blocks | paths | err (SDPA's) | ours fwd+bwd ms | TFLOP/s | SDPA | Flex | naive "
          "| vs Flex | vs SDPA | extra MiB ours / SDPA / Flex | kernels ms | steady ms ours / SDPA / Flex "
          "| steady vs Flex |")
    grp = lambda r: f" (GQA {r['groups']})" if r.get("groups", 1) > 1 else ""  # noqa: E731
    f = lambda r, k: f"{r[k]:.3f}" if isinstance(r.get(k), float) else r.get(k.replace("_ms", "_error"), "-")  # noqa: E731
    for r in results["cases"]:
        if "error" in r:
            print(f"| {r['dtype']} | {r['N']} | {r['d']}{grp(r)} | {r['causal']} | {r['error']} |")
            continue
        ratio = lambda k: f"{r[k] / r['ours_ms']:.2f}x" if isinstance(r.get(k), float) else "-"  # noqa: E731
        mem = " / ".join(f"{r[k]:.0f}" if isinstance(r.get(k), float) else "-"
                         for k in ("ours_extra_mib", "sdpa_extra_mib", "flex_extra_mib"))
        blocks = ",".join(f"{k}={v}" for k, v in {**r.get("tiles", {}), **r.get("switches", {})}.items()) or "chosen"
        kms = " / ".join(f"{v:.2f}" for k, v in r.get("ours_kernels", {}).items()
                         if "generated" in k and isinstance(v, float))
        steady = " / ".join(f(r, f"{k}_steady_ms") for k in ("ours", "sdpa", "flex"))
        print(f"| {r['dtype']} | {r['N']} | {r['d']}{grp(r)} | {r['causal']} | {blocks} | {r['path']}/{r['backward_path']} "
              f"| {r.get('err', float('nan')):.1e} (SDPA {r.get('sdpa_err', float('nan')):.1e}) | {r['ours_ms']:.3f} | {r['ours_tflops']:.0f} | {f(r, 'sdpa_ms')} "
              f"| {f(r, 'flex_ms')} | {f(r, 'naive_ms')} | {ratio('flex_ms')} | {ratio('sdpa_ms')} | {mem} | {kms} "
              f"| {steady} | {steady_ratio(r)} |")
    both = [r for r in results["cases"] if "ours_one_ms" in r]
    if both:   # --backward both: the cost model's pick and the op's (a measured rule may overrule
        # the model: backward_forms.WARPGROUP_ONE_KERNEL) against the measured faster form
        print("\n| dtype | N | d | causal | predicted backward ms one / two | measured fwd+bwd ms one / two "
              "| predicted faster | the op takes | measured faster |")
        for r in both:
            pred = " / ".join(f(r, f"predicted_{k}_ms") for k in ("one", "two"))
            model = "one kernel" if r["predicted_one_ms"] < r["predicted_two_ms"] else "two kernels"
            fast = "one kernel" if r["ours_one_ms"] < r["ours_two_ms"] else "two kernels"
            print(f"| {r['dtype']} | {r['N']} | {r['d']} | {r['causal']} | {pred} | {r['ours_one_ms']:.3f} / "
                  f"{r['ours_two_ms']:.3f} | {model} | {r['backward_form']} | {fast} |")


if __name__ == "__main__":
    main()
