"""The numba.cuda runtime of generated kernels (napkin_cat.lowering.runtime).

Runs under numba's CUDA simulator on machines without a GPU.  The simulator is chosen when
numba.cuda is first imported in the process, so it is requested here before anything imports
numba; ``setdefault`` leaves an explicit ``NUMBA_ENABLE_CUDASIM=0`` alone, which is how the
same tests run on a GPU (``NUMBA_ENABLE_CUDASIM=0 pytest tests/test_cuda_runtime.py``), the
``gpu``-marked ones included.  If another module imported numba.cuda without the simulator
first, the launch tests run on the GPU when there is one and skip, saying so, when not.
Shapes are tiny: the simulator runs one Python thread per CUDA thread.
"""

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import copy  # noqa: E402
import linecache  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from napkin_cat.core.errors import LoweringError  # noqa: E402
from napkin_cat.lowering import runtime as rt  # noqa: E402
from napkin_cat.lowering.typecheck import typecheck_kernel  # noqa: E402

# What the code generator emits: two static shared arrays, each on its own line (on one line
# the simulator would alias them), one dynamic buffer carved into two disjoint views (all
# dynamic arrays alias), a loop with barriers, and math.  dtypes are numba types: the
# simulator cannot size a *dynamic* array from the class np.float32.
BLOCK = 8
SMOKE_SOURCE = f'''from numba import cuda
from numba import float32
import math


@cuda.jit
def smoke(x, y, out, n_steps):
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    g = cuda.blockIdx.x * nt + tid
    sa = cuda.shared.array({BLOCK}, dtype=float32)
    sb = cuda.shared.array({BLOCK}, dtype=float32)
    dyn = cuda.shared.array(0, dtype=float32)
    acc = dyn[0:nt]
    root = dyn[nt:2 * nt]
    sa[tid] = x[g]
    sb[tid] = y[g]
    acc[tid] = 0.0
    root[tid] = math.sqrt(abs(x[g]))
    cuda.syncthreads()
    for step in range(n_steps):
        v = sa[(tid + 1) % nt]
        cuda.syncthreads()
        sa[tid] = v
        acc[tid] += v * sb[tid]
        cuda.syncthreads()
    out[g] = acc[tid] + root[(tid + 1) % nt]
'''
SMOKE_SIGNATURE = "void(float32[::1], float32[::1], float32[::1], int64)"
SMOKE_DYN_BYTES = 2 * BLOCK * 4


def smoke_reference(x, y, n_steps):
    xb, yb = x.reshape(-1, BLOCK), y.reshape(-1, BLOCK)
    rotated = sum(np.roll(xb, -s, axis=1) for s in range(1, n_steps + 1))
    return (rotated * yb + np.roll(np.sqrt(np.abs(xb)), -1, axis=1)).ravel()


def smoke_inputs(blocks=2):
    n = blocks * BLOCK
    x = (np.arange(n, dtype=np.float32) - 5) * 0.5
    y = np.linspace(1, 2, n).astype(np.float32)
    return x, y


@pytest.fixture
def cuda_mode():
    """'simulator' or 'gpu'; skips when numba.cuda is the hardware one and there is no GPU."""
    if rt.simulator_active():
        return "simulator"
    if rt.gpu_available():
        return "gpu"
    pytest.skip("numba.cuda was first imported without NUMBA_ENABLE_CUDASIM=1 in this process "
                "and no GPU is visible, so kernels can run neither simulated nor on hardware")


@pytest.fixture
def gpu():
    if not rt.gpu_available():
        pytest.skip("needs a real CUDA GPU with the simulator off (NUMBA_ENABLE_CUDASIM=0)")


def test_ensure_numpy_compat_restores_row_stack_idempotently(monkeypatch):
    monkeypatch.delattr(np, "row_stack", raising=False)  # what numpy >= 2.5 looks like
    rt.ensure_numpy_compat()
    rt.ensure_numpy_compat()
    assert np.row_stack is np.vstack


def test_simulator_choice_is_fixed_once_numba_cuda_is_imported(monkeypatch):
    rt.import_cuda()
    before = rt.simulator_active()
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "0" if before else "1")
    assert rt.simulator_active() == before
    assert not (before and rt.gpu_available())


