"""Probe: one launch of a gallery variant's generated kernel and of FlexAttention's, for Nsight Compute.

``kernels/variants.py`` builds, checks (against float64) and times each variant; here its kernel
timer is replaced by one launch inside ``cudaProfilerStart`` / ``Stop``, so that a profiler started
with ``--profile-from-start off`` sees exactly those two kernels (compilation, checks and warm-up
outside).  GPU only.

    ncu --profile-from-start off --set full -o sw python3 kernels/probes/ncu_variant.py sliding_window [f16]
    ncu --import sw.ncu-rep --page details --print-units base
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

import torch  # noqa: E402

import variants  # noqa: E402


def one_profiled_launch(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 1.0   # not a time: variants.py's kernel timer is replaced


def main():
    names, dt = sys.argv[1].split(","), (sys.argv[2] if len(sys.argv) > 2 else "f16")
    variants.device_ms = one_profiled_launch
    gen = torch.Generator(device="cuda").manual_seed(0)
    specs = variants.flex_variants(gen)
    for name in names:
        r = variants.flex_variant(name, specs[name], gen, dt=dt)
        print(name, dt, "err", r["rel_err"], "Flex err", r["flex_rel_err"], "registers", r.get("registers"),
              "tiles", r["tiles"], "threads", r["threads"])


if __name__ == "__main__":
    main()
