"""16-bit outputs stored a fragment column pair per 32-bit word (lowering/paired_stores.global_pair).

A warp's tensor-core fragments hold each row's columns ``2t, 2t + 1`` in lane ``t``: one 16-bit
store per element filled 8 of a sector's 32 bytes (Nsight Compute on the H200's sliding-window
forward: 42% of its global sectors excessive); one word per pair fills 16.  The kernels stay right
on ragged sizes in the simulator, and an ``out=`` that does not start on a word is refused by name.
"""
import re

import numpy as np
import pytest

import napkin_cat as nc
from napkin_cat.core.errors import ShapeError
from napkin_cat.lowering import io


@pytest.mark.parametrize("dtype", [nc.f16, nc.bf16])
def test_a_16_bit_forward_stores_its_output_a_pair_per_word_and_matches_numpy(dtype):
    q, x, d = nc.axes("q x d")
    # 40 queries and keys: the last query tile and key chunk are ragged
    dia = nc.library.attention(q=q, x=x, d=d, dtype=dtype, causal=True).bind({q: 40, x: 40, d: 16})
    kernel = nc.lower(dia.stream("x", 16).tile("q", 16), threads=32, verify=False)
    assert "tensor-core fragments" in kernel.source
    assert re.search(r"st_pair16\(O, .* - U1, pack_b?f16\(O_pair\[0\], O_pair\[1\]\)\)", kernel.source)
    assert not re.search(r"^\s*O\[", kernel.source, re.M)   # no 16-bit store of one element
    nc.check_equivalent(dia, kernel, examples=3)


class _Device:
    """A device array as the kernel would write it: only its address and shape matter here."""

    def __init__(self, address, shape, dtype):
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.__cuda_array_interface__ = {"data": (address, False), "shape": shape, "typestr": self.dtype.str,
                                         "version": 3}


def test_a_16_bit_out_off_a_word_is_refused_naming_the_output_and_the_boundary():
    with pytest.raises(ShapeError, match=r"out= for O.*f16 output must start on a 4-byte boundary.*byte 2"):
        io.check_out("out= for O", _Device(4096 + 2, (4, 8), "float16"), (4, 8), "f16", "cai")
    io.check_out("out= for O", _Device(4096 + 4, (4, 8), "float16"), (4, 8), "f16", "cai")   # on a word
    io.check_out("out= for O", _Device(4096 + 4, (4, 8), "float32"), (4, 8), "f32", "cai")   # fp32: no pairs
