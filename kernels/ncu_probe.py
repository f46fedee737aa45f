"""Launch two generated kernels once each, for Nsight Compute to count their DRAM bytes.

    ncu --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
        -k regex:napkin python3 kernels/ncu_probe.py

Prints the cost model's predicted HBM bytes for the same kernels (kernels/BENCHMARKS.md
compares the two).
"""
import os
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402

q, x, d, h, b = nc.axes("q x d h b")
a, k, c = nc.axes("a k c")
cases = [
    ("napkin_attention", nc.library.attention(q=q, x=x, d=d, heads=h, batch=b).bind({q: 4096, x: 4096, d: 64, h: 8, b: 2}),
     {"q": 128, "x": 64}, False),
    ("napkin_causal", nc.library.attention(q=q, x=x, d=d, heads=h, batch=b, causal=True)
     .bind({q: 4096, x: 4096, d: 64, h: 8, b: 2}), {"q": 128, "x": 64}, False),
    ("napkin_matmul", nc.library.matmul(a=a, b=k, c=c).bind({a: 4096, k: 4096, c: 4096}),
     {"a": 128, "c": 128, "k": 8}, True),
]
for name, dia, tiles, pf in cases:
    kernel = nc.lower(dia, tiles=tiles, name=name, prefetch=pf)
    args = [torch.randn(*[ax.size for ax in arr.axes], device="cuda") for arr in dia.dom]
    kernel(*args)
    torch.cuda.synchronize()
    print(name, "predicted HBM bytes", float(nc.cost(kernel.diagram).transfers["HBM"]) * 4, flush=True)