def test_smoke_kernel_shared_dynamic_and_barriers_match_numpy(cuda_mode):
    kernel = rt.compile_kernel(SMOKE_SOURCE, "smoke", SMOKE_DYN_BYTES)
    x, y = smoke_inputs()
    out = np.zeros_like(x)
    launch = rt.Launcher(kernel, 2, BLOCK)
    assert launch.dynamic_smem_bytes == SMOKE_DYN_BYTES  # taken from compile_kernel
    launch(rt.as_device_array(x), rt.as_device_array(y), rt.as_device_array(out), 3)
    np.testing.assert_allclose(out, smoke_reference(x, y, 3), rtol=1e-5)


def test_torch_cpu_tensors_go_through_as_device_array(cuda_mode):
    torch = pytest.importorskip("torch")
    kernel = rt.compile_kernel(SMOKE_SOURCE, "smoke", SMOKE_DYN_BYTES)
    x, y = smoke_inputs(blocks=1)
    xt, yt, out = torch.from_numpy(x.copy()), torch.from_numpy(y.copy()), torch.zeros(BLOCK)
    rt.Launcher(kernel, 1, BLOCK)(*(rt.as_device_array(t) for t in (xt, yt, out)), 2)
    np.testing.assert_allclose(out.numpy(), smoke_reference(x, y, 2), rtol=1e-5)


def test_launchers_of_one_kernel_keep_their_own_configuration(cuda_mode):
    source = ("from numba import cuda\n\n\n@cuda.jit\ndef count(out):\n"
              "    out[cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x] += 1\n")
    kernel = rt.compile_kernel(source, "count")
    one, two = rt.Launcher(kernel, 1, 2), rt.Launcher(kernel, 2, 2)
    out = np.zeros(4, np.int64)
    two(rt.as_device_array(out))
    one(rt.as_device_array(out))
    assert out.tolist() == [2, 2, 1, 1]


def test_generated_source_lines_show_in_tracebacks(cuda_mode):
    kernel = rt.compile_kernel(SMOKE_SOURCE, "smoke", SMOKE_DYN_BYTES)
    lines = SMOKE_SOURCE.splitlines()
    assert linecache.getline(kernel.napkin_filename, 11).rstrip() == lines[10]
    if cuda_mode != "simulator":
        return  # an out-of-bounds index is undefined behaviour on hardware, not an exception
    source = ("from numba import cuda\n\n\n@cuda.jit\ndef oob(out):\n"
              "    out[cuda.threadIdx.x + 100] = 1.0\n")
    with pytest.raises(IndexError) as info:
        rt.Launcher(rt.compile_kernel(source, "oob"), 1, 1)(np.zeros(1))
    text = "".join(traceback.format_exception(info.value))
    assert "out[cuda.threadIdx.x + 100] = 1.0" in text and "<napkin-kernel oob" in text


def test_compile_kernel_reports_bad_source_by_name():
    with pytest.raises(LoweringError, match=r"no cuda.jit kernel 'missing'.*\['smoke'\]"):
        rt.compile_kernel(SMOKE_SOURCE, "missing")
    with pytest.raises(LoweringError, match="does not parse: line 2"):
        rt.compile_kernel("from numba import cuda\ndef broken(:\n", "broken")


def test_compile_kernel_memoises_by_source_name_and_shared_bytes():
    first = rt.compile_kernel(SMOKE_SOURCE, "smoke", SMOKE_DYN_BYTES)
    assert rt.compile_kernel(SMOKE_SOURCE, "smoke", SMOKE_DYN_BYTES) is first
    assert rt.compile_kernel(SMOKE_SOURCE, "smoke", SMOKE_DYN_BYTES, cache=False) is not first


