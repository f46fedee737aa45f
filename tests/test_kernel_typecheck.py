"""numba's GPU front end types every generated kernel the simulator runs: the simulator runs
kernels as Python (an int64 index added to a uint32 offset is a float64 to numba, a Python int
to the simulator), so kernels planned for a GPU are type-checked here without one
(:func:`napkin_cat.lowering.typecheck.typecheck_kernel`, numba-cuda's typing and lowering to
LLVM IR in a subprocess).  The gallery's variants at the GPU's block sizes, fp32 and fp16."""
import pytest

import napkin_cat as nc
from napkin_cat.core.errors import LoweringError
from napkin_cat.library.variant_gallery import GALLERY, build
from napkin_cat.lowering.typecheck import typecheck_kernel

q, x, d, h, b = nc.axes("q x d h b")
N = 256
AUX = ("document",)   # the default tier (14 s): a gather from an aux tensor


def _kernel(v, dtype, monkeypatch):
    import napkin_cat.lowering as lw
    monkeypatch.setattr(lw, "_gpu_present", lambda runtime: True)   # plan as for a GPU
    dia = build(v, q, x, d, N, heads=h, batch=b, dtype=dtype).bind({q: N, x: N, d: 64, h: 4, b: 2})
    tiles, threads = ({"q": 128, "x": 64}, 256) if dtype is nc.f32 else ({"q": 128, "x": 64}, 128)
    return dia, lw._lower_one(dia, tiles=tiles, threads=threads)


def _signature(dia) -> str:
    ty = lambda a: "int16[::1]" if a.dtype.name in ("f16", "bf16") else "float32[::1]"  # noqa: E731
    return "void(" + ", ".join(ty(a) for a in (*dia.dom, *dia.cod)) + ")"


def _check(v, dtype, monkeypatch):
    dia, k = _kernel(v, dtype, monkeypatch)
    try:
        typecheck_kernel(k.source, k.name, _signature(dia))
    except LoweringError as e:
        text = str(e)
        if "TypingError" not in text and ("NVVM" in text or "nvvm" in text or "libdevice" in text):
            pytest.skip(f"numba-cuda cannot find libNVVM here: {text.splitlines()[0]}")
        raise


@pytest.mark.parametrize("v", [v for v in GALLERY if v.name in AUX], ids=lambda v: v.name)
def test_gallery_kernel_types_on_the_gpu_fp32(v, monkeypatch):
    _check(v, nc.f32, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [nc.f32, nc.f16], ids=["f32", "f16"])
@pytest.mark.parametrize("v", GALLERY, ids=lambda v: v.name)
def test_every_gallery_kernel_types_on_the_gpu(v, dtype, monkeypatch):
    _check(v, dtype, monkeypatch)
