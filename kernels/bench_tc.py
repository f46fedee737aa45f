"""Tensor-core kernels (fp16 / bf16) generated from diagrams, checked and timed on a GPU.

    python kernels/bench_tc.py [--quick] [--out DIR] [--cases SPEC]

First every kernel is checked: generated fp16 and bf16 attention (non-causal and causal, ragged
N, GQA, d_v != d_k, ALiBi, the (O, logsumexp) pair) and matmul against a float64 reference of
the same rounded inputs, within the dtype's tolerance.  Then, at the issue's sizes (B*H = 32 for
N = 4096, 16 for N = 16384; d = 64, 128; causal and not), CUDA-event medians of: the generated
kernel, naive torch fp16 (materialises softmax(Q K^T) V), SDPA (default backend, cuDNN on
Hopper) and SDPA's FLASH_ATTENTION backend, FlexAttention (``torch.compile(flex_attention)``,
dynamo's cache limit raised so it never falls back to eager); matmul 4096^3 and 8192^3 against
torch.matmul fp16 (cuBLAS).  Registers, local memory, shared memory and the SASS's HMMA count of
each generated kernel are recorded.  Prints a table last; writes tc.json under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
from bench import compiled_flex, cuda_time, environment  # noqa: E402

DEV = "cuda"
TDT = {"f16": torch.float16, "bf16": torch.bfloat16}
NDT = {"f16": nc.f16, "bf16": nc.bf16}
TOL = {"f16": 4e-3, "bf16": 2.5e-2}   # max |err| / max |ref| allowed in the checks below


def sass_counts(kernel) -> dict:
    try:
        disp = kernel.dispatcher
        sass = disp.inspect_sass()
        sass = "\n".join(sass.values()) if isinstance(sass, dict) else sass
    except Exception as e:  # noqa: BLE001 - a report, not a check
        return {"sass_error": str(e)[:120]}
    cnt = lambda p: len(re.findall(p, sass))
    return {"HMMA": cnt(r"\bHMMA"), "LDS": cnt(r"\bLDS"), "LDL_STL": cnt(r"\b(LDL|STL)"), "CALL": cnt(r"\bCALL")}


def info(kernel) -> dict:
    out = {"threads": kernel.launch.block[0], "smem_bytes": kernel.launch.dynamic_smem_bytes,
           "grid": kernel.launch.grid, "engines": "mma" if "mma_" in kernel.source else "cuda_core"}
    try:
        out.update(kernel.compiled_info())
    except Exception as e:  # noqa: BLE001
        out["compiled_info_error"] = str(e)[:120]
    out.update(sass_counts(kernel))
    return out


def rel(out, ref) -> float:
    return float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ----------------------------------------------------------------------------- attention

def attention_diagram(N, D, causal, B, H, dt, **kw):
    q, x, d, h, b = nc.axes("q x d h b")
    sizes = {q: N, x: N, d: D, h: H, b: B}
    if "dv_size" in kw:
        (e,) = nc.axes("e")
        kw["dv"] = e
        sizes[e] = kw.pop("dv_size")
    return nc.library.attention(q=q, x=x, d=d, heads=h, batch=b, causal=causal, dtype=NDT[dt], **kw).bind(sizes)


def torch_reference(Q, K, V, causal, scale, bias=None):
    S = torch.matmul(Q.double(), K.double().transpose(-1, -2)) * scale
    if bias is not None:
        S = S + bias
    if causal:
        n, m = S.shape[-2:]
        S = S.masked_fill(~torch.ones(n, m, device=S.device, dtype=torch.bool).tril(), float("-inf"))
    L = torch.logsumexp(S, dim=-1)
    return torch.matmul(torch.softmax(S, dim=-1), V.double()), L


def check_attention(dt, N, D, causal, B=1, H=2, tiles=None, threads=128, **kw) -> dict:
    dia = attention_diagram(N, D, causal, B, H, dt, **{k: v for k, v in kw.items() if k != "alibi"},
                            **({"bias": nc.alibi(0.5)} if kw.get("alibi") else {}))
    k = nc.lower(dia, tiles=tiles, threads=threads, verify=False)
    g = torch.Generator(device=DEV).manual_seed(1)
    dv = kw.get("dv_size", D)
    Q = torch.randn(B, H, N, D, device=DEV, generator=g).to(TDT[dt])
    K = torch.randn(B, H, N, D, device=DEV, generator=g).to(TDT[dt])
    V = torch.randn(B, H, N, dv, device=DEV, generator=g).to(TDT[dt])
    out = k(Q, K, V)
    bias = None
    if kw.get("alibi"):
        i = torch.arange(N, device=DEV, dtype=torch.float64)
        bias = 0.5 * (i[None, :] - i[:, None])   # alibi(slope) = slope * (j - i)
    ref, L = torch_reference(Q, K, V, causal, 1 / math.sqrt(D), bias)
    if kw.get("logsumexp"):
        O, Lk = out
        err = max(rel(O, ref), float((Lk.double() - L).abs().max() / L.abs().max()))
    else:
        O = out
        err = rel(O, ref)
    return {"case": f"attention {dt} N={N} d={D}{' dv=' + str(dv) if dv != D else ''}"
                    f"{' causal' if causal else ''}{' alibi' if kw.get('alibi') else ''}"
                    f"{' lse' if kw.get('logsumexp') else ''}",
            "rel_err": err, "ok": err < TOL[dt] and O.dtype == TDT[dt], **info(k)}


PREFETCH = {0: False, 1: True, 2: "double"}


def sampled_error(O, Q, K, V, causal, g) -> float:
    """Max error / max |ref| of attention output ``O`` [B H N d] on 128 random query rows of the
    first two heads, against float64 attention of the same (rounded) inputs."""
    N, D = Q.shape[-2:]
    rows = torch.randperm(N, device=DEV, generator=g)[:128].sort().values
    S = torch.matmul(Q[:, :2, rows].double(), K[:, :2].double().transpose(-1, -2)) / math.sqrt(D)
    if causal:
        j = torch.arange(N, device=DEV)
        S = S.masked_fill(j[None, None, None, :] > rows[None, None, :, None], float("-inf"))
    return rel(O[:, :2, rows], torch.matmul(torch.softmax(S, -1), V[:, :2].double()))


def time_attention(dt, N, D, causal, BH, tiles, threads, peers=True, prefetch=False) -> dict:
    B, H = 2, BH // 2
    dia = attention_diagram(N, D, causal, B, H, dt)
    t0 = time.perf_counter()
    k = nc.lower(dia, tiles=tiles, threads=threads, verify=False, prefetch=prefetch)
    g = torch.Generator(device=DEV).manual_seed(0)
    Q, K, V = (torch.randn(B, H, N, D, device=DEV, generator=g).to(TDT[dt]) for _ in range(3))
    O = torch.full_like(Q, float("nan"))
    run = k.prepare(Q, K, V, out=O)
    run()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    err = sampled_error(O, Q, K, V, causal, g)
    assert not torch.isnan(O).any(), "NaNs left in the output"
    flops = 4 * B * H * N * N * D * (0.5 if causal else 1.0)
    ms = cuda_time(run)
    res = {"kind": "attention", "dtype": dt, "N": N, "d": D, "causal": causal, "BH": BH,
           "tiles": tiles or {r.axis: r.size for r in k.diagram.schedule if r.op in ("tile", "stream") and r.size != 1},
           "prefetch": prefetch,
           "rel_err": err, "ok": err < TOL[dt], "ms": ms, "tflops": flops / ms / 1e9, "compile_s": compile_s,
           **info(k)}
    if peers:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        F = torch.nn.functional
        res["sdpa_ms"] = cuda_time(lambda: F.scaled_dot_product_attention(Q, K, V, is_causal=causal))
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                res["sdpa_flash_ms"] = cuda_time(lambda: F.scaled_dot_product_attention(Q, K, V, is_causal=causal))
        except RuntimeError as e:
            res["sdpa_flash_error"] = str(e)[:100]
        res.update(flex(Q, K, V, causal, N))
        if B * H * N * N * 2 * 3 < 0.6 * torch.cuda.mem_get_info()[0]:
            def naive():
                S = torch.matmul(Q, K.transpose(-1, -2)) * (1 / math.sqrt(D))
                if causal:
                    S = S.masked_fill(~torch.ones(N, N, device=DEV, dtype=torch.bool).tril(), float("-inf"))
                return torch.matmul(torch.softmax(S, dim=-1), V)
            res["naive_ms"] = cuda_time(naive, budget_s=1.5)
    del Q, K, V, O
    torch.cuda.empty_cache()
    return res


def flex(Q, K, V, causal, N) -> dict:
    try:
        from torch.nn.attention.flex_attention import create_block_mask
        fn = compiled_flex()
        bm = None
        if causal:
            bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, N, N, device=DEV)
        out = fn(Q, K, V, block_mask=bm)
        torch.cuda.synchronize()
        return {"flex_ms": cuda_time(lambda: fn(Q, K, V, block_mask=bm)), "flex_ok": bool(torch.isfinite(out).all())}
    except Exception as e:  # noqa: BLE001 - a peer that does not run is recorded, not fatal
        return {"flex_error": f"{type(e).__name__}: {str(e)[:160]}"}


# ----------------------------------------------------------------------------- matmul

def matmul_case(dt, M, tiles, threads, peers=True, check_only=False, prefetch=False) -> dict:
    a, b, c = nc.axes("a b c")
    dia = nc.library.matmul(a=a, b=b, c=c, dtype=NDT[dt]).bind({a: M, b: M, c: M})
    k = nc.lower(dia, tiles=tiles or None, threads=threads or None, verify=False, prefetch=prefetch)
    g = torch.Generator(device=DEV).manual_seed(0)
    A = torch.randn(M, M, device=DEV, generator=g).to(TDT[dt])
    Bm = torch.randn(M, M, device=DEV, generator=g).to(TDT[dt])
    C = torch.full((M, M), float("nan"), device=DEV, dtype=TDT[dt])
    run = k.prepare(A, Bm, out=C)
    run()
    torch.cuda.synchronize()
    rows = torch.randperm(M, device=DEV, generator=g)[:128]
    err = rel(C[rows], torch.matmul(A[rows].double(), Bm.double()))
    res = {"kind": "matmul", "dtype": dt, "N": M, "tiles": tiles, "prefetch": prefetch, "rel_err": err, "ok": err < TOL[dt], **info(k)}
    if not check_only:
        ms = cuda_time(run)
        res.update(ms=ms, tflops=2 * M ** 3 / ms / 1e9)
        if peers:
            res["cublas_ms"] = cuda_time(lambda: torch.matmul(A, Bm))
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--att", default="", help="semicolon list of 'q,x,threads,prefetch' attention configs "
                                              "(prefetch 0: none, 1: registers, 2: double-buffered)")
    ap.add_argument("--mm", default="", help="semicolon list of 'a,c,b,threads,prefetch' matmul configs")
    ap.add_argument("--sizes", default="", help="semicolon list of 'N,d' attention sizes")
    ap.add_argument("--dtypes", default="f16,bf16")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"environment": environment(), "checks": [], "attention": [], "matmul": []}
    print(json.dumps(res["environment"]), flush=True)

    def save():
        (out / "tc.json").write_text(json.dumps(res, indent=1, default=str))

    if not args.skip_checks:
        for dt in ("f16", "bf16"):
            for spec in [dict(N=200, D=64, causal=False), dict(N=200, D=64, causal=True),
                         dict(N=333, D=128, causal=True), dict(N=256, D=64, causal=False, alibi=True),
                         dict(N=256, D=64, causal=True, logsumexp=True),
                         dict(N=192, D=64, causal=False, dv_size=128)]:
                try:
                    r = check_attention(dt, **spec, tiles={"q": 64, "x": 64}, threads=128)
                except Exception as e:  # noqa: BLE001
                    r = {"case": f"attention {dt} {spec}", "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                print("CHECK", json.dumps(r, default=str), flush=True)
                res["checks"].append(r)
            try:
                r = matmul_case(dt, 320, {"a": 128, "c": 128, "b": 32}, 256, check_only=True)
            except Exception as e:  # noqa: BLE001
                r = {"case": f"matmul {dt}", "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print("CHECK", json.dumps(r, default=str), flush=True)
            res["checks"].append(r)
            save()
    cfgs = [tuple(int(v) for v in c.split(",")) for c in args.att.split(";") if c] or [(64, 64, 128, 2)]
    sizes = [tuple(int(v) for v in c.split(",")) for c in args.sizes.split(";") if c] or (
        [(4096, 64), (4096, 128)] if args.quick else [(4096, 64), (4096, 128), (16384, 64), (16384, 128)])
    dtypes = args.dtypes.split(",")
    for N, D in sizes:
        for causal in (False, True):
            for dt in dtypes:
                for (tq, tx, T, pf) in cfgs:
                    try:   # a config of zeros: the tiles and threads nc.lower chooses itself
                        r = time_attention(dt, N, D, causal, 32 if N <= 4096 else 16,
                                           {"q": tq, "x": tx} if tq else None, T or None,
                                           peers=(tq, tx, T, pf) == cfgs[0] and dt == dtypes[0],
                                           prefetch=PREFETCH[pf])
                    except Exception as e:  # noqa: BLE001
                        r = {"kind": "attention", "dtype": dt, "N": N, "d": D, "causal": causal,
                             "tiles": (tq, tx, T), "error": f"{type(e).__name__}: {str(e)[:300]}"}
                    print("ATT", json.dumps(r, default=str), flush=True)
                    res["attention"].append(r)
                    save()
    mcfgs = [tuple(int(v) for v in c.split(",")) for c in args.mm.split(";") if c] or [(128, 128, 32, 256, 2)]
    for M in ((4096,) if args.quick else (4096, 8192)):
        for dt, (ta, tc, tb, T, pf) in [(dt, c) for dt in dtypes for c in mcfgs]:
            try:
                r = matmul_case(dt, M, {"a": ta, "c": tc, "b": tb} if ta else None, T, prefetch=PREFETCH[pf],
                                peers=dt == dtypes[0] and (ta, tc, tb, T, pf) == mcfgs[0])
            except Exception as e:  # noqa: BLE001
                r = {"kind": "matmul", "dtype": dt, "N": M, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print("MM", json.dumps(r, default=str), flush=True)
            res["matmul"].append(r)
            save()
    print("\n| case | ok | err | ms | TFLOP/s | sdpa | sdpa-flash | flex | naive | cublas | regs | HMMA |")
    for r in res["checks"] + res["attention"] + res["matmul"]:
        name = r.get("case") or f"{r.get('kind')} {r.get('dtype')} N={r.get('N')} d={r.get('d', '')}" \
                                 f"{' causal' if r.get('causal') else ''} {r.get('tiles', '')} T={r.get('threads', '')} " \
                                 f"pf={r.get('prefetch', '')}"
        f = lambda k: (f"{r[k]:.3f}" if isinstance(r.get(k), float) else str(r.get(k, "")))
        print(f"| {name} | {r.get('ok', '')} | {f('rel_err')} | {f('ms')} | {f('tflops')} | {f('sdpa_ms')} | "
              f"{f('sdpa_flash_ms')} | {f('flex_ms')} | {f('naive_ms')} | {f('cublas_ms')} | {r.get('registers', '')} | "
              f"{r.get('HMMA', '')} |" + (f" {r['error'][:120]}" if 'error' in r else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
