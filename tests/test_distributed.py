"""Beyond one GPU: the device level, its relabelings, their cost, and the runtime on
torch.distributed (gloo, two processes on the CPU) against the single-device oracle."""

from __future__ import annotations

import json
import os
import socket

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")   # the kernel paths run in the simulator without a GPU

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
    (lambda: ATTN.tile(q, 16, order="zigzag"), "orders the blocks over the devices"),
    (lambda: ATTN.tile(q, DEVICES, order="striped"), "unknown layout"),
    (lambda: ATTN.stream(x, "s_x", order="zigzag"), "orders the blocks over the devices"),
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


CAUSAL = nc.library.attention(q=q, x=x, d=d, causal=True)
ZIGZAG = CAUSAL.tile(q, DEVICES, order="zigzag").stream(x, DEVICES, order="zigzag")


def test_zigzag_layout_is_simulated_and_equivalent():
    assert str(ZIGZAG).endswith("| tile(q, devices, order=zigzag), stream(x, devices, order=zigzag)")
    window = nc.library.attention(q=q, x=x, d=d, window_size=3)
    for a, b in ((CAUSAL, ZIGZAG.stream(x, 2).tile(q, 2)),
                 (window, window.tile(q, DEVICES, order="zigzag").stream(x, DEVICES))):
        assert nc.check_equivalent(a, b, examples=6, progress=False).examples == 6
    rng = np.random.default_rng(2)
    Q, K, V = (rng.standard_normal((12, 3)) for _ in range(3))
    want = nc.evaluate(CAUSAL, Q, K, V)
    for p in (1, 2, 3):
        assert np.abs(nc.evaluate(ZIGZAG, Q, K, V, sizes={DEVICES: p}) - want).max() < 1e-12
    with pytest.raises(nc.ShapeError, match="2 x devices=4 zig-zag chunks"):
        nc.evaluate(ZIGZAG, Q, K, V, sizes={DEVICES: 4})


def test_shard_and_unshard_follow_the_layout():
    from napkin_cat.lowering.distributed import shard, unshard
    Q = np.arange(16.0).reshape(8, 2)
    rows = {r: shard(ZIGZAG, (Q, Q, Q), 2, r)[0][:, 0] / 2 for r in (0, 1)}
    assert rows[0].tolist() == [0, 1, 6, 7] and rows[1].tolist() == [2, 3, 4, 5]
    assert (unshard(ZIGZAG, [shard(ZIGZAG, (Q, Q, Q), 2, r)[0] for r in (0, 1)], 2) == Q).all()
    t = torch.from_numpy(Q)
    assert torch.equal(unshard(RING, [shard(RING, (t, t, t), 2, r)[0] for r in (0, 1)], 2), t)
    with pytest.raises(nc.ShapeError, match=r"input Q\[q d\] f32, axis q: .* 4 must divide 6"):
        shard(ZIGZAG, (Q[:6], Q, Q), 2, 0)


def test_device_plan_refuses_what_it_cannot_place():
    from napkin_cat.lowering.distributed import device_plan
    from napkin_cat.ops.builder import Builder
    doc = nc.aux("doc", q)                  # document ids over the split query axis itself
    g = Builder()
    Q, K, V, D = g.input("Q", q, d), g.input("K", x, d), g.input("V", x, d), g.input("doc", q)
    S = g.mask(g.contract(Q, K, out=(q, x), name="S"), q, x, nc.mask_mod(lambda b, h, i, j: doc[i] >= 0), D)
    O = g.contract(g.softmax(S, x), V, out=(q, d), name="O")
    split = g.diagram(O).tile(q, DEVICES).stream(x, DEVICES)
    Q_, K_, V_, D_ = np.ones((4, 2)), np.ones((4, 2)), np.ones((4, 2)), np.zeros(4)
    assert np.abs(nc.evaluate(split, Q_, K_, V_, D_, sizes={DEVICES: 2}) - 1).max() < 1e-12   # simulated: fine
    with pytest.raises(nc.LoweringError, match=r"mask .* gathers from doc\[q\] f32, which carries q"):
        device_plan(split)
    biased = nc.library.attention(q=q, x=x, d=d, bias="input").tile(q, DEVICES).stream(x, DEVICES)
    with pytest.raises(nc.LoweringError, match="B.* carries both q"):
        device_plan(biased)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["causal", "window", "alibi"])
