"""Registers, spills and occupancy of generated kernels, without a GPU: ``ptxas -v`` on the PTX
that the GPU build would link.

    python kernels/ptx_resources.py                      # the FlashAttention kernels, fp16, H100
    python kernels/ptx_resources.py --n 4096 --d 128 --dtype bf16
    python kernels/ptx_resources.py --dtype f32 --fp32 3xtf32 --prefetch none --backward one

Each kernel is planned as for a GPU (``nc.lower`` with the GPU heuristics), compiled by numba to
LTO-IR for sm_90a, linked with ``lowering/tensorcore.cu`` (and the generated ``wgmma`` wrappers it calls) (NVRTC, LTO-IR) by nvJitLink into PTX,
and assembled by ``ptxas -v``: what a GPU build would run, short of the driver.  Printed per
kernel: registers per thread, spill bytes, shared memory (dynamic, from the plan), threads, and
the blocks per SM those allow on an H100 (65536 registers, 228 KB shared memory, 64 warps).

Needs what the GPU machine has and CI does not: ``ptxas`` (a CUDA toolkit; ``CUDA_HOME``),
``libnvrtc`` and ``libnvJitLink`` (``pip install nvidia-cuda-nvrtc nvidia-nvjitlink``; put their
``lib`` folders on ``LD_LIBRARY_PATH``).  ptxas older than nvJitLink reads its PTX once the
``.version`` line is lowered to its own (done here; the kernels use nothing newer).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

H100 = {"regs": 65536, "smem": 228 * 1024, "warps": 64, "max_regs_block": 65536}


def _module(source: str, tmp: Path):
    path = tmp / f"kernel_{abs(hash(source))}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _signature(kernel) -> str:
    """numba's signature of the kernel's arguments: 16-bit arrays travel as int16 patterns."""
    arrays = []
    for arr in (*kernel.diagram.dom, *kernel.diagram.cod):
        name = arr.dtype.name
        arrays.append("int16[::1]" if name in ("f16", "bf16") else "float32[::1]" if name == "f32"
                      else f"{ {'i32': 'int32', 'i64': 'int64'}.get(name, 'float32')}[::1]")
    return f"void({', '.join(arrays)})"


def ptxas_report(kernel, arch: str = "sm_90a") -> dict:
    """``{"registers", "spill_stores", "spill_loads", "stack"}`` of a generated kernel."""
    from napkin_cat.lowering.devices import import_cuda
    cuda = import_cuda()            # what a GPU build uses, the linear singly-assigned pass included
    from numba.cuda.cudadrv import nvrtc
    from cuda.bindings import nvjitlink as nj
    cc = (int(arch[3]), int(arch[4]), arch[5:])   # sm_90a: (9, 0, "a"), as numba-cuda builds for an H100
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        mod = _module(kernel.source, tmp)
        jit = getattr(mod, next(n for n in dir(mod) if n.startswith("kernel_")))
        opts = jit.targetoptions     # the kernel's own fastmath and launch bounds
        ltoir, _ = cuda.compile(jit.py_func, _signature(kernel), device=False, output="ltoir", cc=cc, abi="numba",
                                fastmath=opts.get("fastmath", False), launch_bounds=opts.get("launch_bounds"))
        from napkin_cat.lowering.wgmma import cu_source, setmaxnreg_source
        sources = [("tensorcore", (ROOT / "napkin_cat/lowering/tensorcore.cu").read_text())]
        sources += [(f"wgmma_n{n}", cu_source(n))   # the warpgroup MMAs of each width the kernel calls
                    for n in sorted({int(n) for n in re.findall(r"wgmma_wait_n(\d+)", kernel.source)})]
        sources += [(name, setmaxnreg_source(name))        # a copying warpgroup's register moves
                    for name in sorted(set(re.findall(r"setmaxnreg_(?:inc|dec)_\d+", kernel.source)))]
        sources += [(Path(f).stem, Path(f).read_text())    # anything else the source links (a probe's PTX)
                    for f in sorted(set(re.findall(r"link='([^']+\.cu)'", kernel.source)))]
        h = nj.create(3, [f"-arch={arch}", "-lto", "-ptx"])
        nj.add_data(h, nj.InputType.LTOIR, ltoir, len(ltoir), "kernel")
        for name, text in sources:
            tc = nvrtc.compile(text, f"{name}.cu", cc, ltoir=True)
            tc = tc[0] if isinstance(tc, tuple) else tc
            tc = bytes(tc.code) if hasattr(tc, "code") else bytes(tc)
            nj.add_data(h, nj.InputType.LTOIR, tc, len(tc), name)
        nj.complete(h)
        buf = bytearray(nj.get_linked_ptx_size(h))
        nj.get_linked_ptx(h, buf)
        ptx = re.sub(r"^\.version \d+\.\d+", ".version 9.0", bytes(buf).rstrip(b"\0").decode(), flags=re.M)
        (tmp / "k.ptx").write_text(ptx)
        out = subprocess.run(["ptxas", f"-arch={arch}", "-v", str(tmp / "k.ptx"), "-o", str(tmp / "k.cubin")],
                             capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    text = out.stderr
    regs = int(re.search(r"Used (\d+) registers", text).group(1))
    stack, stores, loads = map(int, re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                                              r"(\d+) bytes spill loads", text).groups())
    return {"registers": regs, "spill_stores": stores, "spill_loads": loads, "stack": stack}


def occupancy(regs: int, threads: int, smem: int, sm=H100) -> int:
    """Blocks per SM that registers (allocated per warp in units of 256), shared memory and
    warps allow."""
    warps = -(-threads // 32)
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = sm["regs"] // (per_warp * warps)
    by_smem = sm["smem"] // max(smem + 1024, 1)          # 1 KB per block reserved by the driver
    return min(by_regs, by_smem, sm["warps"] // warps)


def flash_kernels(n: int, dim: int, heads: int, dtype: str, options: list[dict], form: str = "two kernels"):
    """The forward (with its logsumexp) and the backward kernels of ``nc.torch_op`` of attention
    at these sizes in ``form`` (FlashAttention-2's two, or one with dQ by atomics), lowered with
    each of ``options``."""
    import torch

    import napkin_cat as nc
    import napkin_cat.lowering as lw
    from napkin_cat.lowering.torch_op import torch_op
    lw._gpu_present = lambda runtime: True           # plan as for a GPU
    q, x, d, h = nc.axes("q x d h")
    attn = nc.library.attention(q=q, x=x, d=d, heads=h).stream(x, "s_x").tile(q, "g_q").tile(h, 1)
    tdt = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[dtype]
    sizes = (("d", dim), ("h", heads), ("q", n), ("x", n))
    plan = torch_op(attn, backward=form).backward_plan((0, 1, 2), sizes, tdt)
    parts = ((("backward dK, dV", plan.parts[-2]), ("backward dQ", plan.parts[-1])) if form == "two kernels"
             else (("bwd dQ, dK, dV", plan.parts[-1]),))
    for name, dia in (("forward (O, L)", plan.forward), *parts):
        for opt in options:
            yield name, opt, nc.lower(dia, verify=False, **opt)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dtype", choices=("f16", "bf16", "f32"), default="f16")
    prefetch = {"none": False, "regs": True, "double": "double", "auto": "auto"}
    ap.add_argument("--prefetch", nargs="+", default=["none", "double"], choices=sorted(prefetch),
                    help="prefetch options to compare (auto: what nc.torch_op picks)")
    from napkin_cat.lowering.plan import FP32_ENGINES
    ap.add_argument("--fp32", choices=FP32_ENGINES, default="fma",
                    help="nc.lower(fp32=...) for --dtype f32: CUDA-core FMAs or tensor cores by 3xTF32")
    ap.add_argument("--backward", choices=("one", "two"), default="two",
                    help="the backward's form: two kernels (FlashAttention-2's) or one (dQ by fp32 atomics)")
    args = ap.parse_args()
    options = [{"prefetch": prefetch[p]} for p in args.prefetch]
    if args.dtype == "f32":
        options = [{**o, "fp32": args.fp32} for o in options]
    rows = []
    for name, opt, k in flash_kernels(args.n, args.d, args.heads, args.dtype, options,
                                         f"{args.backward} kernel{'s' if args.backward == 'two' else ''}"):
        r = ptxas_report(k)
        threads = k.launch.block[0] * k.launch.block[1] * k.launch.block[2]
        smem = k.launch.dynamic_smem_bytes
        rows.append((name, str(opt["prefetch"]), threads, r["registers"], r["spill_stores"] + r["spill_loads"],
                     smem // 1024, occupancy(r["registers"], threads, smem)))
        print(f"{name} prefetch={opt['prefetch']}: {r}", flush=True)
    print(f"\n{args.dtype}, N = {args.n}, d = {args.d}, heads = {args.heads}; sm_90a, ptxas -v; blocks per SM on an H100")
    print(f"{'kernel':<17} {'prefetch':>8} {'threads':>7} {'regs':>5} {'spill B':>7} {'smem KB':>7} {'blocks/SM':>9}")
    for r in rows:
        print(f"{r[0]:<17} {r[1]:>8} {r[2]:>7} {r[3]:>5} {r[4]:>7} {r[5]:>7} {r[6]:>9}")


if __name__ == "__main__":
    main()
