"""kernels/bench_networks.py (the whole-network benchmark) runs its --tiny --check-only path on
the CPU: each case lowered (the block cut into several kernels), run in numba's CUDA simulator
and checked against float64 torch, whose network is itself checked against the NumPy oracle;
its --plan path plans the architectures as for an H100."""

from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


def _bench():
    path = pathlib.Path(__file__).resolve().parents[1] / "kernels" / "bench_networks.py"
    spec = importlib.util.spec_from_file_location("bench_networks", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _check_tiny(cases: str, tmp_path, capsys) -> list[dict]:
    bench = _bench()
    res = bench.main(["--tiny", "--check-only", "--cases", cases, "--out", str(tmp_path)])
    rows = res["cases"]
    assert [r["case"] for r in rows] == cases.split(","), rows
    for r in rows:
        assert "error" not in r and "refused" not in r, r
        assert r["ok"] and r["rel_err"] < bench.TOL[r["dtype"]], r
        assert r["oracle_rel_err"] < bench.TOL[r["dtype"]], r
        assert r["reference_vs_oracle"] < 1e-10, r      # the torch reference is the diagram's meaning
        assert "ours_ms" not in r                        # --check-only: nothing timed
    assert (tmp_path / "networks_tiny.json").exists()
    assert "| case | dtype | kernels |" in capsys.readouterr().out
    return rows


def test_bench_networks_checks_the_convolution_on_the_cpu(tmp_path, capsys):
    _check_tiny("conv_f32", tmp_path, capsys)


@pytest.mark.slow
def test_bench_networks_checks_every_default_case_on_the_cpu(tmp_path, capsys):
    rows = _check_tiny(_bench().DEFAULT, tmp_path, capsys)
    block = next(r for r in rows if r["case"] == "block_f32")
    assert block["kernels"] > 1, block   # cut into kernels, as at the real size


@pytest.mark.parametrize("case, cut", [("resnet_f32", True), ("unet_f32", True), ("vit_f32", False)])
def test_bench_networks_checks_the_architectures_on_the_cpu(case, cut, tmp_path, capsys):
    """The residual block and the U-Net cut into kernels at toy sizes, as at their real ones; the
    ViT is one kernel (at toy sizes its cut search runs out under a small limit, see the bench's
    docstring)."""
    (row,) = _check_tiny(case, tmp_path, capsys)
    assert (row["kernels"] > 1) == cut, row["launches"]


@pytest.mark.slow
def test_bench_networks_plans_the_architectures_for_an_h100(tmp_path):
    """The residual block, the U-Net and the ViT-S/16 plan within an H100's shared memory, each
    cut into several kernels (the ViT's 59 equations within the search's per-equation budget)."""
    bench = _bench()
    rows = bench.main(["--plan", "--cases", "resnet_f32,unet_f32,vit_f32", "--out", str(tmp_path)])["cases"]
    for r in rows:
        assert "refused" not in r and r["kernels"] > 1, r
        assert all(launch["smem_bytes"] <= 232448 for launch in r["launches"]), r["launches"]
