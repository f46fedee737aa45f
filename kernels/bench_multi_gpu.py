"""Ring attention over the GPUs of one host: correctness, scaling, longest N, link time.

    torchrun --nproc_per_node 2 kernels/bench_multi_gpu.py [--out kernels/multi_gpu.json]
    torchrun --nproc_per_node 4 kernels/bench_multi_gpu.py --causal --zigzag --check-only
    python kernels/bench_multi_gpu.py --plan --world 4 --causal --zigzag     # CPU only: no GPU, no torchrun

The diagram is ``attention(heads=h).tile(q, "devices").stream(x, "devices")`` with FlashAttention
inside each device (``stream(x, s_x).tile(q, g_q).tile(h, 1)``, blocks chosen by ``nc.lower``);
``nc.torch_op`` runs it on NCCL, one process per GPU, the per-device work the generated kernel
(``--dtype f16`` / ``bf16``: tensor cores, fp32 partials folded; ``f32``: fp32).  The one-GPU rows
are ``nc.torch_op`` of the single-device diagram, with torch's SDPA beside them as the peer.  Before any timing, every rank checks its output shard against a float64 reference on
random data (and against the single-GPU kernel); a failure exits 1 before the table.
``--check-only`` stops after the check.

``--causal`` masks the attention causally (each device skips the key blocks its queries never
see and runs the ones they see whole without the mask); ``--zigzag`` lays the queries and keys
out zig-zag over the devices (device ``r`` of ``W`` holds chunks ``r`` and ``2W - 1 - r`` of ``2W``,
:mod:`napkin_cat.relabel.devices`), balancing the causal work.  Inputs are cut into each rank's
shards by ``napkin_cat.lowering.distributed.shard``.  ``--plan`` prints, without GPUs, the plan
and the cost model's predictions (kept tiles per device, imbalance, predicted ring time).

Measured (CUDA events, medians over ``--reps`` runs, the slowest rank's time):
* strong scaling: one GPU (the single-device kernel on rank 0) against the ring at the same N;
* weak scaling: the ring at ``N * world`` (each GPU holds N rows, as one GPU does) against one GPU
  at N; each GPU then computes ``world`` times the blocks, so the efficiency is ``world * t1 / t_ring``;
* longest N: doubling N until a call runs out of memory or would pass ``--max-seconds``
  (extrapolated from the last, time growing as N^2), on one GPU and on the ring;
* link time: the ring's block exchanges alone (no compute), against the cost model's
  ``nc.cost(ring).devices(hw, sizes).link_seconds``; and the ring's time against its predicted
  ``seconds`` (compute overlapped with the link).
* ``--backward N ...``: forward + backward (``O.backward(dO)``: the ring's gradients travel back
  with their accumulators, :mod:`napkin_cat.lowering.distributed_backward`) of the ring against
  ``nc.torch_op`` on one GPU, after the gradients are checked against float64 autograd on every
  rank; beside each, the prediction (``nc.cost(ring).devices`` plus
  :func:`napkin_cat.costmodel.backward_device_time`).  ``--backward-only`` skips the forward rows.
The table is printed last (rank 0); the JSON has every number.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat.core.hierarchy import DEVICES  # noqa: E402
from napkin_cat.costmodel import backward_device_time  # noqa: E402
from napkin_cat.lowering.distributed import device_plan, shard  # noqa: E402
from napkin_cat.relabel.devices import pieces  # noqa: E402

q, x, d, h = nc.axes("q x d h")
OPTS = {"causal": False, "order": "contiguous", "dtype": torch.float16}     # set from the command line in main()
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}   # max abs error vs float64


def attention():
    return nc.library.attention(q=q, x=x, d=d, heads=h, causal=OPTS["causal"])


def ring_diagram():
    order = OPTS["order"]
    return (attention().tile(q, DEVICES, order=order).stream(x, DEVICES, order=order)
            .stream(x, "s_x").tile(q, "g_q").tile(h, 1))


def single_diagram():
    return attention().stream(x, "s_x").tile(q, "g_q").tile(h, 1)


def typed(diagram):
    """``diagram`` with its wires in the run's dtype (what the cost model prices)."""
    from napkin_cat.core.types import DTYPES as NC
    from napkin_cat.lowering.backward_forms import at_dtype
    name = {v: k for k, v in DTYPES.items()}[OPTS["dtype"]]
    return at_dtype(diagram, NC[name])


