"""The ``napkin`` command: every subcommand on a small diagram without a GPU, its errors (one
line, exit 1 for a refused request, 2 for usage), a ``--help`` that imports nothing heavy, and the
demo end to end in a fresh process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import napkin_cat as nc
from napkin_cat import cli_args
from napkin_cat.cli import main
from napkin_cat.lowering.devices import driver_present, gpu_available

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("sympy", "hypothesis", "numba", "torch", "matplotlib")
COMMANDS = ("demo", "draw", "check", "cost", "lower", "bench", "goldens", "imports")


def napkin(capsys, *argv):
    """(exit status, stdout, stderr) of ``napkin argv``."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _env():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}  # it must pick the simulator itself
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_help_imports_nothing_heavy():
    code = ("import io, json, sys, contextlib\n"
            "from napkin_cat.cli import main\n"
            "codes = []\n"
            f"for argv in [['--help'], ['--version']] + [[c, '--help'] for c in {COMMANDS!r}]:\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        codes.append(main(argv))\n"
            f"print(json.dumps([codes, [m for m in {HEAVY!r} if m in sys.modules]]))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert res.returncode == 0, res.stderr
    codes, heavy = json.loads(res.stdout.splitlines()[-1])
    assert set(codes) == {0} and heavy == []


def test_import_is_light_and_lazy_names_resolve():
    code = ("import sys, napkin_cat as nc\n"
            f"print([m for m in {HEAVY!r} + ('numpy',) if m in sys.modules])\n"
            "print(all(n in dir(nc) for n in ('cost', 'lower', 'check_equivalent', 'evaluate', 'derive', 'RULES')))\n"
            "print(callable(nc.cost), 'sympy' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert res.stdout.split("\n")[:3] == ["[]", "True", "True True"], res.stdout + res.stderr


def test_version(capsys):
    code, out, _ = napkin(capsys, "--version")
    assert code == 0 and out.strip() == f"napkin {nc.__version__}"


def test_draw_writes_the_picture(capsys, tmp_path):
    path = tmp_path / "attention.svg"
    code, out, err = napkin(capsys, "draw", "attention", "--causal", "--stream", "x=s_x", "-o", str(path))
    assert code == 0, err
    assert "stream(x, s_x)" in out and path.read_text().lstrip().startswith("<?xml")


def test_check_passes_and_reports(capsys):
    code, out, err = napkin(capsys, "check", "attention", "--causal", "--stream", "x=3", "--tile", "q=g_q",
                            "--examples", "3", "--seed", "0")
    assert code == 0, err
    assert "b: Q[q d] f32, K[x d] f32, V[x d] f32 -> O[q d] f32  | stream(x, 3), tile(q, g_q)" in out
    assert "OK: equivalent on 3 examples" in out


def test_check_counterexample_exits_1_with_the_reproducer(capsys, monkeypatch):
    def differ(a, b, **kw):
        raise nc.EquivalenceError("the diagrams differ at q=1, x=2\nreproduce:\n  import napkin_cat as nc\n  ...")
    monkeypatch.setattr(nc, "check_equivalent", differ)
    code, out, err = napkin(capsys, "check", "matmul", "--tile", "a=4")
    assert code == 1
    assert "reproduce:\n  import napkin_cat as nc" in out
    assert err.count("\n") == 1 and err.startswith("napkin: error: the diagrams differ")


def test_cost_table_time_and_optimum(capsys):
    code, out, err = napkin(capsys, "cost", "attention", "--stream", "x=s_x", "--tile", "q=g_q", "--hw", "h200",
                            "--dtype", "bf16", "--sizes", "q=256,x=256,d=32", "--optimize")
    assert code == 0, err
    for text in ("per level (bf16)", "HBM", "SMEM", "FLOPs per unit", "tensor", "4*d*q*x", "optimum",
                 "predicted: H200"):
        assert text in out, text


def test_cost_without_sizes_is_symbolic(capsys):
    code, out, _ = napkin(capsys, "cost", "matmul", "--tile", "a=g_a", "--stream", "b=s_b")
    assert code == 0 and "give --sizes" in out and "g_a" in out


def test_relabels_apply_in_command_line_order(capsys):
    assert cli_args.ordered_relabels(["m", "--tile", "q=4", "--stream=x=s_x", "--tile", "a=2"],
                                     {"stream": ["x=s_x"], "tile": ["q=4", "a=2"]}) == \
        [("tile", "q", 4, None), ("stream", "x", "s_x", None), ("tile", "a", 2, None)]
    _, out, _ = napkin(capsys, "cost", "attention", "--tile", "q=g_q", "--stream", "x=s_x")
    assert "| tile(q, g_q), stream(x, s_x)" in out


def test_module_function_diagram(capsys, tmp_path):
    src = tmp_path / "mine.py"
    src.write_text("import napkin_cat as nc\n\ndef mm():\n    return nc.library.matmul()\n\ndef bad():\n    return 3\n")
    code, out, _ = napkin(capsys, "cost", f"{src}:mm", "--tile", "a=g_a")
    assert code == 0 and "A[a b] f32, B[b c] f32 -> C[a c] f32  | tile(a, g_a)" in out
    code, _, err = napkin(capsys, "cost", f"{src}:bad")
    assert code == 2 and "returned int, not a Diagram" in err


def test_lower_prints_the_launch_and_emits_the_source(capsys, tmp_path):
    path = tmp_path / "kernel.py"
    code, out, err = napkin(capsys, "lower", "attention", "--stream", "x=4", "--tile", "q=4",
                            "--sizes", "q=5,x=7,d=4", "--threads", "16", "--emit", str(path))
    assert code == 0, err
    assert "grid" in out and "(2, 1, 1)" in out and "(16, 1, 1)" in out
    assert "Verified by lower()" in out
    if not gpu_available():
        assert "numba's CUDA simulator (no GPU found)" in out
    assert path.read_text().startswith('"""kernel_q_d: generated by napkin_cat.lower')


@pytest.mark.skipif(driver_present(), reason="a GPU is present")
def test_bench_without_a_gpu_says_so_and_exits_2(capsys):
    code, out, err = napkin(capsys, "bench")
    assert code == 2 and "needs a CUDA GPU" in err and out == ""


@pytest.mark.parametrize("argv, needle", [
    (["draw", "nosuch", "-o", "x.svg"], "unknown diagram 'nosuch'"),
    (["draw", "matmul", "--causal", "-o", "x.svg"], "--causal does not apply to matmul"),
    (["cost", "attention", "--sizes", "q=8,x=abc"], "--sizes: 'x=abc' is not NAME=POSITIVE_INT"),
    (["cost", "attention", "--stream", "x"], "--stream 'x': expected AXIS=SIZE"),
    (["cost", "attention", "--hw", "h900"], "'h900' is not one of"),
    (["draw", "matmul"], "Missing option '-o'"),
    (["check", "matmul", "--frobnicate"], "No such option: --frobnicate"),
    (["frob"], "No such command 'frob'"),
    (["lower", "matmul"], "lower needs --sizes"),
])
def test_usage_errors_exit_2_with_one_line(capsys, argv, needle):
    code, _, err = napkin(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("napkin: error: ") and needle in err, err


def test_a_refused_request_exits_1_with_one_line_and_debug_shows_the_traceback(capsys):
    code, _, err = napkin(capsys, "cost", "softmax", "--stream", "c=4")
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("napkin: error: cannot stream c:") and "napkin --debug cost" in err
    with pytest.raises(nc.RelabelError, match="cannot stream c"):
        main(["--debug", "cost", "softmax", "--stream", "c=4"])


def test_goldens_command_reports_no_drift(capsys):
    code, out, _ = napkin(capsys, "goldens")
    assert code == 0 and "golden kernels match" in out


def test_goldens_outside_a_checkout_says_so(capsys, monkeypatch, tmp_path):
    from napkin_cat.lowering import goldens
    monkeypatch.setattr(goldens, "KERNELS_DIR", tmp_path / "site-packages" / "kernels")
    code, out, err = napkin(capsys, "goldens")
    assert code == 1 and out == ""
    assert "no golden kernels to compare" in err and "does not exist" in err and "differ" not in err


@pytest.mark.slow
def test_demo_runs_the_pipeline_and_draws(tmp_path):
    res = subprocess.run([sys.executable, "-m", "napkin_cat.cli", "demo", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=_env(), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for heading in ("1. diagrams", "3. derive FlashAttention", "4. cost", "5. lower"):
        assert heading in res.stdout
    assert "verified=True" in res.stdout and "verified=False" not in res.stdout
    assert "max rel. error vs NumPy" in res.stdout
    assert (tmp_path / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
