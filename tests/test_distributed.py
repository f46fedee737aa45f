"""Beyond one GPU: the device level, its relabelings, their cost, and the runtime on
torch.distributed (gloo, two processes on the CPU) against the single-device oracle."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest
import torch

import napkin_cat as nc
from napkin_cat.core.hierarchy import DEVICES
from napkin_cat.relabel.symbols import size_symbol

q, x, d = nc.axes("q x d")
ATTN = nc.library.attention(q=q, x=x, d=d)
RING = ATTN.tile(q, DEVICES).stream(x, DEVICES)


# --------------------------------------------------------------------------- relabelings, on one machine

def test_device_split_relabelings_are_equivalent():
    causal = nc.library.attention(q=q, x=x, d=d, causal=True)
    for a, b in ((ATTN, RING), (ATTN, RING.stream(x, "s_x").tile(q, "g_q")), (ATTN, ATTN.stream(x, DEVICES)),
                 (causal, causal.tile(q, DEVICES).stream(x, DEVICES).stream(x, 2))):
        assert nc.check_equivalent(a, b, examples=6, progress=False).examples == 6


def test_ring_order_is_simulated_device_by_device():
    rng = np.random.default_rng(1)
    Q, K, V = rng.standard_normal((6, 3)), rng.standard_normal((9, 3)), rng.standard_normal((9, 3))
    want = nc.evaluate(ATTN, Q, K, V)
    for p in (1, 3):
        assert np.abs(nc.evaluate(RING, Q, K, V, sizes={DEVICES: p}) - want).max() < 1e-12


@pytest.mark.parametrize("make, words", [
    (lambda: RING.tile(q, DEVICES), "already has a tile over the devices"),
    (lambda: ATTN.stream(x, 4).tile(q, DEVICES), "split over the devices first"),
    (lambda: ATTN.tile(q, DEVICES, level="SMEM"), "lives in its HBM"),
    (lambda: ATTN.tile(x, DEVICES), "cannot tile x"),
    (lambda: RING.stream(q, 2).order("q"), "name it first"),
])
def test_device_split_refusals_name_the_problem(make, words):
    with pytest.raises(nc.RelabelError, match=words):
        make()


def test_device_split_needs_a_dividing_world():
    Q = K = V = np.ones((6, 2))
    with pytest.raises(nc.NapkinError, match="does not split over devices=4"):
        nc.evaluate(RING, Q, K, V, sizes={DEVICES: 4})
    with pytest.raises(nc.NapkinError, match="pass sizes"):
        nc.evaluate(RING, Q, K, V)


def test_link_transfers_and_device_time():
    assert str(nc.cost(RING).transfers["NVLink"]) == "2*d*devices*x - 2*d*x"
    assert "NVLink" not in nc.cost(ATTN.tile(q, DEVICES)).transfers          # sharded: nothing moves
    gather = nc.cost(ATTN.stream(x, DEVICES)).transfers["NVLink"]            # (O, L) partials all-gathered
    assert str(gather.subs(size_symbol(DEVICES), 2)) == "2*d*q + 2*q"
    c = nc.cost(RING.stream(x, 64).tile(q, 64))
    with pytest.raises(nc.CostError, match="cost.devices"):
        c.time(nc.hardware.H200, {q: 4096, x: 4096, d: 64, DEVICES: 2})
    big = c.devices(nc.hardware.H200, {q: 1 << 16, x: 1 << 16, d: 64, DEVICES: 2})
    small = c.devices(nc.hardware.H200, {q: 1 << 11, x: 1 << 11, d: 64, DEVICES: 2})
    assert not big.bandwidth_bound and small.bandwidth_bound
    with pytest.raises(nc.CostError, match="no link bandwidth"):
        c.devices(nc.hardware.A100_SXM4, {q: 64, x: 64, d: 8, DEVICES: 2})


def test_torch_op_without_process_group_refuses():
    op = nc.torch_op(RING)
    with pytest.raises(nc.LoweringError, match="no process group"):
        op(torch.ones(4, 2), torch.ones(4, 2), torch.ones(4, 2))


# --------------------------------------------------------------------------- two processes, gloo

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rng = np.random.default_rng(0)                      # the same data on every rank
    Q, K, V = rng.standard_normal((8, 4)), rng.standard_normal((12, 4)), rng.standard_normal((12, 4))
    want = nc.evaluate(ATTN, Q, K, V)
    rows, cols = slice(rank * 4, rank * 4 + 4), slice(rank * 6, rank * 6 + 6)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    res = {}
    for name, dg in (("ring", RING), ("ring_tiled", RING.stream(x, 2).tile(q, "g_q"))):
        op = nc.torch_op(dg)
        got = op(t(Q[rows]), t(K[cols]), t(V[cols]))
        res[name] = [float((got.numpy() - want[rows]).__abs__().max()), op.last_path]
    op = nc.torch_op(ATTN.stream(x, DEVICES))
    got = op(t(Q), t(K[cols]), t(V[cols]))
    res["gather"] = [float(np.abs(got.numpy() - want).max()), op.last_path]
    op = nc.torch_op(ATTN.tile(q, DEVICES))
    got = op(t(Q[rows]), t(K), t(V))
    res["sharded"] = [float(np.abs(got.numpy() - want[rows]).max()), op.last_path]
    a, b, c = nc.axes("a b c")
    A, B = rng.standard_normal((3, 8)), rng.standard_normal((8, 5))
    op = nc.torch_op(nc.library.matmul(a=a, b=b, c=c).stream(b, DEVICES))
    got = op(t(A[:, rank * 4:rank * 4 + 4]), t(B[rank * 4:rank * 4 + 4]))
    res["sum"] = [float(np.abs(got.numpy() - A @ B).max()), op.last_path]
    f32 = nc.torch_op(RING)(t(Q[rows]).float(), t(K[cols]).float(), t(V[cols]).float())
    res["ring_f32"] = [float(np.abs(f32.double().numpy() - want[rows]).max()), f32.dtype == torch.float32]
    try:
        nc.torch_op(RING.bind({q: 8, x: 12}))(t(Q[:3]), t(K[cols]), t(V[cols]))
    except nc.ShapeError as e:
        res["shape_error"] = str(e)
    dist.destroy_process_group()
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump(res, f)


def test_runtime_on_two_gloo_processes_matches_the_oracle(tmp_path):
    import torch.multiprocessing as mp
    # forked, so that the workers start with napkin_cat and torch already imported
    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True, start_method="fork")
    for rank in (0, 1):
        res = json.loads((tmp_path / f"{rank}.json").read_text())
        for name in ("ring", "ring_tiled", "gather", "sharded", "sum"):
            err, path = res[name]
            assert err < 1e-12, (rank, name, err)
            assert path.endswith(":executor")
        assert res["ring"][1] == "ring:executor" and res["gather"][1] == "gather:executor"
        assert res["ring_f32"][0] < 1e-5 and res["ring_f32"][1]
        assert "axis q should be 4" in res["shape_error"]
