"""Materialised intermediates read only by tensor cores live in 16-bit shared buffers.

In the FlashAttention-2 backward ``dS = P * (dP - D)`` is written to shared memory once per chunk
and read only by the ``dK`` / ``dQ`` contractions on tensor cores: it is stored as f16 / bf16
patterns (rounded once where it is written), padded like a 16-bit input buffer and read with
``ldmatrix`` (``.trans`` in the key-tile part, where its layout is [q x] and the fragments' rows
are x).  ``P`` in the key-tile part is read by the ``dV`` update and by the product ``dS = P *
(dP - D)``, itself 16-bit, so it is stored in 16 bits too and converted once for the product;
``dP`` in the query-tile part feeds a difference and stays fp32
(:mod:`napkin_cat.lowering.sixteen_bit`).

Where the only tensor-core readers of ``P`` and ``dS`` can take them from the registers that
computed them (:mod:`napkin_cat.lowering.frag_operands`, on by default: ``tests/test_frag_operands.py``)
they have no buffer at all; these tests switch that pass off to test the buffers it replaces,
which the one-kernel backward's ``dQ`` and other diagrams still use.
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import napkin_cat as nc  # noqa: E402
import napkin_cat.lowering as lowering  # noqa: E402
from napkin_cat.lowering.torch_op import torch_op  # noqa: E402
from napkin_cat.verify import kernelcheck  # noqa: E402

q, x, d, h = nc.axes("q x d h")
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}
TILES = {"g_x": 16, "s_q": 16, "g_q": 16, "s_x": 16}


@pytest.fixture(autouse=True)
def _buffers_not_registers(monkeypatch):
    from napkin_cat.lowering import planner
    monkeypatch.setattr(planner, "FRAG_OPERANDS", False)


def _parts(dtype, sizes, causal=False, heads=False):
    fl = nc.library.attention(q=q, x=x, d=d, causal=causal, **({"heads": h} if heads else {}))
    fl = fl.stream(x, "s_x").tile(q, "g_q")
    if heads:
        fl = fl.tile(h, 1)
    op = torch_op(fl, verify=False, backward="two kernels")
    rows, *parts = op.backward_plan((0, 1, 2), tuple(sorted(sizes.items())), dtype).parts
    assert [a.name for a in rows.cod] == ["D"]    # D = rowsum(dO O), read by both parts
    return parts


def _shared_line(src: str) -> str:
    return next(ln for ln in src.splitlines() if ln.startswith("Shared memory:"))


def _body(src: str) -> str:
    return src.split("@cuda.jit(fastmath")[-1]


def test_backward_parts_for_a_gpu_keep_ds_in_sixteen_bits_read_by_ldmatrix(monkeypatch):
    """Planned as for a GPU (nothing compiled) at N = 4096, d = 64: in both parts dS is a 16-bit
    buffer with rows padded for ldmatrix, written once with f2h and read only by ldmatrix; so is
    the key-tile part's P, which the dS product also reads (through one conversion)."""
    monkeypatch.setattr(lowering, "_gpu_present", lambda rt: True)
    parts = _parts(torch.float16, {"q": 4096, "x": 4096, "d": 64, "h": 32}, heads=True)
    reads, shared_lines = [], []
    for part in parts:
        src = lowering._lower_one(part).source
        shared, body = _shared_line(src), _body(src)
        shared_lines.append(shared)
        assert "dS (materialised, 16-bit, rows padded by 8)" in shared, shared
        assert "pack_f16(smem[dS_s" not in body and "smem[dS_s" not in body
        # written once, a column pair of the fragments per 32-bit word (lowering/paired_stores.py)
        writes = [ln.strip() for ln in body.splitlines() if re.match(r"\s*smem(16|32)\[\(?dS_s", ln)]
        assert len(writes) == 1 and re.fullmatch(r"smem32\[\(dS_s \* U2 \+ .*\) // U2\] = "
                                                 r"pack_f16\(dS_pair\[0\], dS_pair\[1\]\)", writes[0]), writes
        reads += [ln.split("=")[1].split("(")[0].strip() for ln in body.splitlines()
                  if "ldsm_" in ln and "dS_s" in ln]
    assert reads and set(reads) <= {"ldsm_x4", "ldsm_x4_t"}, reads   # either orientation, as laid out
    # the key-tile part's P feeds the dV update and the product dS = P * (dP - D): P is a
    # 16-bit buffer read by ldmatrix for dV, and the product reads its fp32 register copy
    # (lowering/register_copies.py); the query-tile part's dP is read only by that product, on
    # the same fragments: it has no shared buffer at all
    assert "(P (materialised, 16-bit, rows padded by 8))" in shared_lines[0], shared_lines[0]
    key_part = _body(lowering._lower_one(parts[0]).source)
    assert "pack_f16(smem[P_s" not in key_part and "ldsm_x4_t(smem16, P_s" in key_part
    assert "h2f(smem16[P_s" not in key_part and "P_r[i, j]" in key_part
    assert "dP_s" not in shared_lines[1] and "dP_r[i, j]" in _body(lowering._lower_one(parts[1]).source)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_sixteen_bit_ds_kernels_type_on_the_gpu(dtype, monkeypatch):
    """numba's GPU front end types the rounded writes (with the zero of the ragged chunk) and the
    ldmatrix reads: the causal backward planned for a GPU at N = 200 (ragged), d = 64."""
    from napkin_cat.core.errors import LoweringError
    from napkin_cat.lowering.typecheck import typecheck_kernel
    monkeypatch.setattr(lowering, "_gpu_present", lambda rt: True)
    for part in _parts(DTYPES[dtype], {"q": 200, "x": 200, "d": 64}, causal=True):
        k = lowering._lower_one(part)
        assert "else ZERO16" in _body(k.source)
        sig = "void(" + ", ".join("int16[::1]" if a.dtype.name in ("f16", "bf16") else "float32[::1]"
                                  for a in (*part.dom, *part.cod)) + ")"
        try:
            typecheck_kernel(k.source, k.name, sig)
        except LoweringError as e:
            text = str(e)
            if "TypingError" not in text and ("NVVM" in text or "nvvm" in text or "libdevice" in text):
                pytest.skip(f"numba-cuda cannot find libNVVM here: {text.splitlines()[0]}")
            raise


