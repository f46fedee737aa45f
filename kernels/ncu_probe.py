"""Launch the benchmarked kernels once each, for Nsight Compute to count their DRAM bytes.

    ncu --csv --print-units base --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \\
        -k regex:napkin python3 kernels/ncu_probe.py [benchmarks.json] > ncu.csv
    python3 kernels/ncu_merge.py ncu.csv probe.txt benchmarks.json

The configurations are the ones ``kernels/bench.py`` chose (``"chosen"`` in its JSON) when a
JSON is given, else the defaults below.  Prints the cost model's predicted HBM bytes for the
same kernels (``kernels/ncu_merge.py`` puts both into the JSON for ``kernels/report.py``).
"""
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402

att = ({"q": 256, "x": 64}, 256, False)
mm = ({"a": 128, "c": 128, "b": 8}, 256, "double")
if len(sys.argv) > 1 and Path(sys.argv[1]).exists():
    chosen = json.loads(Path(sys.argv[1]).read_text()).get("chosen", {})
    if chosen:
        att = tuple(chosen["attention"]["64"][0])
        mm = tuple(chosen["matmul"])

q, x, d, h, b = nc.axes("q x d h b")
a, k, c = nc.axes("a b c")
cases = [
    ("napkin_attention", nc.library.attention(q=q, x=x, d=d, heads=h, batch=b).bind({q: 4096, x: 4096, d: 64, h: 8, b: 2}),
     att),
    ("napkin_causal", nc.library.attention(q=q, x=x, d=d, heads=h, batch=b, causal=True)
     .bind({q: 4096, x: 4096, d: 64, h: 8, b: 2}), att),
    ("napkin_matmul", nc.library.matmul(a=a, b=k, c=c).bind({a: 4096, k: 4096, c: 4096}), mm),
]
for name, dia, (tiles, threads, pf) in cases:
    kernel = nc.lower(dia, tiles=tiles, threads=threads, name=name, prefetch=pf, verify=False)  # profiled; bench.py checks it
    args = [torch.randn(*[ax.size for ax in arr.axes], device="cuda") for arr in dia.dom]
    kernel(*args)
    torch.cuda.synchronize()
    what = (f"{'attention N=4096 d=64 B*H=16' if 'att' in name or 'causal' in name else 'matmul 4096^3'}"
            f"{', causal' if 'causal' in name else ''}, tiles {tiles}, {threads} threads, prefetch {pf}")
    print("PROBE", json.dumps({"name": name, "predicted": float(nc.cost(kernel.diagram).transfers["HBM"]) * 4,
                               "config": what}), flush=True)