def test_launcher_and_opt_in_refuse_what_no_block_can_have():
    kernel = rt.compile_kernel(SMOKE_SOURCE, "smoke", SMOKE_DYN_BYTES)
    limit = rt.device_limits().max_shared_per_block_optin
    with pytest.raises(LoweringError, match="dynamic shared memory"):
        rt.Launcher(kernel, 1, BLOCK, dynamic_smem_bytes=limit + 1)
    with pytest.raises(LoweringError, match="threads"):
        rt.Launcher(kernel, 1, (64, 32))
    with pytest.raises(LoweringError, match="grid"):
        rt.Launcher(kernel, 0, BLOCK)
    if not rt.gpu_available():
        assert rt.set_max_dynamic_shared(kernel, SMOKE_SIGNATURE, 100_000) == 100_000
        with pytest.raises(LoweringError):
            rt.set_max_dynamic_shared(kernel, SMOKE_SIGNATURE, limit + 1)


def test_device_limits_without_gpu_are_h100_defaults():
    if rt.gpu_available():
        limits = rt.device_limits()
        assert limits.from_device and limits.sm_count > 0
        assert limits.max_shared_per_block_optin >= limits.max_shared_per_block
    else:
        assert rt.device_limits() == rt.H100_DEFAULTS


def test_h100_defaults_come_from_the_hardware_profile():
    """The H100's numbers are written once, in napkin_cat.core.hardware."""
    from napkin_cat.core.hardware import H100, KB

    lim = rt.H100_DEFAULTS
    assert lim == rt.limits_of(H100) and not lim.from_device
    assert (lim.sm_count, lim.compute_capability, lim.l2_bytes) == (H100.sms, (9, 0), H100.l2_bytes)
    assert (lim.max_shared_per_block, lim.max_shared_per_block_optin, lim.max_shared_per_sm) == (
        48 * KB, 227 * KB, 228 * KB)
    assert (lim.max_threads_per_sm, lim.max_registers_per_sm, lim.max_registers_per_block) == (2048, 65536, 65536)
    assert rt.DEFAULT_SHARED_PER_BLOCK == H100.smem_per_block_static


def _skip_without_nvvm(err: LoweringError):
    text = str(err)
    if "TypingError" not in text and ("NVVM" in text or "nvvm" in text or "libdevice" in text):
        pytest.skip(f"numba-cuda cannot find libNVVM here: {text.splitlines()[0]}")


@pytest.mark.slow
def test_typecheck_kernel_catches_what_the_simulator_would_not():
    # the simulator would run this (Python ints go anywhere); numba's typing refuses it
    wrong = "void(float32[::1], float32[::1], int32, int64)"
    with pytest.raises(LoweringError) as info:
        typecheck_kernel(SMOKE_SOURCE, "smoke", wrong)
    _skip_without_nvvm(info.value)
    assert "TypingError" in str(info.value) and "setitem" in str(info.value)


