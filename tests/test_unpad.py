"""The 16-bit copy of an fp32 output whose rows a kernel padded (``napkin_cat.lowering.unpad``:
the one-kernel backward's staged dQ after the kernel): which views it takes, and its kernel in
the simulator against torch's own conversion, bit for bit."""
from __future__ import annotations

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from napkin_cat.lowering import unpad  # noqa: E402

torch = pytest.importorskip("torch")


def test_padded_rows_finds_views_of_longer_rows_and_nothing_else():
    store = torch.zeros(2, 3, 5, 12)
    assert unpad.padded_rows(store[..., :10]) == 12
    assert unpad.padded_rows(store[:, :1, :, :10]) is None        # rows skipped, not only padding
    assert unpad.padded_rows(store) is None                       # contiguous: torch's own copy
    assert unpad.padded_rows(store[..., :9]) is None              # odd width: not in pairs
    assert unpad.padded_rows(store[..., :10].transpose(0, 1)) is None
    assert unpad.padded_rows(torch.zeros(12)[:10]) is None


@pytest.mark.filterwarnings("ignore:overflow encountered")   # past fp16's range: inf, as torch gives
@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 70), half=st.integers(1, 20), pad=st.integers(1, 9), dtype=st.sampled_from(["f16", "bf16"]),
       seed=st.integers(0, 2 ** 16))
def test_the_kernel_writes_torchs_rounding_of_the_unpadded_rows(rows, half, pad, dtype, seed):
    """Any rows, widths and paddings (blocks ragged against the rows), values across the 16-bit
    ranges and past fp16's; the padding holds NaN and is never read: bit for bit torch's."""
    from napkin_cat.lowering.runtime import compile_kernel
    width, stride = 2 * half, 2 * half + 2 * pad
    rng = np.random.default_rng(seed)
    store = (rng.standard_normal((rows, stride)) * np.exp(rng.uniform(-12, 12, (rows, stride)))).astype(np.float32)
    store[:, width:] = np.nan
    kernel = compile_kernel(unpad.source(rows, width, stride, dtype), "napkin_unpad")
    out = np.zeros(rows * half, np.int32)
    kernel[-(-out.size // unpad.THREADS), unpad.THREADS](out, store.reshape(-1))
    want = torch.from_numpy(store)[:, :width].to({"f16": torch.float16, "bf16": torch.bfloat16}[dtype])
    np.testing.assert_array_equal(out.view(np.int16).reshape(rows, width), want.view(torch.int16).numpy())


def test_to_dtype_is_torchs_conversion_off_the_gpu():
    x = torch.randn(4, 12)[:, :8]
    assert torch.equal(unpad.to_dtype(x, torch.float16), x.to(torch.float16))