def test_fp32_backward_keeps_fp32_buffers(monkeypatch):
    monkeypatch.setattr(lowering, "_gpu_present", lambda rt: True)
    for part in _parts(torch.float32, {"q": 256, "x": 256, "d": 64}):
        src = lowering._lower_one(part).source
        assert "16-bit" not in _shared_line(src) and "smem16" not in src


def _residual_inputs(sizes, causal, seed=0):
    """Q, K, V, O, L, dO with O and L produced by the forward (realistic probabilities), and
    D = rowsum(dO O), by name."""
    fwd = nc.library.attention(q=q, x=x, d=d, causal=causal, logsumexp=True).bind(
        {a: sizes[a.name] for a in (q, x, d)})
    rng = np.random.default_rng(seed)
    ins = [rng.standard_normal(tuple(a.size for a in arr.axes)) for arr in fwd.dom]
    O, L = nc.evaluate(fwd, *ins)
    dO = rng.standard_normal(O.shape)
    return dict(zip(("Q", "K", "V", "O", "L", "dO", "D"), (*ins, O, L, dO, (dO * O).sum(-1))))


def _lowered_parts(dtype, sizes, causal):
    for part in _parts(DTYPES[dtype], sizes, causal):
        tiles = {k: v for k, v in TILES.items() if k in str(part.schedule)}
        yield part, nc.lower(part, tiles=tiles, threads=32, verify=False)


def _check_parts(dtype, sizes, causal):
    inputs = _residual_inputs(sizes, causal)
    for part, kernel in _lowered_parts(dtype, sizes, causal):
        assert "dS (materialised, 16-bit" in _shared_line(kernel.source)
        diff = kernelcheck.kernel_outcome(part.unrelabelled(), kernel, [inputs[a.name] for a in part.dom])
        assert diff.failure is None, diff.failure