@pytest.mark.slow
def test_numpy_shim_lets_numba_compile_without_row_stack():
    # numpy 2.5 has no row_stack; numba-cuda 0.30.4 then fails at its first compilation
    script = ("import numpy\n"
              "if hasattr(numpy, 'row_stack'):\n    del numpy.row_stack\n"
              "from napkin_cat.lowering import runtime as rt\n"
              "from tests_source import SOURCE, SIGNATURE\n"
              "from napkin_cat.lowering.typecheck import typecheck_kernel\n"
              "ir = typecheck_kernel(SOURCE, 'smoke', SIGNATURE)\n"
              "print('compiled', numpy.row_stack is numpy.vstack, len(ir) > 0)\n")
    root = Path(rt.__file__).resolve().parents[2]
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-c",
                           f"import sys, types\nm = types.ModuleType('tests_source')\n"
                           f"m.SOURCE = {SMOKE_SOURCE!r}\nm.SIGNATURE = {SMOKE_SIGNATURE!r}\n"
                           f"sys.modules['tests_source'] = m\n" + script],
                          capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode and ("NVVM" in proc.stderr or "libdevice" in proc.stderr):
        pytest.skip("numba-cuda cannot find libNVVM here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("compiled True True")


# ---- real GPU only -------------------------------------------------------------------------

LARGE_SMEM_SOURCE = '''from numba import cuda
from numba import float32


@cuda.jit
def fill_and_sum(out, n):
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    buf = cuda.shared.array(0, dtype=float32)
    for i in range(tid, n, nt):
        buf[i] = float32(i % 7)
    cuda.syncthreads()
    s = float32(0.0)
    for i in range(tid, n, nt):
        s += buf[(i + 1) % n]
    out[tid] = s
'''


@pytest.mark.gpu
def test_dynamic_shared_memory_above_48kb_runs_after_opt_in(gpu):
    nbytes = 200 * 1024
    n, threads = nbytes // 4, 128
    expected = np.array([sum(((i + 1) % n) % 7 for i in range(t, n, threads))
                         for t in range(threads)], np.float32)
    plain = rt.compile_kernel(LARGE_SMEM_SOURCE, "fill_and_sum", cache=False)
    with pytest.raises(Exception):  # without the attribute the driver refuses the launch
        plain[1, threads, 0, nbytes](np.zeros(threads, np.float32), n)
        rt.import_cuda().synchronize()
    kernel = rt.compile_kernel(LARGE_SMEM_SOURCE, "fill_and_sum", nbytes, cache=False)
    out = np.zeros(threads, np.float32)
    rt.Launcher(kernel, 1, threads)(rt.as_device_array(out), n)
    np.testing.assert_array_equal(out, expected)
    assert rt.set_max_dynamic_shared(kernel, "void(float32[::1], int64)", nbytes) == nbytes


@pytest.mark.gpu
def test_torch_cuda_tensors_are_zero_copy_and_cached(gpu):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    rt.clear_array_cache()
    x, y = smoke_inputs()
    xt, yt = torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()
    out = torch.zeros(x.size, device="cuda")
    assert rt.as_device_array(out) is rt.as_device_array(out)
    kernel = rt.compile_kernel(SMOKE_SOURCE, "smoke", SMOKE_DYN_BYTES)
    rt.Launcher(kernel, 2, BLOCK)(*(rt.as_device_array(t) for t in (xt, yt, out)), 3)
    torch.cuda.synchronize()
    np.testing.assert_allclose(out.cpu().numpy(), smoke_reference(x, y, 3), rtol=1e-5)


@pytest.mark.gpu
def test_noncontiguous_numpy_results_are_copied_back(gpu):
    source = ("from numba import cuda\n\n\n@cuda.jit\ndef twice(a):\n"
              "    i = cuda.threadIdx.x\n    a[i] = 2 * a[i]\n")
    base = np.arange(8, dtype=np.float32)
    view = base[::2]
    rt.Launcher(rt.compile_kernel(source, "twice"), 1, 4)(rt.as_device_array(view))
    assert base.tolist() == [0, 1, 4, 3, 8, 5, 12, 7]


# ---- the Kernel's call path: return types and the packed launch ----------------------------

@pytest.fixture(scope="module")
def small_kernel():
    import napkin_cat as nc
    q, x, d = nc.axes("q x d")
    flash = nc.library.attention(q=q, x=x, d=d).stream(x, 3).tile(q, 4)
    return nc.lower(flash.bind({q: 5, x: 7, d: 4}), threads=16, verify=False)


def _reference(kernel, *xs):
    import napkin_cat as nc
    return np.asarray(nc.evaluate(kernel.diagram, *(np.asarray(x, np.float64) for x in xs)))


def _qkv_for(kernel, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in kernel.in_shapes]


def test_kernel_returns_the_type_it_was_given_at_every_call(small_kernel, cuda_mode):
    torch = pytest.importorskip("torch")
    xs = _qkv_for(small_kernel)
    want = _reference(small_kernel, *xs)
    for _ in range(2):   # the first call compiles and builds caches; the second uses them
        got = small_kernel(*xs)
        assert type(got) is np.ndarray
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    ts = [torch.from_numpy(x.copy()) for x in xs]
    for _ in range(2):
        got = small_kernel(*ts)
        assert type(got) is torch.Tensor and got.device == ts[0].device and got.dtype == torch.float32
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)
    mixed = small_kernel(xs[0], ts[1], xs[2])   # any torch input makes the output torch
    assert type(mixed) is torch.Tensor
    out = torch.empty(small_kernel.out_shapes[0])
    for _ in range(2):
        assert small_kernel(*ts, out=out) is out
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-5)
    cuda = rt.import_cuda()
    devs = [cuda.to_device(x) for x in xs]
    for _ in range(2):   # numba device arrays in, a device array out (the simulator's own there)
        got = small_kernel(*devs)
        assert getattr(got, "__cuda_ndarray__", False)
        np.testing.assert_allclose(got.copy_to_host(), want, rtol=1e-4, atol=1e-5)


