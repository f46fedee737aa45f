"""``napkin bench``: time generated kernels on a GPU.

In a checkout, runs ``kernels/bench.py --quick`` (attention and matmul against torch, every
kernel checked against a float64 reference first); installed without ``kernels/``, times one
generated attention kernel (N = 1024, d = 64, 16 heads) with CUDA events.  Without a GPU there is
nothing to time: the CUDA simulator's timings mean nothing, so the command says so and exits 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "kernels" / "bench.py"


def gpu_present() -> bool:
    from .lowering.devices import driver_present, simulator_active
    return driver_present() and not simulator_active()


def run_bench(out: Path, full: bool = False) -> int:
    if not gpu_present():
        print("napkin: bench needs a CUDA GPU: no driver or device found (or NUMBA_ENABLE_CUDASIM=1); "
              "kernels run only in the CUDA simulator here, whose timings mean nothing", file=sys.stderr)
        return 2
    if BENCH.is_file():
        cmd = [sys.executable, str(BENCH), "--out", str(out)] + ([] if full else ["--quick"])
        print("running " + " ".join(cmd), flush=True)
        return subprocess.run(cmd, env={**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}).returncode
    return _small_timing()


def _small_timing() -> int:
    import numpy as np

    import napkin_cat as nc
    from .lowering.runtime import import_cuda

    cuda = import_cuda()
    q, x, d, h = nc.axes("q x d h")
    n, dn, heads = 1024, 64, 16
    flash = nc.library.attention(q=q, x=x, d=d, heads=h).stream(x, 64).tile(q, 128)
    kernel = nc.lower(flash.bind({q: n, x: n, d: dn, h: heads}))
    rng = np.random.default_rng(0)
    args = [cuda.to_device(rng.standard_normal((heads, n, dn)).astype(np.float32)) for _ in range(3)]
    run = kernel.prepare(*args)
    run()
    cuda.synchronize()
    start, end = cuda.event(), cuda.event()
    reps = 20
    start.record()
    for _ in range(reps):
        run()
    end.record()
    end.synchronize()
    ms = cuda.event_elapsed_time(start, end) / reps
    flops = 4 * heads * n * n * dn
    print(f"attention h={heads} N={n} d={dn} fp32: {ms:.3f} ms per launch, {flops / ms / 1e9:.1f} TFLOP/s "
          f"({kernel.launch})")
    return 0
