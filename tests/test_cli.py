"""The ``napkin`` command: the demo runs the whole pipeline end to end in a fresh process."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_runs_the_pipeline_and_draws(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}  # it must pick the simulator itself
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-m", "napkin_cat.cli", "demo", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for heading in ("1. diagrams", "3. derive FlashAttention", "4. cost", "5. lower"):
        assert heading in res.stdout
    assert "verified=True" in res.stdout and "verified=False" not in res.stdout
    assert "max rel. error vs NumPy" in res.stdout
    assert (tmp_path / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_goldens_command_reports_no_drift():
    from napkin_cat.cli import main
    assert main(["goldens"]) == 0