class _FakeDriver:
    """Stands in for cuLaunchKernel: records each launch, with the parameters read back through
    the pointer array the driver would receive."""

    def __init__(self, packed_values=None, result=0):
        self.calls, self.result = [], result

    def __call__(self, func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        import ctypes
        n = self.n_params
        pointers = (ctypes.c_void_p * n).from_address(params)
        values = [ctypes.c_int64.from_address(p).value for p in pointers]
        self.calls.append(dict(func=func, grid=(gx, gy, gz), block=(bx, by, bz), smem=smem,
                               stream=stream, values=values, extra=extra))
        return (self.result,)


def _packed(layouts, result=0):
    fake = _FakeDriver(result=result)
    fake.n_params = sum(5 + 2 * len(shape) for _, _, shape, _ in layouts)
    return rt.PackedLaunch("FUNC", (3, 1, 1), (64, 1, 1), 1024, layouts, fake), fake


def test_packed_launch_passes_numbas_array_parameters_and_only_pointers_change():
    packed, fake = _packed([(20, 4, (20,), (4,)), (6, 4, (2, 3), (12, 4))])
    assert packed([0x1000, 0x2000], stream=7)
    assert packed([0x3000, 0x4000])
    first, second = fake.calls
    # meminfo, parent, nitems, itemsize, data, shape..., strides... (numba's ABI for an array)
    assert first["values"] == [0, 0, 20, 4, 0x1000, 20, 4, 0, 0, 6, 4, 0x2000, 2, 3, 12, 4]
    assert second["values"] == [0, 0, 20, 4, 0x3000, 20, 4, 0, 0, 6, 4, 0x4000, 2, 3, 12, 4]
    assert (first["func"], first["grid"], first["block"], first["smem"], first["stream"], first["extra"]) == (
        "FUNC", (3, 1, 1), (64, 1, 1), 1024, 7, 0)
    assert second["stream"] == 0
    refused, _ = _packed([(4, 4, (4,), (4,))], result=1)
    assert refused([0x1000]) is False   # the caller then launches through numba


def test_packed_launch_is_not_used_in_the_simulator(cuda_mode):
    if cuda_mode != "simulator":
        pytest.skip("simulator only")
    kernel = rt.compile_kernel(SMOKE_SOURCE, "smoke", SMOKE_DYN_BYTES)
    x, y = smoke_inputs()
    assert rt.Launcher(kernel, 2, BLOCK).pack((x, y, np.zeros_like(x))) is None


def _fast_path(kernel, result=0):
    """The torch fast path of ``kernel`` with a recording driver, on CPU tensors (device -1)."""
    torch = pytest.importorskip("torch")
    from napkin_cat.lowering import _TorchFastPath
    layouts = [(int(np.prod(s)), 4, (int(np.prod(s)),), (4,)) for s in kernel.in_shapes + kernel.out_shapes]
    packed, fake = _packed(layouts, result=result)
    return _TorchFastPath(packed, kernel.in_shapes, kernel.out_shapes, torch.device("cpu"), torch,
                          kernel.dispatcher), fake


def test_torch_fast_path_launches_on_the_tensors_it_checked(small_kernel):
    torch = pytest.importorskip("torch")
    fast, fake = _fast_path(small_kernel)
    fast.raw_stream = lambda index: 0
    ts = [torch.from_numpy(x) for x in _qkv_for(small_kernel)]
    got = fast(ts, None)
    assert type(got) is torch.Tensor and tuple(got.shape) == small_kernel.out_shapes[0]
    data = [v for i, v in enumerate(fake.calls[0]["values"]) if i % 7 == 4]
    assert data == [t.data_ptr() for t in ts] + [got.data_ptr()]
    out = torch.empty(small_kernel.out_shapes[0])
    assert fast(ts, out) is out and fake.calls[1]["values"][-3] == out.data_ptr()


def test_torch_fast_path_converts_ids_and_other_kernel_dtypes(small_kernel):
    """An input of int64 / int32 (ids a mask compares) or of another kernel dtype is converted to
    the kernel's, as the general path does, and launched: the launch reads the converted copy."""
    torch = pytest.importorskip("torch")
    fast, fake = _fast_path(small_kernel)
    fast.raw_stream = lambda index: 0
    Q, K, V = (torch.from_numpy(x) for x in _qkv_for(small_kernel))
    for other in (K.half(), K.to(torch.int64), K.to(torch.int32)):
        assert fast([Q, other, V], None) is not None
        pointer = [v for i, v in enumerate(fake.calls[-1]["values"]) if i % 7 == 4][1]
        assert pointer not in (other.data_ptr(), K.data_ptr())   # a float32 copy, not the tensor given
    assert len(fake.calls) == 3


def test_torch_fast_path_zero_fills_the_outputs_blocks_add_into(small_kernel):
    """A kernel whose blocks add partial sums into an output (fp32 atomics: the one-kernel
    backward's dQ) is packed too: the fast path hands the launch a zeroed output, allocated or
    given (``out=``), instead of numba's per-call fill kernel on the general path."""
    torch = pytest.importorskip("torch")
    from napkin_cat.lowering import _TorchFastPath
    plain, _ = _fast_path(small_kernel)
    n_in = len(small_kernel.in_shapes)
    fast = _TorchFastPath(plain.packed, small_kernel.in_shapes, small_kernel.out_shapes, torch.device("cpu"),
                          torch, small_kernel.dispatcher, zero_args=(n_in,))
    fast.raw_stream = plain.raw_stream = lambda index: 0
    ts = [torch.from_numpy(x) for x in _qkv_for(small_kernel)]
    assert bool((fast(ts, None) == 0).all())                  # the fake driver writes nothing
    out = torch.full(small_kernel.out_shapes[0], 7.0)
    assert fast(ts, out) is out and bool((out == 0).all())
    out = torch.full(small_kernel.out_shapes[0], 7.0)
    assert plain(ts, out) is out and bool((out == 7).all())    # no zero_args: left as given


def test_torch_fast_path_allocates_padded_rows_and_hands_back_the_view(small_kernel):
    """An output whose rows the kernel pads (a staged dQ, lowering/staged_add.py) is allocated
    padded, zero-filled where blocks add into it; the launch gets the padded array's address, the
    caller the view without the padding; ``out=`` for it goes to the general path (which copies)."""
    torch = pytest.importorskip("torch")
    from napkin_cat.lowering import _TorchFastPath
    plain, fake = _fast_path(small_kernel)
    n_in, shape = len(small_kernel.in_shapes), small_kernel.out_shapes[0]
    fast = _TorchFastPath(plain.packed, small_kernel.in_shapes, small_kernel.out_shapes, torch.device("cpu"),
                          torch, small_kernel.dispatcher, zero_args=(n_in,), out_pads=(4,))
    fast.raw_stream = lambda index: 0
    ts = [torch.from_numpy(x) for x in _qkv_for(small_kernel)]
    got = fast(ts, None)
    assert tuple(got.shape) == shape and got.stride()[-2] == shape[-1] + 4 and bool((got == 0).all())
    assert [v for i, v in enumerate(fake.calls[-1]["values"]) if i % 7 == 4][-1] == got.data_ptr()
    assert fast(ts, torch.empty(shape)) is None


def test_torch_fast_path_leaves_what_it_does_not_check_to_the_general_path(small_kernel):
    torch = pytest.importorskip("torch")
    fast, fake = _fast_path(small_kernel)
    fast.raw_stream = lambda index: 0
    Q, K, V = (torch.from_numpy(x) for x in _qkv_for(small_kernel))
    q_shape = small_kernel.in_shapes[0]
    declined = {
        "float64": [Q.double(), K, V],
        "strided": [torch.empty(q_shape[::-1]).T, K, V],
        "shape": [Q[:-1], K, V],
        "too few": [Q, K],
        "subclass": [torch.nn.Parameter(Q), K, V],
        "not a tensor": [Q.numpy(), K, V],
        "off the 16-byte boundary": [torch.cat([torch.zeros(1), Q.reshape(-1)])[1:].reshape(q_shape), K, V],
    }
    for why, arrays in declined.items():
        assert fast(arrays, None) is None, why
    out_shape = small_kernel.out_shapes[0]
    for why, out in {"out requires grad": torch.empty(out_shape, requires_grad=True),
                     "out float64": torch.empty(out_shape, dtype=torch.float64),
                     "out count": (torch.empty(out_shape),) * 2}.items():
        assert fast([Q, K, V], out) is None, why
    assert fake.calls == []
    refused, _ = _fast_path(small_kernel, result=1)
    refused.raw_stream = lambda index: 0
    assert refused([Q, K, V], None) is None


def test_kernel_takes_the_general_path_when_the_fast_path_declines(small_kernel, cuda_mode):
    torch = pytest.importorskip("torch")
    fast, fake = _fast_path(small_kernel)
    fast.raw_stream = lambda index: 0
    xs = _qkv_for(small_kernel, seed=1)
    saved = small_kernel._fast
    small_kernel._fast = fast
    try:
        got = small_kernel(*(torch.from_numpy(x).double() for x in xs))   # declined: float64
        assert fake.calls == [] and type(got) is torch.Tensor
        np.testing.assert_allclose(got.numpy(), _reference(small_kernel, *xs), rtol=1e-4, atol=1e-5)
        small_kernel(*(torch.from_numpy(x) for x in xs))                   # taken
        assert len(fake.calls) == 1
        with pytest.raises(Exception, match="expected shape"):
            small_kernel(torch.from_numpy(xs[0])[:-1], *(torch.from_numpy(x) for x in xs[1:]))
        mutant = copy.copy(small_kernel)   # what the planted-bug tests do: new source, new dispatcher
        mutant._dispatcher, mutant._launchers = None, {}
        mutant(*(torch.from_numpy(x) for x in xs))
        assert len(fake.calls) == 1, "a copy with a new dispatcher launched the original through the fast path"
    finally:
        small_kernel._fast = saved


@pytest.mark.gpu
def test_torch_cuda_calls_after_the_first_take_the_packed_launch(gpu, small_kernel):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    xs = _qkv_for(small_kernel, seed=2)
    want = _reference(small_kernel, *xs)
    ts = [torch.from_numpy(x).cuda() for x in xs]
    first = small_kernel(*ts)
    assert small_kernel._fast.packed, "no packed launch after a call on float32 CUDA tensors"
    for _ in range(3):
        got = small_kernel(*ts)
        assert type(got) is torch.Tensor and got.is_cuda
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(first.cpu().numpy(), want, rtol=1e-4, atol=1e-5)
    out = torch.empty(small_kernel.out_shapes[0], device="cuda")
    assert small_kernel(*ts, out=out) is out
    strided = torch.empty(small_kernel.in_shapes[0][::-1], device="cuda").T
    strided.copy_(ts[0])
    np.testing.assert_allclose(small_kernel(strided, *ts[1:]).cpu().numpy(), want, rtol=1e-4, atol=1e-5)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            got = small_kernel(*ts)
    side.synchronize()
    np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-4, atol=1e-5)
    run = small_kernel.prepare(*ts, out=out)
    out.zero_()
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    np.testing.assert_allclose(out.cpu().numpy(), want, rtol=1e-4, atol=1e-5)


def test_inputs_that_start_off_the_16_byte_boundary_are_copied_first():
    """cp.async reads 16 aligned bytes: a view such as ``t[1:]`` reaches the kernel as a copy
    that starts on the boundary, with the same values (the caller's tensor untouched)."""
    torch = pytest.importorskip("torch")
    from napkin_cat.lowering import io
    values = torch.arange(16, dtype=torch.float32)
    for kind, dt in (("f32", torch.float32), ("f16", torch.float16)):
        view = torch.cat([torch.zeros(1, dtype=dt), values.to(dt)])[1:]    # one element in
        assert view.data_ptr() % io.ALIGN
        got = io.torch_input(view, kind, torch)
        assert got.data_ptr() % io.ALIGN == 0
        assert torch.equal((got if kind == "f32" else got.view(torch.float16)).float(), values)
    aligned = torch.arange(16, dtype=torch.float32)
    assert io.torch_input(aligned, "f32", torch).data_ptr() == aligned.data_ptr()   # no copy