def test_shifted_blocks_lower_to_kernels_that_match_the_global_mask(kind):
    """What a GPU runs for a block pair: the block's diagram lowered (numba.cuda simulator),
    against attention of the block's queries over the block's keys with the mask and bias
    written out in NumPy at global indices."""
    from napkin_cat.lowering.distributed import device_plan
    from napkin_cat.relabel.devices import block_view
    opts = {"causal": dict(causal=True), "window": dict(window_size=3),
            "alibi": dict(causal=True, bias=nc.alibi(0.5))}[kind]
    plan = device_plan(nc.library.attention(q=q, x=x, d=d, **opts).tile(q, DEVICES).stream(x, DEVICES))
    rng = np.random.default_rng(5)
    Q, K, V = (rng.standard_normal((4, 3)).astype(np.float32) for _ in range(3))
    for rows, cols in (((4, 8), (6, 10)), ((4, 8), (0, 4)), ((8, 12), (2, 6))):
        view = block_view(plan.local, {"q": rows, "x": cols}, {"q": 12, "x": 12, "d": 3}, plan.skips)
        o, lse = nc.lower(view.diagram.bind({q: 4, x: 4, d: 3}), verify=True)(Q, K, V)
        i, j = np.arange(*rows)[:, None], np.arange(*cols)[None, :]
        s = Q.astype(np.float64) @ K.T / np.sqrt(3) + (0.5 * (j - i) if kind == "alibi" else 0.0)
        keep = (j >= i - 3) & (j <= i) if kind == "window" else j <= i
        s = np.where(keep, s, -np.inf)
        top = np.where(keep.any(1), s.max(1), 0.0)[:, None]
        z = np.exp(s - top).sum(1)
        want_o = np.where(z[:, None] > 0, np.exp(s - top) / np.where(z > 0, z, 1)[:, None], 0.0) @ V
        with np.errstate(divide="ignore"):
            want_l = np.log(z) + top[:, 0]
        assert np.abs(np.asarray(o) - want_o).max() < 1e-5, (kind, rows, cols, view.key)
        assert np.allclose(np.asarray(lse), want_l, atol=1e-5), (kind, rows, cols, view.key)


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
    f32 = nc.torch_op(RING, simulate=False)(t(Q[rows]).float(), t(K[cols]).float(), t(V[cols]).float())
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


def _masked_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from napkin_cat.lowering.distributed import shard, unshard
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rng = np.random.default_rng(4)
    Q, K, V = (rng.standard_normal((8, 3)) for _ in range(3))
    window = nc.library.attention(q=q, x=x, d=d, window_size=2)
    alibi = nc.library.attention(q=q, x=x, d=d, causal=True, bias=nc.alibi(0.5))
    late = nc.library.attention(q=q, x=x, d=d, mask=nc.causal(-6))   # queries 0..5 see no key
    res = {}
    for name, oracle, dg in (
            ("causal", CAUSAL, CAUSAL.tile(q, DEVICES).stream(x, DEVICES).stream(x, 2).tile(q, 2)),
            ("causal_zigzag", CAUSAL, ZIGZAG.stream(x, 2).tile(q, 2)),
            ("window", window, window.tile(q, DEVICES).stream(x, DEVICES).stream(x, 2).tile(q, 2)),
            ("late", late, late.tile(q, DEVICES).stream(x, DEVICES).stream(x, 2).tile(q, 2)),
            ("alibi_zigzag", alibi, alibi.tile(q, DEVICES, order="zigzag").stream(x, DEVICES, order="zigzag")
             .stream(x, 2).tile(q, 2))):
        op = nc.torch_op(dg)
        got = op(*(torch.from_numpy(np.ascontiguousarray(t)) for t in shard(dg, (Q, K, V), world, rank)))
        outs = [None] * world
        dist.all_gather_object(outs, got.numpy())
        res[name] = [float(np.abs(unshard(dg, outs, world) - nc.evaluate(oracle, Q, K, V)).max()),
                     op.last_path, op.last_blocks]
    try:        # zig-zag shards of 3 rows: 2 x 2 chunks do not divide the 6 queries
        nc.torch_op(ZIGZAG)(torch.ones(3, 3, dtype=torch.float64), torch.ones(4, 3, dtype=torch.float64),
                            torch.ones(4, 3, dtype=torch.float64))
    except nc.ShapeError as e:
        res["refused"] = str(e)
    dist.destroy_process_group()
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump(res, f)