def sdpa(Q, K, V):
    """The peer on one GPU: torch's scaled_dot_product_attention (FlashAttention-2 kernels in
    16 bits, the efficient-attention kernel in fp32), on ``[h, N, d]`` tensors."""
    return torch.nn.functional.scaled_dot_product_attention(Q[None], K[None], V[None], is_causal=OPTS["causal"])[0]


T0 = time.perf_counter()


def log(rank, *a):
    """Rank 0's progress, with seconds since start (compiles dominate: about 25 s a kernel)."""
    if rank == 0:
        print(f"[{time.perf_counter() - T0:6.1f} s]", *a, flush=True)


def save(rank, path, res):
    """The results so far (rank 0): a run stopped by a time limit keeps what it measured."""
    if rank == 0:
        Path(path).write_text(json.dumps(res, indent=1))


def timed(fn, reps, group_max=True):
    """Median milliseconds of ``fn`` over ``reps`` runs (CUDA events), the slowest rank's.  With
    ``group_max=False`` (one rank timing alone) it calls no collective: the other ranks wait in
    their own barrier, which a collective here would match by mistake and deadlock."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        if group_max:
            dist.barrier()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    med = torch.tensor([statistics.median(ts)], device="cuda")
    if group_max:
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med.item())


def data(H, N, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(H, N, D, generator=g, dtype=torch.float64) for _ in range(3)]


def rows(t, rank, world):
    """The query rows of ``t`` (``[h, N, ...]``) that ``rank`` holds, in the layout's order."""
    return torch.cat([t[:, s:s + n] for s, n in pieces(OPTS["order"], t.shape[1], world, rank)], 1)


def reference(Q, K, V):
    s = torch.einsum("hqd,hxd->hqx", Q, K) / math.sqrt(Q.shape[-1])
    if OPTS["causal"]:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
    return torch.einsum("hqx,hxd->hqd", torch.softmax(s, -1), V)


def check(rank, world, H, D, N):
    """Ring (the generated kernel per block) and the single-GPU op against the float64
    reference, on every rank."""
    Q, K, V = data(H, N, D, seed=1)
    want = reference(Q, K, V)
    dev, dt = torch.device("cuda"), OPTS["dtype"]
    op = nc.torch_op(ring_diagram(), verify=True)
    got = op(*(t.to(dev, dt) for t in shard(ring_diagram(), (Q, K, V), world, rank)))
    err_ring = (got.double().cpu() - rows(want, rank, world)).abs().max().item()
    one = nc.torch_op(single_diagram(), verify=True)(*(t.to(dev, dt) for t in (Q, K, V)))
    err_single = (one.double().cpu() - want).abs().max().item()
    err_vs_single = (got.double().cpu() - rows(one.double().cpu(), rank, world)).abs().max().item()
    errs = torch.tensor([err_ring, err_single, err_vs_single], device=dev)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    errs = [float(e) for e in errs]
    ok = errs[0] < TOLERANCE[dt] and errs[1] < TOLERANCE[dt]
    return {"N": N, "H": H, "d": D, "max_err_ring_vs_f64": errs[0], "max_err_single_vs_f64": errs[1],
            "max_err_ring_vs_single": errs[2], "ok": ok, "path": op.last_path, "blocks": op.last_blocks}


def check_backward(rank, world, H, D, N):
    """The ring's gradients (the generated kernels) against float64 autograd of the reference, every rank."""
    Q, K, V = data(H, N, D, seed=3)
    dO = data(H, N, D, seed=4)[0]
    leaves = [t.clone().requires_grad_() for t in (Q, K, V)]
    (reference(*leaves) * dO).sum().backward()
    dev = torch.device("cuda")
    dt = OPTS["dtype"]
    mine = [t.to(dev, dt).requires_grad_() for t in shard(ring_diagram(), (Q, K, V), world, rank)]
    op = nc.torch_op(ring_diagram(), verify=True)
    O = op(*mine)
    O.backward(rows(dO, rank, world).to(dev, dt))
    want = shard(ring_diagram(), tuple(t.grad for t in leaves), world, rank)
    errs = torch.tensor([((m.grad.double().cpu() - w).abs().max() / w.abs().max()).item()
                         for m, w in zip(mine, want)], device=dev)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    errs = [float(e) for e in errs]
    return {"N": N, "H": H, "d": D, "max_rel_err_dQ_dK_dV": errs, "ok": max(errs) < 10 * TOLERANCE[dt],
            "path": op.last_backward_path, "blocks": op.last_backward_blocks, "notes": op.notes}