def test_fp16_backward_parts_with_sixteen_bit_ds_match_the_oracle_on_ragged_sizes():
    """q = 20 and x = 23 in tiles and chunks of 16: the last chunk's dS rows past the extent are
    written as zero, so the ldmatrix fragments read zeros there."""
    _check_parts("f16", {"q": 20, "x": 23, "d": 16}, causal=False)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("qx", [(16, 16), (35, 21)], ids=["even", "ragged"])
def test_sixteen_bit_ds_backward_parts_match_the_oracle(dtype, causal, qx):
    _check_parts(dtype, {"q": qx[0], "x": qx[1], "d": 16}, causal)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_sixteen_bit_ds_backward_parts_pass_lowers_self_check(dtype):
    """lower(..., verify=1): its own check on normal data (the 'jumps' regime feeds a logsumexp
    the scores did not produce: dS past the 16-bit range, with or without this buffer)."""
    for part in _parts(DTYPES[dtype], {"q": 20, "x": 23, "d": 16}):
        tiles = {k: v for k, v in TILES.items() if k in str(part.schedule)}
        assert nc.lower(part, tiles=tiles, threads=32, verify=1).verified


@pytest.mark.slow
def test_fp16_mlp_hidden_layer_is_a_sixteen_bit_operand_of_the_second_contraction():
    """Not only attention: the MLP's H = gelu(X W1 + b1), read only by H W2 on tensor cores, is
    a 16-bit buffer; its rows past the ragged tile (t = 20 in tiles of 16) are written as zero."""
    t, e, f = nc.axes("t e f")
    mlp = nc.library.mlp(t=t, d=e, h=f, dtype=nc.f16).tile(t, 16)
    kernel = nc.lower(mlp.bind({t: 20, e: 16, f: 32}), threads=32, verify=1)
    assert kernel.verified
    assert "H_s[16 x 32] (H (materialised, 16-bit, rows padded by 8))" in _shared_line(kernel.source)
    body = _body(kernel.source)
    # H's column pairs stored as words, zero past the ragged rows (lowering/paired_stores.py)
    assert "pack_f16(H_pair[0], H_pair[1])" in body and " else ZERO" in body and "ldsm_x4" in body


class _Gen:
    """What Kernel() reads of a generator's result, from an existing kernel."""

    def __init__(self, kernel):
        self._k = kernel
        self.notes = kernel.notes

    def mappings(self):
        return self._k.mappings


def _planted(kernel, old: str, new: str, where: str):
    """``kernel`` with ``old`` replaced by ``new`` on the lines of its body containing ``where``."""
    head, sep, body = kernel.source.partition("@cuda.jit(fastmath")
    lines = [ln.replace(old, new) if where in ln else ln for ln in body.splitlines()]
    bad = head + sep + "\n".join(lines) + "\n"
    assert bad != kernel.source
    return type(kernel)(kernel.diagram, bad, kernel.name, kernel.launch, kernel.schedule, _Gen(kernel))


@pytest.mark.parametrize("plant", ["row_padding", "unrounded"])
def test_a_planted_sixteen_bit_buffer_bug_is_caught(plant):
    """ldmatrix reading dS with rows 8 elements shorter than they were written, or a pair of dS
    stored as an integer instead of its two 16-bit patterns: the kernel check fails."""
    sizes = {"q": 16, "x": 32, "d": 16}
    part, kernel = next(_lowered_parts("f16", sizes, causal=False))
    inputs = [_residual_inputs(sizes, causal=False)[a.name] for a in part.dom]
    oracle = part.unrelabelled()
    assert kernelcheck.kernel_outcome(oracle, kernel, inputs).failure is None
    if plant == "row_padding":
        broken = _planted(kernel, "* LD_dS_s", "* (LD_dS_s - uint32(8))", "dS_s_lane")  # ldmatrix rows
    else:
        broken = _planted(kernel, "pack_f16(dS_pair[0], dS_pair[1])", "uint32(dS_pair[0])", "smem32[")
    assert kernelcheck.kernel_outcome(oracle, broken, inputs).failure is not None