def test_masked_ring_on_two_gloo_processes_matches_the_oracle(tmp_path):
    import torch.multiprocessing as mp
    mp.start_processes(_masked_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    res = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    for r in res:
        for name in ("causal", "causal_zigzag", "window", "late", "alibi_zigzag"):
            assert r[name][0] < 1e-12 and r[name][1] == "ring:executor", (name, r[name])
        assert "2 x 2 zig-zag chunks" in r["refused"]
    # contiguous causal: rank 0 skips the later block, rank 1 runs the earlier one unmasked
    assert res[0]["causal"][2] == {"partial": 1, "empty": 1} and res[1]["causal"][2] == {"partial": 1, "full": 1}
    # zig-zag: both ranks do the same work (2 diagonal chunks masked, 3 whole, 3 skipped of 8)
    assert res[0]["causal_zigzag"][2] == res[1]["causal_zigzag"][2] == {"partial": 2, "full": 3, "empty": 3}
    # a window of 2 reaches one block back: the earlier block is partial, the later one skipped
    assert res[0]["window"][2] == {"partial": 1, "empty": 1} and res[1]["window"][2] == {"partial": 2}
    # rank 0's queries see no key at all: nothing computed, zero rows (as the oracle's)
    assert res[0]["late"][2] == {"empty": 2} and res[1]["late"][2] == {"partial": 1, "empty": 1}


# --------------------------------------------------------------------------- the backward over the devices

def _grads(oracle, arrays, dout):
    """The oracle's gradients of ``sum(out * dout)`` (float64 autograd through the executor)."""
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    (nc.torch_op(oracle, simulate=False)(*ts) * torch.tensor(dout)).sum().backward()
    return [t.grad.numpy() for t in ts]


def _backward_worker(rank: int, world: int, port: int, out: str) -> None:
    """Every split kind's gradients against the single-device oracle's, each rank checking its
    own shards (an input every rank holds whole gets the whole gradient on every rank)."""
    import torch.distributed as dist
    from napkin_cat.lowering.distributed import shard
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    n = 4 * world * 3                         # zig-zag chunks divide it for world 2 and 3
    rng = np.random.default_rng(7)
    Q, K, V, dO = (rng.standard_normal((n, 3)) for _ in range(4))
    late = nc.library.attention(q=q, x=x, d=d, mask=nc.causal(-(n - n // world // 2)))  # rank 0 sees no key
    alibi = nc.library.attention(q=q, x=x, d=d, causal=True, bias=nc.alibi(0.5))
    res = {}
    for name, oracle, dg in (
            ("ring", ATTN, RING.stream(x, 2).tile(q, 3)),
            ("causal", CAUSAL, CAUSAL.tile(q, DEVICES).stream(x, DEVICES)),
            ("causal_zigzag", CAUSAL, ZIGZAG.stream(x, 2)),
            ("alibi_zigzag", alibi, alibi.tile(q, DEVICES, order="zigzag").stream(x, DEVICES, order="zigzag")),
            ("late", late, late.tile(q, DEVICES).stream(x, DEVICES)),
            ("gather", ATTN, ATTN.stream(x, DEVICES)),
            ("sharded", ATTN, ATTN.tile(q, DEVICES))):
        want = shard(dg, _grads(oracle, (Q, K, V), dO), world, rank)
        mine = [torch.tensor(np.ascontiguousarray(t), requires_grad=True) for t in shard(dg, (Q, K, V), world, rank)]
        dout = dO if name == "gather" else shard(dg, (dO, K, V), world, rank)[0]   # dO is split like O
        op = nc.torch_op(dg)
        (op(*mine) * torch.tensor(np.ascontiguousarray(dout))).sum().backward()
        res[name] = [max(float(np.abs(t.grad.numpy() - w).max()) for t, w in zip(mine, want)),
                     op.last_backward_path, op.last_backward_blocks]
    a, b, c = nc.axes("a b c")                # a matmul summed over the devices: no residual
    A, B, dC = rng.standard_normal((3, n)), rng.standard_normal((n, 5)), rng.standard_normal((3, 5))
    mm = nc.library.matmul(a=a, b=b, c=c).stream(b, DEVICES)
    mine = [torch.tensor(np.ascontiguousarray(t), requires_grad=True) for t in shard(mm, (A, B), world, rank)]
    (nc.torch_op(mm)(*mine) * torch.tensor(dC)).sum().backward()
    want = shard(mm, (dC @ B.T, A.T @ dC), world, rank)
    res["matmul"] = [max(float(np.abs(t.grad.numpy() - w).max()) for t, w in zip(mine, want)), "", {}]
    mine = [torch.tensor(np.ascontiguousarray(t), dtype=torch.float32, requires_grad=True)
            for t in shard(RING, (Q, K, V), world, rank)]
    (nc.torch_op(RING, simulate=False)(*mine)
     * torch.tensor(shard(RING, (dO, K, V), world, rank)[0], dtype=torch.float32)).sum().backward()
    want = shard(RING, _grads(ATTN, (Q, K, V), dO), world, rank)
    res["f32"] = [max(float(np.abs(t.grad.double().numpy() - w).max()) for t, w in zip(mine, want)),
                  str(mine[0].grad.dtype), {}]
    dist.destroy_process_group()
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump(res, f)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_backward_over_the_devices_matches_the_oracle(tmp_path, world):
    """``O.backward()`` of a split op on gloo processes: the ring's gradients travel back to
    their blocks' devices, every kind and layout within 1e-12 of the oracle (float64), 1e-5 (float32)."""
    import torch.multiprocessing as mp
    mp.start_processes(_backward_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True,
                       start_method="fork")
    res = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    for rank, r in enumerate(res):
        for name, (err, path, _) in r.items():
            assert err < (1e-5 if name == "f32" else 1e-12), (rank, name, err)
        for name, kind in (("ring", "ring"), ("causal", "ring"), ("causal_zigzag", "ring"),
                           ("alibi_zigzag", "ring"), ("gather", "gather"), ("sharded", "sharded")):
            assert r[name][1] == f"{kind}:executor-fa2", (name, r[name])
        assert r["f32"][1] == "torch.float32"
    # the backward skips what the forward skips: rank 0 of "late" has no key block to differentiate
    assert res[0]["late"][1] == "ring:skipped" and res[0]["late"][2] == {"empty": world}
    assert res[0]["causal_zigzag"][2] == res[1]["causal_zigzag"][2]


def _kernel_worker(rank: int, world: int, port: int, out: str, cases: tuple, backward: bool) -> None:
    """The ring's generated kernels in the simulator on CPU shards (f32, f16, bf16), forward and
    (with ``backward``) gradients, against the float64 oracle."""
    import torch.distributed as dist
    from napkin_cat.lowering.distributed import shard
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rng = np.random.default_rng(5)
    Q, K, V, dO = (rng.standard_normal((32, 16)) for _ in range(4))
    res = {}
    for name, dtype in cases:
        oracle, dg = (CAUSAL, ZIGZAG) if name == "zigzag" else (ATTN, RING)
        dt = getattr(torch, dtype)
        mine = [torch.tensor(np.ascontiguousarray(a), dtype=dt, requires_grad=backward)
                for a in shard(dg, (Q, K, V), world, rank)]
        op = nc.torch_op(dg, simulate=True)
        O = op(*mine)
        got = {"O": float(np.abs(O.detach().double().numpy() - shard(dg, (nc.evaluate(oracle, Q, K, V), K, V),
                                                                      world, rank)[0]).max()),
               "path": op.last_path, "dtype": str(O.dtype)}
        if backward:
            O.backward(torch.tensor(np.ascontiguousarray(shard(dg, (dO, K, V), world, rank)[0]), dtype=dt))
            want = shard(dg, _grads(oracle, (Q, K, V), dO), world, rank)
            got.update(grads=max(float(np.abs(m.grad.double().numpy() - w).max()) for m, w in zip(mine, want)),
                       backward_path=op.last_backward_path, grad_dtype=str(mine[0].grad.dtype))
        res[f"{name} {dtype}"] = got
    dist.destroy_process_group()
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump(res, f)


TOL_16 = {"float32": 1e-5, "float16": 3e-3, "bfloat16": 3e-2}     # max abs error, |O| and gradients ~ 1


def _run_kernel_workers(tmp_path, cases, backward):
    import torch.multiprocessing as mp
    mp.start_processes(_kernel_worker, args=(2, _free_port(), str(tmp_path), cases, backward), nprocs=2,
                       join=True, start_method="fork")
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]


def test_ring_kernels_in_16_bits_on_two_gloo_processes(tmp_path):
    """f16 shards run the tensor-core kernel per block (its fp32 partials folded), f32 the fp32
    kernel: both in the simulator, the output in the shards' dtype, near the oracle."""
    for r in _run_kernel_workers(tmp_path, (("ring", "float16"), ("ring", "float32")), backward=False):
        for key, got in r.items():
            dtype = key.split()[1]
            assert got["path"] == "ring:simulator" and got["dtype"] == f"torch.{dtype}", (key, got)
            assert got["O"] < TOL_16[dtype], (key, got)


@pytest.mark.slow
def test_ring_gradients_in_16_bits_on_two_gloo_processes(tmp_path):
    """The backward over the devices with 16-bit shards: the block kernels' gradients added in
    fp32 (the ring's accumulators travel in fp32), returned in the shards' dtype; zig-zag causal too."""
    cases = (("ring", "float16"), ("ring", "bfloat16"), ("zigzag", "float16"))
    for r in _run_kernel_workers(tmp_path, cases, backward=True):
        for key, got in r.items():
            dtype = key.split()[1]
            assert got["backward_path"].startswith("ring:simulator-fa2"), (key, got)
            assert got["grad_dtype"] == f"torch.{dtype}" and got["dtype"] == f"torch.{dtype}", (key, got)
            assert got["O"] < TOL_16[dtype] and got["grads"] < 3 * TOL_16[dtype], (key, got)


def test_bench_script_plans_on_the_cpu(capsys, monkeypatch):
    """kernels/bench_multi_gpu.py imports without a GPU and its planning runs (--plan)."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "kernels" / "bench_multi_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_multi_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr("sys.argv", ["bench", "--plan", "--world", "4", "--strong", "4096", "--causal", "--zigzag",
                                     "--backward", "4096"])
    bench.main()
    out = capsys.readouterr().out
    assert "N=4096: predicted ring forward + backward" in out, out
    assert "order=zigzag" in out and "plan: ring" in out and "query rows per rank: [8, 8, 8, 8]" in out, out
    assert "kept tiles per device [520, 520, 520, 520], imbalance 1.00" in out, out
