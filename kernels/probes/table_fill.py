"""Probe: making the block table of a document mask, entry by entry (``block_table``'s evaluation)
against bounds over blocks (``ops/derived_tables.interval_table``), on NumPy, torch CPU and (where
there is one) a GPU, there also the entries through ``torch.compile`` and the generated table kernel
(``lowering/table_kernel.py``: one launch; also its GPU time alone, by CUDA events over 200
back-to-back launches); the tables compared.  Median of 5 after one warm-up; milliseconds.

    python3 kernels/probes/table_fill.py [--n 4096] [--rows 128] [--cols 64]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.ops.block_table import _namespace, _table  # noqa: E402
from napkin_cat.ops.derived_tables import interval_table  # noqa: E402


def timed(f, sync=lambda: None) -> float:
    f()
    sync()
    out = []
    for _ in range(5):
        t = time.perf_counter()
        f()
        sync()
        out.append((time.perf_counter() - t) * 1e3)
    return float(np.median(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--cols", type=int, default=64)
    a = ap.parse_args()
    n = a.n
    doc = nc.aux("doc", nc.Axis("n", n))
    m = nc.mask_mod(lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i))
    ids = np.cumsum(np.random.default_rng(0).random(n) < 0.003).astype(np.float32)
    places = [("numpy", ids, lambda: None)]
    try:
        import torch
        places.append(("torch cpu", torch.tensor(ids), lambda: None))
        if torch.cuda.is_available():
            places.append(("torch cuda", torch.tensor(ids, device="cuda"), torch.cuda.synchronize))
    except ImportError:
        pass
    print(f"| data | entries ms | bounds ms | same table |  (N = {n}, blocks {a.rows} x {a.cols})")
    print("|---|---|---|---|")
    for name, arr, sync in places:
        xp, like = _namespace({"doc": arr})
        args = (m.expr, n, n, a.rows, a.cols, {"doc": arr}, xp, like)
        same = bool((np.asarray(_table(*args).cpu() if like is not None else _table(*args))
                     == np.asarray(interval_table(*args).cpu() if like is not None else interval_table(*args))).all())
        print(f"| {name} | {timed(lambda: _table(*args), sync):.2f} | {timed(lambda: interval_table(*args), sync):.2f} | {same} |")
        if name == "torch cuda":   # the entries through torch.compile (one fused kernel, if it fuses)
            import torch
            fn = torch.compile(lambda v: _table(m.expr, n, n, a.rows, a.cols, {"doc": v}, xp, like), dynamic=False)
            t0 = time.perf_counter()
            got = fn(arr)
            sync()
            first = (time.perf_counter() - t0) * 1e3
            ok = bool((got.cpu() == _table(*args).cpu()).all())
            print(f"| {name}, torch.compile (first call {first:.0f} ms) | {timed(lambda: fn(arr), sync):.3f} | | {ok} |")
            from napkin_cat.ops.derived_tables import DerivedTable
            from napkin_cat.lowering.table_kernel import table_kernel
            spec = DerivedTable("t", m.expr, n, n, a.rows, a.cols, (), (("doc", 0),), (), (), "f16")
            t0 = time.perf_counter()
            k = table_kernel(spec, (arr,))
            got = k.torch([arr])
            sync()
            first = (time.perf_counter() - t0) * 1e3
            ok = bool((got.float().cpu() == _table(*args).cpu()).all())
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
            for _ in range(200):
                k.torch([arr])
            ev[1].record()
            sync()
            per = ev[0].elapsed_time(ev[1]) / 200
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from bench import device_ms
            gpu = device_ms(lambda: k.torch([arr]))
            print(f"| {name}, the generated table kernel (first call {first:.0f} ms; back to back "
                  f"{per:.4f} ms per table; its kernel alone {gpu:.4f} ms by CUPTI) | "
                  f"{timed(lambda: k.torch([arr]), sync):.3f} | | {ok} |")


if __name__ == "__main__":
    main()