class Runner:
    def __init__(self, rank, world, H, D, reps):
        self.rank, self.world, self.H, self.D, self.reps = rank, world, H, D, reps
        self.ops, self.singles = {}, {}

    def inputs(self, N, sharded):
        g = torch.Generator(device="cuda").manual_seed(2)
        n = N // self.world if sharded else N
        return [torch.randn(self.H, n, self.D, device="cuda", generator=g).to(OPTS["dtype"]) for _ in range(3)]

    def ring(self, N):
        op = self.ops.setdefault(N, nc.torch_op(ring_diagram(), verify=False))
        Q, K, V = self.inputs(N, True)
        return timed(lambda: op(Q, K, V), self.reps)

    def single(self, N, peer=False):
        """``nc.torch_op`` of the single-device diagram (or, with ``peer``, torch's SDPA) on one
        GPU, timed on rank 0 only (the others wait at the barrier)."""
        out = torch.zeros(1, device="cuda")
        if self.rank == 0:
            try:
                k = sdpa if peer else self.singles.setdefault(N, nc.torch_op(single_diagram(), verify=False))
                Q, K, V = self.inputs(N, False)
                out[0] = timed(lambda: k(Q, K, V), self.reps, group_max=False)
            except torch.cuda.OutOfMemoryError:
                out[0] = -1.0
        dist.barrier()
        dist.broadcast(out, 0)
        if out.item() < 0:
            raise torch.cuda.OutOfMemoryError(f"one GPU at N={N}")
        return float(out.item())

    def ring_fwd_bwd(self, N):
        op = self.ops.setdefault(("fb", N), nc.torch_op(ring_diagram(), verify=False))
        Q, K, V = (t.requires_grad_() for t in self.inputs(N, True))
        dO = self.inputs(N, True)[0]
        return timed(lambda: op(Q, K, V).backward(dO), self.reps)

    def single_fwd_bwd(self, N, peer=False):
        """``nc.torch_op`` (or, with ``peer``, SDPA) forward + backward on one GPU, rank 0 only."""
        out = torch.zeros(1, device="cuda")
        if self.rank == 0:
            op = sdpa if peer else self.singles.setdefault(("fb", N), nc.torch_op(single_diagram(), verify=False))
            Q, K, V = (t.requires_grad_() for t in self.inputs(N, False))
            dO = self.inputs(N, False)[0]
            out[0] = timed(lambda: op(Q, K, V).backward(dO), self.reps, group_max=False)
        dist.barrier()
        dist.broadcast(out, 0)
        return float(out.item())

    def fits(self, N, sharded):
        """Whether the inputs, outputs and ring buffers (about 10 arrays of a shard) fit."""
        n = N // self.world if sharded else N
        free = torch.tensor([torch.cuda.mem_get_info()[0]], device="cuda", dtype=torch.float64)
        dist.all_reduce(free, op=dist.ReduceOp.MIN)
        return 10 * OPTS["dtype"].itemsize * self.H * n * self.D < 0.9 * free.item()

    def link_only(self, N):
        """The ring's exchanges without compute: world - 1 batched send/recv of a K and V block."""
        n = N // self.world
        cur = torch.randn(2 * self.H * n * self.D, device="cuda").to(OPTS["dtype"])
        spare = torch.empty_like(cur)
        to, frm = (self.rank + 1) % self.world, (self.rank - 1) % self.world

        def go():
            nonlocal cur, spare
            for _ in range(self.world - 1):
                for r in dist.batch_isend_irecv([dist.P2POp(dist.isend, cur, to), dist.P2POp(dist.irecv, spare, frm)]):
                    r.wait()
                cur, spare = spare, cur
        return timed(go, self.reps)


