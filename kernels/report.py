"""Write kernels/BENCHMARKS.md from kernels/benchmarks.json (the output of kernels/bench.py,
plus the Nsight Compute DRAM counts of kernels/ncu_probe.py under the key ``ncu_dram``).

    python kernels/report.py [kernels/benchmarks.json] [kernels/BENCHMARKS.md]
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def main(argv=None):
    argv = argv or sys.argv[1:]
    src = Path(argv[0]) if argv else HERE / "benchmarks.json"
    dst = Path(argv[1]) if len(argv) > 1 else HERE / "BENCHMARKS.md"
    r = json.loads(src.read_text())
    env, mach = r["environment"], r["machine"]
    out = ["# Benchmarks: generated numba.cuda kernels vs PyTorch (fp32)", "",
           "Produced by `python kernels/bench.py --search` on the GPU (numbers below from one run; "
           "`kernels/benchmarks.json` holds every field), DRAM bytes by `ncu` on `kernels/ncu_probe.py` "
           "(merged by `kernels/ncu_merge.py`), this file by `python kernels/report.py`; code-generator "
           "variants are compared with `kernels/variants.py`.  The predictions (predicted HBM MB, roofline "
           "ms, the cost-model column of the Nsight table) were recomputed with the current cost model, on "
           "the CPU, by `python kernels/bench.py --repredict kernels/benchmarks.json` (causal rows leave out "
           "the chunks the mask skips); the measured columns are those of the GPU run.",
           "",
           f"- device: **{env['device']}** ({env['sm_count']} SMs); torch {env['torch']} (CUDA {env['cuda']}), "
           f"numba {env['numba']}, numba-cuda {env['numba_cuda']}, numpy {env['numpy']}, Python {env['python']}",
           f"- measured here: device-to-device copy {mach['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), "
           f"cuBLAS SGEMM 8192^3 {mach['sgemm_flops'] / 1e12:.1f} TFLOP/s (TF32 off); fp32 CUDA-core peak "
           f"{mach['fp32_peak_flops'] / 1e12:.1f} TFLOP/s (132 SMs x 128 FMA x 2 x 1.98 GHz)",
           "- every kernel was checked before timing against a float64 reference on random inputs "
           "(128 random query rows of 2 heads for attention, 128 rows for matmul); `err` is max abs error / max |ref|",
           "- times: median of CUDA-event timings of back-to-back launches after a warm-up; extra memory: "
           "peak of `torch.cuda.max_memory_allocated` above the inputs, output included",
           "- attention: `nc.library.attention(q, x, d, heads=h, batch=b, causal=...)`, B=2, H=16 for N <= 2048 "
           "and H=8 above (B*H = 32 / 16); FLOPs counted as 4 B H N^2 d (halved when causal); naive = "
           "`softmax(Q K^T / sqrt(d) + mask) V` with torch.matmul (TF32 off); SDPA = "
           "`torch.nn.functional.scaled_dot_product_attention` in fp32 (PyTorch picks its backend)", ""]
    cfg = {}
    for s in r.get("search", []):
        cfg.setdefault(s.get("search"), []).append(s)
    if cfg:
        out += ["## Measured tile search (N = 4096, B*H = 16; matmul 4096^3)", "",
                "| what | tiles | threads | prefetch | registers | ms |", "|---|---|---|---|---|---|"]
        for k, rows in cfg.items():
            for s in rows:
                out.append(f"| {k} | {s.get('tiles')} | {s.get('threads')} | {s.get('prefetch')} | "
                           f"{s.get('registers', '-')} | {fmt(s.get('ms'))} |")
        out.append("")
    out += ["## Attention", "",
            "| N | d | causal | ours ms | TFLOP/s | SDPA ms | naive ms | vs SDPA | vs naive | err | "
            "extra MiB ours / SDPA / naive | predicted HBM MB | roofline ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in r["attention"]:
        if "error" in a:
            out.append(f"| {a['N']} | {a['d']} | {a['causal']} | error: {a['error'][:80]} |")
            continue
        xs = a.get("sdpa_ms") / a["ms"] if a.get("sdpa_ms") else None
        xn = a.get("naive_ms") / a["ms"] if a.get("naive_ms") else None
        out.append(f"| {a['N']} | {a['d']} | {a['causal']} | {a['ms']:.3f} | {a['tflops']:.1f} | "
                   f"{fmt(a.get('sdpa_ms'))} | {fmt(a.get('naive_ms'))} | {fmt(xs, '.2f')}x | "
                   f"{fmt(xn, '.2f')}x | {a['rel_err']:.0e} | {a['extra_mib']:.0f} / "
                   f"{fmt(a.get('sdpa_extra_mib'), '.0f')} / {fmt(a.get('naive_extra_mib'), '.0f')} | "
                   f"{a.get('predicted_hbm_bytes', 0) / 1e6:.0f} | {fmt(a.get('roofline_ms'))} |")
    used = {}
    for a in r["attention"]:
        if "tiles" in a:
            key = (a["d"], str(a["tiles"]), a.get("threads"), str(a.get("prefetch")))
            u = used.setdefault(key, {"N": [], "regs": set(), "local": set(), "mappings": a.get("mappings")})
            u["N"].append(a["N"])
            u["regs"].add(a.get("registers"))
            u["local"].add(a.get("local_bytes"))
    out += ["", "Kernel configurations (the measured search's fastest at N = 4096; on short sequences the "
            "fastest whose grid still has a block per SM):", ""]
    for (D, tiles, T, pf), u in sorted(used.items()):
        out.append(f"- d={D}: tiles {tiles}, {T} threads, prefetch {pf}, N in {sorted(set(u['N']))}: "
                   f"{u['mappings']}; registers {sorted(x for x in u['regs'] if x is not None)}, "
                   f"local memory bytes {sorted(x for x in u['local'] if x is not None)}")
    out += ["",
            "## Matmul (fp32, TF32 off)", "",
            "| N | ours ms | TFLOP/s | cuBLAS ms | vs cuBLAS | err | predicted HBM MB | roofline ms |",
            "|---|---|---|---|---|---|---|---|"]
    for m in r["matmul"]:
        if "error" in m:
            out.append(f"| {m['N']} | error: {m['error'][:80]} |")
            continue
        out.append(f"| {m['N']} | {m['ms']:.3f} | {m['tflops']:.1f} | {fmt(m.get('cublas_ms'))} | "
                   f"{m['cublas_ms'] / m['ms']:.2f}x | {m['rel_err']:.0e} | "
                   f"{m.get('predicted_hbm_bytes', 0) / 1e6:.0f} | {fmt(m.get('roofline_ms'))} |")
    m0 = r["matmul"][0] if r["matmul"] else {}
    out += ["", f"Kernel configuration: tiles {m0.get('tiles')}, {m0.get('threads')} threads, prefetch "
            f"{m0.get('prefetch')}, {m0.get('mappings')}, {m0.get('registers')} registers.", ""]
    ncu = r.get("ncu_dram")
    if ncu:
        out += ["## Predicted vs measured HBM bytes (Nsight Compute `dram__bytes_read/write.sum`)", "",
                "| kernel | cost model (HBM level) MB | measured DRAM read + write MB | ratio |", "|---|---|---|---|"]
        for name, v in ncu.items():
            meas = v["read"] + v["write"]
            out.append(f"| {v['config']} | {v['predicted'] / 1e6:.0f} | {v['read'] / 1e6:.1f} + "
                       f"{v['write'] / 1e6:.1f} = {meas / 1e6:.1f} | {v['predicted'] / meas:.1f}x |")
        out.append("")
    out += [Path(HERE / "BENCHMARKS_NOTES.md").read_text() if (HERE / "BENCHMARKS_NOTES.md").exists() else ""]
    dst.write_text("\n".join(out).rstrip() + "\n")
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
