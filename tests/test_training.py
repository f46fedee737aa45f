"""The training proof at CPU size: ``kernels/train_gpt.py --small`` (a 2-layer GPT, context 16,
30 steps on the Python language reference from the standard library), attention by
``nc.torch_op`` (the NumPy executor: the simulator would take minutes for 120 attention calls)
and by torch SDPA, same seed, same batches.

Tolerance: both runs are fp32 and differ only in the attention's rounding (about 1e-7 relative
per value); carried through 30 Adam steps that stays near 1e-6 in the loss (2.4e-7 measured).
The bound, 1e-4, is 400 times that and 2500 times below the batch noise (about 0.25): a wrong
gradient (a missing causal mask, a dropped term of dS, a wrong scale) moves the loss by more than
1e-2 within a few steps.  The loss must fall from ln(vocab) = 4.6 by more than 0.5.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "kernels" / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_with_torch_op_matches_sdpa_and_learns(train_gpt):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny matrices: more threads only contend on a shared machine
    try:
        result = train_gpt.run(dict(train_gpt.SMALL), "cpu", seed=0, simulate=False, log=lambda s: None)
    finally:
        torch.set_num_threads(threads)
    ours, sdpa = result["napkin_cat"]["losses"], result["sdpa"]["losses"]
    assert len(ours) == len(sdpa) == train_gpt.SMALL["steps"]
    assert result["napkin_cat"]["paths"] == ["executor", "executor-fa2"]
    assert result["napkin_cat"]["saves"] == ["Q", "K", "V", "O", "L"]
    assert result["agreement"]["max_step_diff"] < 1e-4, result["agreement"]
    assert result["agreement"]["agree"]
    assert abs(ours[0] - math.log(len(set(train_gpt.corpus())))) < 0.1
    assert sum(ours[-5:]) / 5 < ours[0] - 0.5
    assert "| napkin_cat |" in train_gpt.table(result)