def predicted(world, H, D, N, hw):
    sizes = {q: N, x: N, d: D, h: H, DEVICES: world, "s_x": 64, "g_q": 64}
    return nc.cost(typed(ring_diagram())).devices(hw, sizes)


def predicted_backward(world, H, D, N, hw):
    sizes = {q: N, x: N, d: D, h: H, DEVICES: world, "s_x": 64, "g_q": 64}
    return backward_device_time(typed(ring_diagram()), hw, sizes)


def plan_only(args):
    """What runs, without GPUs: the plan, and the cost model's prediction per N."""
    hw = nc.hardware.H200 if args.hw == "H200" else nc.hardware.H100
    plan = device_plan(ring_diagram())
    print(f"{ring_diagram()}\nplan: {plan.kind}, layouts {plan.layouts}, fold {plan.fold}, "
          f"skipping masks {list(plan.skips)}", flush=True)
    Q = torch.zeros(1, 8 * args.world, 1)
    print("query rows per rank:", [shard(ring_diagram(), (Q, Q, Q), args.world, r)[0].shape[1]
                                   for r in range(args.world)], flush=True)
    for N in args.strong:
        t = predicted(args.world, args.heads, args.dim, N, hw)
        print(f"  N={N}: predicted ring {t.seconds * 1e3:.2f} ms, link {t.link_seconds * 1e3:.3f} ms, "
              f"bandwidth-bound {t.bandwidth_bound}, kept tiles per device {list(t.tiles) or 'all'}, "
              f"imbalance {t.imbalance:.2f}", flush=True)
    for N in args.backward:
        f, b = predicted(args.world, args.heads, args.dim, N, hw), predicted_backward(args.world, args.heads, args.dim, N, hw)
        print(f"  N={N}: predicted ring forward + backward {(f.seconds + b.seconds) * 1e3:.2f} ms (backward "
              f"{b.seconds * 1e3:.2f} ms, its link {b.link_seconds * 1e3:.3f} ms, bandwidth-bound {b.bandwidth_bound})",
              flush=True)


def init_distributed():
    """Bind this process to its GPU (``LOCAL_RANK``) before the process group exists, so that
    NCCL's communicator is created on it (``device_id`` where torch takes it)."""
    import inspect
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    kw = {"device_id": torch.device("cuda", local)} \
        if "device_id" in inspect.signature(dist.init_process_group).parameters else {}
    import datetime
    # a rank stuck in a collective the others never reach fails after 5 minutes, not the default 10
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5), **kw)
    return dist.get_rank(), dist.get_world_size()


