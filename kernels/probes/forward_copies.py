"""Probe: where the d = 128 attention forward that ``nc.torch_op`` runs on warpgroups loses its
time to the copies.  A measurement, not a feature: the generated forward's source is rewritten
here, by text, then (where the rewrite keeps the mathematics) checked against float64 and timed
against the generated kernel and FlexAttention in turns (``forward_overlap.py``'s harness).

Modes (``;``-separated after the form's ``:``, with ``g_q=..;s_x=..;threads=..`` to lower again):

- ``qfirst``: the blocks of one head launched next to each other (the block index's query tile
  varies fastest, as FlexAttention's grid does) instead of the heads varying fastest, so that the
  blocks on the GPU at once share their keys and values in L2.  Checked.
- ``inflight``: three chunk buffers (``forward_stages.three_buffers``) and the copies of two chunks
  in flight: the copying warpgroup issues chunk c + 2's copies before it waits for chunk c + 1's
  (``cp.async.wait_group 1``) and hands that one over, instead of waiting for each chunk's copies
  before it issues the next.  Checked.  What the generator itself emits since this session
  (``producer.STAGES``): the rewrite needs the two-buffer forward (``STAGES=2`` in the form).
- ``nocopy``: the copying warpgroup skips the copies of every chunk but the first, handing over
  stale buffers.  Wrong output, not checked: the time the forward takes when the copies cost
  nothing, against which the default's wait for them is measured.

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/forward_copies.py --case f16,4096,128,0 \\
        --form default= --form qfirst=:qfirst --form nocopy=:nocopy
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from forward_stages import checked, edited, forward_key, three_buffers, time_forwards  # noqa: E402  (which puts the project on the path)

BLOCK_INDEX = ("    h0 = bx % TILES_h * TILE_h\n"
               "    bx_rest = bx // TILES_h\n")
QUERY_FIRST = ("    h0 = bx // ((N_q + TILE_q - U1) // TILE_q) * TILE_h\n"
               "    bx_rest = bx % ((N_q + TILE_q - U1) // TILE_q)\n")


def query_first(source: str) -> str:
    """``source`` with the query tile varying fastest along the block index (the heads slowest)."""
    assert source.count(BLOCK_INDEX) == 1, "the forward's block index is not the expected one"
    return source.replace(BLOCK_INDEX, QUERY_FIRST)


def no_copy(source: str) -> str:
    """``source`` with the copying warpgroup's copies inside its loop removed (its waits and
    hand-overs kept)."""
    start = source.index("        for x0 in range(U0, N_x, CHUNK_x):\n")
    end = source.index("        cuda.syncthreads()  # a barrier of the multiplying warps after the loop")
    loop = source[start:end]
    kept, n = re.subn(r"^ +cp_async16\(.*\n", "", loop, flags=re.M)
    assert n == 2, f"{n} copies in the copying warpgroup's loop, expected 2 (K and V)"
    return source[:start] + kept + source[end:]


WAIT = ("cp_async_wait_all()  # this warpgroup's copies of the chunk have landed\n",
        "fence_proxy_async()  # ... and are visible to the tensor cores\n")


def _drop_waits(block: str, indent: str) -> str:
    for line in WAIT:
        assert block.count(indent + line) == 1, (line, indent)
        block = block.replace(indent + line, "")
    return block


def _drop_hand_over(block: str, indent: str, groups: int) -> tuple[str, list[str]]:
    """``block`` without its wait for the copies and its ``groups`` arrivals; the arrivals."""
    block = _drop_waits(block, indent)
    arrives = re.findall(rf"^{indent}bar_arrive\(.*\n", block, re.M)
    assert len(arrives) == groups, arrives
    for line in arrives:
        block = block.replace(line, "")
    return block, arrives


def two_in_flight(source: str, groups: int) -> tuple[str, int]:
    """``source`` with three chunk buffers and two chunks' copies in flight; the extra shared bytes."""
    source, extra = three_buffers(source, groups)
    head, rest = source.split("if tid >= NTHREADS:", 1)
    producer, consumer = rest.split("setmaxnreg_inc_", 1)
    landed = "        cuda.syncthreads()  # chunk 0 has landed\n"
    first, after = producer.split(landed)
    first = _drop_waits(first, " " * 12)
    second, loop = after.split("        for x0 in range(U0, N_x, CHUNK_x):\n")
    second, _ = _drop_hand_over(second, " " * 12, groups)
    wait = ("        if CHUNK_x < N_x:\n            cp_async_wait1()  # chunk 0's copies have landed (chunk 1's may not)\n"
            "        else:\n            cp_async_wait_all()\n        fence_proxy_async()\n")
    producer = first + second + wait + landed + "        for x0 in range(U0, N_x, CHUNK_x):\n"
    fill, tail = loop.split("            pbuf_x = (pbuf_x + U1) % U3\n")
    fill, arrives = _drop_hand_over(fill, " " * 16, groups)
    hand = ("            if x0 + CHUNK_x < N_x:\n"
            "                if x_next2 < N_x:\n                    cp_async_wait1()  # chunk c + 1 has landed, c + 2 in flight\n"
            "                else:\n                    cp_async_wait_all()\n"
            "                fence_proxy_async()\n"
            + "".join(a.replace("((pbuf_x + U2) % U3)", "((pbuf_x + U1) % U3)") for a in arrives))
    producer += fill + hand + "            pbuf_x = (pbuf_x + U1) % U3\n" + tail
    return head + "if tid >= NTHREADS:" + producer + "setmaxnreg_inc_" + consumer, extra


def main():
    import napkin_cat as nc
    from op_forms import build, case_args, case_tensors, tunables_of
    ap = case_args(rounds=5)
    ap.add_argument("--form", action="append", default=[], help="NAME=SPEC[:MODE], MODE as the docstring says")
    args = ap.parse_args()
    causal, Q, K, V, dO, want = case_tensors(args)
    ops = {}
    for form in args.form or ["default=", "qfirst=:qfirst", "nocopy=:nocopy"]:
        name, spec = form.split("=", 1)
        spec, _, mode = spec.partition(":")
        op, _, _ = build(spec, causal, Q, K, V, dO)
        key = forward_key(op)
        tokens = [t for t in mode.split(";") if t]
        given = dict(t.split("=") for t in tokens if "=" in t)
        if given:
            threads = int(given.pop("threads")) if "threads" in given else None
            with tunables_of(spec):
                op._cache[key] = nc.lower(op._cache[("bound",) + key[1:3]], tiles={k: int(v) for k, v in given.items()},
                                          threads=threads, prefetch=op.prefetch, verify=False)
            print(f"{name}: {op._cache[key].launch}", flush=True)
        source = op._cache[key].source
        if "qfirst" in tokens:
            source = query_first(source)
        if "nocopy" in tokens:
            source = no_copy(source)
        extra = 0
        if "inflight" in tokens:
            source, extra = two_in_flight(source, op._cache[key].launch.block[0] // 128 - 1)
        if source != op._cache[key].source:
            op._cache[key] = edited(op._cache[key], source, extra)
        if "nocopy" in tokens:
            op(Q, K, V)
            print(f"{name}: not checked (its copies removed)", flush=True)
            ops[name] = op
        else:
            ops[name] = checked(f"{name} ({spec or 'defaults'}{', ' + mode if mode else ''})", op, Q, K, V, dO, want)
    del want
    time_forwards(ops, args, Q, K, V, dO, causal, kernels=1)


if __name__ == "__main__":
    main()
