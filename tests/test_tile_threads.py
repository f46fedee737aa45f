"""Threads for blocks the user gave (:mod:`napkin_cat.lowering.tile_threads`): planned for a GPU, the
d = 128 warpgroup forward takes 384 threads (three warpgroups of 64 rows); given 128-row tiles
those split no block into tensor-core fragments, and its contractions fell to CUDA cores (19.9 ms
on an H200).  Now the warpgroup multiples are tried and the kernel's notes say which was taken;
threads the user gives are kept.  Source generation only: no GPU, no simulator run."""
from __future__ import annotations

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat import lowering  # noqa: E402

q, x, d, h = nc.axes("q x d h")


@pytest.fixture
def for_a_gpu(monkeypatch):
    monkeypatch.setattr(lowering, "_gpu_present", lambda runtime: True)


def _forward():
    att = nc.library.attention(q=q, x=x, d=d, heads=h, dtype=nc.f16)
    return att.stream(x, "s_x").tile(q, "g_q").tile(h, 1).bind({q: 4096, x: 4096, d: 128, h: 4})


def _on_cuda_cores(kernel) -> bool:
    return any("on CUDA cores" in n for n in kernel.notes)


def test_given_rows_the_default_threads_cannot_split_get_threads_that_can(for_a_gpu):
    default = nc.lower(_forward(), verify=False, prefetch="auto")
    assert default.options["threads"] == 384 and not _on_cuda_cores(default)
    given = nc.lower(_forward(), tiles={"g_q": 128}, verify=False, prefetch="auto")
    assert given.options["threads"] == 256 and not _on_cuda_cores(given), given.notes
    assert any(n.startswith("Threads: 256, not the 384") for n in given.notes), given.notes
    assert "Threads: 256, not the 384" in given.source   # in the kernel's docstring too


def test_threads_the_user_gives_are_kept(for_a_gpu):
    kept = nc.lower(_forward(), tiles={"g_q": 128}, threads=384, verify=False, prefetch="auto")
    assert kept.options["threads"] == 384 and _on_cuda_cores(kept)
    assert not any(n.startswith("Threads:") for n in kept.notes)