def longest(run, fits, start, max_n, max_seconds):
    """Largest N (doubling from ``start``) that runs, stopping before one that would not fit in
    memory (checked on every rank first, so that no rank fails alone inside a collective), at an
    out-of-memory error, or when the next call would pass ``max_seconds`` (time grows as N^2)."""
    best, n, last = None, start, None
    while n <= max_n:
        if last is not None and last * 4 / 1e3 > max_seconds:
            return best, "time budget"
        if not fits(n):
            return best, "memory (predicted)"
        try:
            last = run(n)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            return best, "out of memory"
        best, n = n, n * 2
    return best, "max N"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--strong", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--weak", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--max-n", type=int, default=1 << 20)
    ap.add_argument("--max-seconds", type=float, default=20.0)
    ap.add_argument("--no-longest", action="store_true", help="skip the longest-N probe")
    ap.add_argument("--causal", action="store_true", help="causal attention (skipped and unmasked blocks)")
    ap.add_argument("--zigzag", action="store_true", help="zig-zag layout over the devices (causal balance)")
    ap.add_argument("--check-only", action="store_true", help="check correctness on every rank, then stop")
    ap.add_argument("--quick-check", action="store_true",
                    help="check at the small size only (each size compiles kernels: ~25 s apiece)")
    ap.add_argument("--plan", action="store_true", help="print the plan and predictions on the CPU, then stop")
    ap.add_argument("--world", type=int, default=2, help="devices assumed by --plan")
    ap.add_argument("--hw", choices=("H100", "H200"), default="H200", help="profile assumed by --plan")
    ap.add_argument("--backward", type=int, nargs="*", default=[], help="N at which to time forward + backward")
    ap.add_argument("--backward-only", action="store_true", help="check and time only the forward + backward rows")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="f16",
                    help="the shards' dtype: f16 / bf16 run tensor-core kernels (fp32 partials), f32 fp32 ones")
    ap.add_argument("--out", default=str(Path(__file__).with_name("multi_gpu.json")))
    args = ap.parse_args()
    OPTS.update(causal=args.causal, order="zigzag" if args.zigzag else "contiguous", dtype=DTYPES[args.dtype])
    if args.plan:
        plan_only(args)
        return

    rank, world = init_distributed()
    print(f"rank {rank}/{world}: {torch.cuda.get_device_name()} (cuda:{torch.cuda.current_device()})", flush=True)
    hw = nc.hardware.H200 if "H200" in torch.cuda.get_device_name() else nc.hardware.H100
    H, D = args.heads, args.dim
    res = {"device": torch.cuda.get_device_name(), "world": world, "heads": H, "d": D, "reps": args.reps,
           "profile": hw.name, "link_bandwidth": hw.link_bandwidth, "link_latency": hw.link_latency,
           "causal": args.causal, "layout": OPTS["order"], "dtype": args.dtype,
           "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}

    log(rank, f"checking correctness on {world} x {res['device']} ({'causal' if args.causal else 'full'}, "
              f"{OPTS['order']}) ...")
    # sizes that split into 2 x world chunks of whole 64-row tiles (zig-zag) and one that does not fill them
    res["check"] = []
    checks = ((2, 128 * world), (3, 1000 * world if not args.zigzag else 1000 * 2 * world))
    for H_, N_ in checks[:1] if args.quick_check else checks:
        res["check"].append(check(rank, world, H_, D, N_))
        save(rank, args.out, res)
        c = res["check"][-1]
        log(rank, f"  N={N_}: ring vs f64 {c['max_err_ring_vs_f64']:.1e}, 1 GPU vs f64 "
                  f"{c['max_err_single_vs_f64']:.1e}, blocks {c['blocks']} -> {'ok' if c['ok'] else 'FAILED'}")
    if args.backward:
        res["check_backward"] = check_backward(rank, world, 2, D, 128 * world)
        save(rank, args.out, res)
        c = res["check_backward"]
        log(rank, f"  backward N={c['N']}: dQ, dK, dV vs f64 {', '.join(f'{e:.1e}' for e in c['max_rel_err_dQ_dK_dV'])} "
                  f"({c['path']}) -> {'ok' if c['ok'] else 'FAILED'}")
        res["check"].append({**c, "max_err_ring_vs_f64": max(c["max_rel_err_dQ_dK_dV"]),
                             "max_err_single_vs_f64": 0.0, "max_err_ring_vs_single": 0.0})
    if not all(c["ok"] for c in res["check"]):
        log(rank, "FAILED correctness:", json.dumps(res["check"], indent=1))
        dist.destroy_process_group()
        sys.exit(1)
    if args.check_only:
        log(rank, "check only: done")
        dist.destroy_process_group()
        return

    run = Runner(rank, world, H, D, args.reps)
    res["backward"] = []
    for N in args.backward:
        log(rank, f"  forward + backward N={N}: one GPU ...")
        t1 = run.single_fwd_bwd(N)
        log(rank, f"  forward + backward N={N}: ring ...")
        tr, tp = run.ring_fwd_bwd(N), run.single_fwd_bwd(N, peer=True)
        f, b = predicted(world, H, D, N, hw), predicted_backward(world, H, D, N, hw)
        res["backward"].append({"N": N, "one_gpu_ms": t1, "ring_ms": tr, "speedup": t1 / tr, "sdpa_one_gpu_ms": tp,
                                "predicted_ring_ms": (f.seconds + b.seconds) * 1e3,
                                "predicted_backward_link_ms": b.link_seconds * 1e3,
                                "predicted_bandwidth_bound": b.bandwidth_bound})
        log(rank, f"  forward + backward N={N}: 1 GPU {t1:.2f} ms, ring {tr:.2f} ms "
                  f"(predicted {(f.seconds + b.seconds) * 1e3:.2f})")
        save(rank, args.out, res)
    res["strong"] = []
    for N in ([] if args.backward_only else args.strong):
        log(rank, f"  strong N={N}: one GPU (compiles its kernels on the first call) ...")
        t1 = run.single(N)
        log(rank, f"  strong N={N}: ring ...")
        tr, tp = run.ring(N), run.single(N, peer=True)
        p = predicted(world, H, D, N, hw)
        link = run.link_only(N)
        res["strong"].append({"N": N, "one_gpu_ms": t1, "ring_ms": tr, "speedup": t1 / tr, "sdpa_one_gpu_ms": tp,
                              "efficiency": t1 / tr / world, "link_only_ms": link,
                              "predicted_link_ms": p.link_seconds * 1e3, "predicted_ring_ms": p.seconds * 1e3,
                              "predicted_bandwidth_bound": p.bandwidth_bound})
        log(rank, f"  strong N={N}: 1 GPU {t1:.2f} ms, ring {tr:.2f} ms, link {link:.3f} ms "
                  f"(predicted {p.link_seconds * 1e3:.3f})")
        save(rank, args.out, res)
    res["weak"] = []
    for N in ([] if args.backward_only else args.weak):
        # N grows with the GPUs (each holds N rows, as one GPU does): each GPU computes world
        # times the blocks one GPU does, so the ideal ring time is world * t1
        N2 = N * world
        t1, tr = run.single(N), run.ring(N2)
        p = predicted(world, H, D, N2, hw)
        res["weak"].append({"N_one": N, "N_ring": N2, "one_gpu_ms": t1, "ring_ms": tr,
                            "efficiency": world * t1 / tr, "predicted_ring_ms": p.seconds * 1e3})
        save(rank, args.out, res)
        log(rank, f"  weak N={N} -> {N2}: 1 GPU {t1:.2f} ms, ring {tr:.2f} ms")
    if not args.no_longest and not args.backward_only:
        start = args.strong[-1]
        n1, why1 = longest(run.single, lambda n: run.fits(n, False), start, args.max_n, args.max_seconds)
        n2, why2 = longest(run.ring, lambda n: run.fits(n, True), start, args.max_n, args.max_seconds)
        res["longest"] = {"one_gpu": n1, "one_gpu_stop": why1, "ring": n2, "ring_stop": why2,
                          "max_seconds": args.max_seconds}
    if rank == 0:
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(f"\nring attention, {world} x {res['device']}, {args.dtype}, H={H}, d={D} (JSON: {args.out})")
        c = res["check"][0]
        print(f"correct: ring vs f64 {c['max_err_ring_vs_f64']:.1e}, ring vs 1 GPU {c['max_err_ring_vs_single']:.1e}")
        print(f"{'N':>7} {'1 GPU ms':>9} {'SDPA ms':>8} {'ring ms':>9} {'speedup':>8} {'link ms':>8} {'pred link':>9} "
              f"{'pred ring':>9} {'bw-bound':>8}")
        for r in res["strong"]:
            print(f"{r['N']:>7} {r['one_gpu_ms']:>9.2f} {r['sdpa_one_gpu_ms']:>8.2f} {r['ring_ms']:>9.2f} {r['speedup']:>8.2f} "
                  f"{r['link_only_ms']:>8.3f} {r['predicted_link_ms']:>9.3f} {r['predicted_ring_ms']:>9.2f} "
                  f"{str(r['predicted_bandwidth_bound']):>8}")
        for r in res["backward"]:
            print(f"forward + backward N={r['N']}: 1 GPU {r['one_gpu_ms']:.2f} ms (SDPA {r['sdpa_one_gpu_ms']:.2f}), ring {r['ring_ms']:.2f} ms "
                  f"(speedup {r['speedup']:.2f}; predicted ring {r['predicted_ring_ms']:.2f} ms)")
        for r in res["weak"]:
            print(f"weak: 1 GPU N={r['N_one']} {r['one_gpu_ms']:.2f} ms, ring N={r['N_ring']} "
                  f"{r['ring_ms']:.2f} ms (predicted {r['predicted_ring_ms']:.2f}), efficiency {r['efficiency']:.2f}")
        if "longest" in res:
            lg = res["longest"]
            print(f"longest N within {lg['max_seconds']} s: 1 GPU {lg['one_gpu']} ({lg['one_gpu_stop']}), "
                  f"ring {lg['ring']} ({lg['ring_stop']})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
