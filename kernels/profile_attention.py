"""Launch one generated attention kernel a few times, checked first, for Nsight Compute to profile.

    ncu --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --section InstructionStats -k regex:kernel_ --launch-skip 2 --launch-count 1 \\
        python3 kernels/profile_attention.py --n 4096 --d 64 --dtype f16 [--causal] [--prefetch double]

The kernel is the one ``kernels/bench_tc.py`` times (the same diagram, tiles and threads chosen by
``nc.lower`` unless given); its output is compared with float64 attention on 128 random rows
before the profiled launches, so a profile is never of a wrong kernel.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
from bench_tc import PREFETCH, TDT, TOL, attention_diagram, sampled_error  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--bh", type=int, default=32)
    ap.add_argument("--dtype", choices=sorted(TDT), default="f16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--prefetch", type=int, choices=sorted(PREFETCH), default=0,
                    help="0: none, 1: registers, 2: double-buffered")
    ap.add_argument("--launches", type=int, default=4)
    args = ap.parse_args(argv)
    B, H, N, D = 2, args.bh // 2, args.n, args.d
    kernel = nc.lower(attention_diagram(N, D, args.causal, B, H, args.dtype), verify=False,
                      prefetch=PREFETCH[args.prefetch])
    g = torch.Generator(device="cuda").manual_seed(0)
    Q, K, V = (torch.randn(B, H, N, D, device="cuda", generator=g).to(TDT[args.dtype]) for _ in range(3))
    O = torch.full_like(Q, float("nan"))
    run = kernel.prepare(Q, K, V, out=O)
    run()
    err = sampled_error(O, Q, K, V, args.causal, g)
    print(f"{kernel.name}: grid {kernel.launch.grid}, block {kernel.launch.block}, "
          f"smem {kernel.launch.dynamic_smem_bytes} B, rel err {err:.2e}", flush=True)
    if not err < TOL[args.dtype]:
        print("kernel output is wrong: not profiled", file=sys.stderr)
        return 1
    for _ in range(args.launches):
        run()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
