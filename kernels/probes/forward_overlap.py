"""Probe: FlashAttention-3's overlap inside one warpgroup, for the attention forward that
``nc.torch_op`` runs on warpgroups with a copying warpgroup.  A measurement to decide whether to
build software pipelining of the stream loop into the code generator, not a feature: the generated
forward's source is rewritten here, by text, then checked against float64 and timed against the
generated kernel and FlexAttention in turns.

The rewrite (on top of ``forward_stages.three_buffers``, so that a buffer held one chunk longer
does not hold up the copies): chunk c's scores ``S_c = Q K_c^T`` are issued, then chunk c - 1's
update ``O += P_{c-1} V_{c-1}`` behind them, and the warpgroup waits for ``S_c`` alone
(``wgmma.wait_group 1``); chunk c's softmax then runs while the update multiplies.  Only after the
update has landed is ``O`` rescaled by chunk c's ``exp(m_{c-1} - m_c)``, and chunk c - 1's buffers
released.  An earlier probe of the same schedule on two buffers (``wgmma_decoupled.py``, H100,
d = 64) was slower, because the held V buffer made the copies of the next chunk wait.

Why (``kernels/logs/ncu_forward_source_h200_d128.txt``): 11.4% and 6.1% of the computing warps'
samples in the stream loop wait for the S and O contractions, each waited for to depth 0, and the
forward is 0.66x FlexAttention at d = 128.

The rewrite knows the shape of the generated forward (its consumer loop: the landed wait, the S
contraction, the softmax that rescales ``O_o``, the update whose A operand is packed from
``S_regs``, the release) and asserts every pattern it moves, so a change of the generator stops it
rather than measuring something else.  GPU only (the simulator check is in
``tests/test_forward_stages_probe.py``).

    NUMBA_ENABLE_CUDASIM=0 python3 kernels/probes/forward_overlap.py --case f16,4096,128,0 --rounds 7

Mode ``turns`` (session of 2026-11-30): the overlap with the computing warpgroups in turns,
FlashAttention-3's ping-pong (:func:`overlap` with ``groups``); modes ``sturns`` / ``swturns``:
turns around the scores' issue / issue and wait alone, without the overlap (:func:`score_turns`).
Measured: 10% faster at d = 64, slower at d = 128 (kernels/BENCHMARKS.md).
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from forward_stages import checked, edited, forward_key, three_buffers, time_forwards  # noqa: E402  (which puts the project on the path)

LOOP = "\n    for x0 in range(U0, N_x, CHUNK_x):\n"


def _one(pattern: str, text: str, flags=re.M | re.S) -> re.Match:
    found = list(re.finditer(pattern, text, flags))
    assert len(found) == 1, f"{pattern!r}: {len(found)} matches, expected 1"
    return found[0]


def _cut(body: str, start: str, end: str | None) -> str:
    """The lines of ``body`` from the one that starts with ``start`` up to the one before ``end``."""
    i = _one(rf"^{re.escape(start)}", body).start()
    j = _one(rf"^{re.escape(end)}", body).start() if end else len(body)
    assert i < j, (start, end)
    return body[i:j]


def _indent(text: str, by: int) -> str:
    return "".join((" " * by + ln if ln.strip() else ln) for ln in text.splitlines(keepends=True))


def turn_ids(groups: int, buffers: int = 3) -> list[int]:
    """Named barriers for the warpgroups' turns: those above the ``buffers`` chunk buffers' landed
    and released barriers (``2 + b W + w``, ``2 + buffers W + b``), and barrier 1 (the computing
    threads', used inside the loop only by the simulator's reductions, whose barriers it keys by
    count too) where 16 run short."""
    free = list(range(2 + buffers * groups + buffers, 16))
    ids = (free if len(free) >= groups else [1] + free)[:groups]
    assert len(ids) == groups, (groups, ids)
    return ids


def _turns(groups: int, ids: list[int] | None = None) -> tuple[str, str, str, str, str]:
    """Code of the warpgroups' turns (FlashAttention-3's ping-pong) on barriers ``ids`` (default
    :func:`turn_ids`): the names of this warpgroup's barrier and the next one's, set once, with
    warpgroup 0's first turn; the wait for this warpgroup's turn; the hand-over; after the loop,
    warpgroup 0's wait for the last warpgroup's last hand-over.  The hand-over is not in a branch:
    it falls between a contraction's commit and its wait, and a branch there (the last warpgroup
    skipping its last hand-over) gave wrong scores on the H200 at d = 64 (right in the simulator)."""
    ids = ids or turn_ids(groups)
    pick = "wg_turn = tid // U128\n"
    for name, order in (("turn_me", ids), ("turn_next", ids[1:] + ids[:1])):
        pick += f"{name} = uint32({order[0]})\n" + "".join(
            f"if wg_turn == uint32({w}):\n    {name} = uint32({b})\n" for w, b in enumerate(order) if w)
    first = (f"if wg_turn == uint32({groups - 1}):  # the first turn is warpgroup 0's\n"
             f"    bar_arrive(uint32({ids[0]}), uint32(256))\n")
    wait = "bar_named(turn_me, uint32(256))  # this warpgroup's turn to issue its contractions\n"
    hand = "bar_arrive(turn_next, uint32(256))  # the next warpgroup's turn\n"
    last = (f"if wg_turn == U0:  # the last warpgroup's last hand-over, waited for\n"
            f"    bar_named(uint32({ids[0]}), uint32(256))\n")
    return pick, first, wait, hand, last


def overlap(source: str, groups: int | None = None) -> str:
    """``source`` (a forward rewritten to three buffers) with chunk c's softmax beside chunk c - 1's
    update; with ``groups`` (its computing warpgroups), also in turns: each warpgroup issues its two
    contractions only after the previous warpgroup issued its own, so that one's softmax runs while
    the others multiply (FlashAttention-3's ping-pong, generalised to ``groups`` warpgroups)."""
    assert source.count(LOOP) == 1, "one stream loop at the kernel's top level"
    head, rest = source.split(LOOP, 1)
    head += "\n"
    assert "setmaxnreg_inc_" in head, "the loop rewritten is the computing warpgroups'"
    end = re.search(r"^    \S", rest, re.M).start()
    body = "".join(ln[8:] if ln.strip() else ln for ln in rest[:end].splitlines(keepends=True))
    tail = rest[end:]
    cur = _cut(body, "K_s_cur = ", "if x0 > U0:")
    landed = _one(r"^if x0 > U0:[^\n]*\n    (bar_named\([^\n]*\n)", body)[1]
    s_all = _cut(body, "# update O (online_softmax) with S", "# S = ")
    s_issue, s_wait = s_all.split("wgmma_commit()\n", 1)
    s_issue += "wgmma_commit()\n"
    width = _one(r"\AS_regs_wg = wgmma_wait_n(\d+)\(S_regs_wg\)\n", s_wait)[1]   # the key chunk
    s_unpack = s_wait.split("\n", 1)[1]
    softmax = _cut(body, "# S = ", "# update O: o += weights")
    rescale = _one(r"^(    )for j in range\((U\d+)\):\n\1    O_o\[i, j\] \*= delta\n", softmax)
    softmax_later = softmax.replace(rescale[0], "    O_delta[i] = delta  # O is rescaled once its update has landed\n")
    pv_all = _cut(body, "# update O: o += weights", "x_next = x0 + CHUNK_x")
    packs = "".join(re.findall(r"^a\w+ = pack_f16\([^\n]*\n", pv_all, re.M))
    assert packs.count("\n") in (8, 16, 32, 64), packs
    pv = "".join(ln for ln in pv_all.splitlines(keepends=True) if ln not in packs.splitlines(keepends=True))
    pv_issue, pv_wait = pv.split("wgmma_commit()\n", 1)
    pv_issue = pv_issue.replace("V_s_cur", "V_s_prev") + "wgmma_commit()\n"
    assert re.match(r"O_o_wg = wgmma_wait_n\d+\(O_o_wg\)\n", pv_wait), pv_wait[:80]
    release = _one(r"^if x_next \+ CHUNK_x \+ CHUNK_x < N_x:\n    (bar_arrive\(uint32\(\d+\) \+ )buf_x(, \w+\)[^\n]*\n)", body)
    assert _one(r"^buf_x = \(buf_x \+ U1\) % U3\n", body)
    advance = "V_s_prev = V_s_cur\nbuf_prev = buf_x\nbuf_x = (buf_x + U1) % U3\n"
    rows = _one(r"^    O_mu = cuda\.local\.array\((\d+), float32\)\n", head)[1]   # rows per thread
    o_rescale = f"for i in range(U{rows}):\n    for j in range({rescale[2]}):\n        O_o[i, j] *= O_delta[i]\n"
    assert f"O_o = cuda.local.array(({rows}, " in head, "O_o: rows per thread x columns"
    pick, first, wait, hand, last = _turns(groups) if groups else ("", "", "", "", "")
    prologue = ("# chunk 0 (landed at the barrier above): its scores and softmax; its update is issued in the loop\n"
                f"O_delta = cuda.local.array({rows}, float32)\n" + pick + cur + s_all + softmax + packs + advance + first)
    loop = ("# chunk c: S_c issued, then chunk c - 1's update behind it; S_c waited for alone, its softmax\n"
            "# runs while the update multiplies; then O rescaled and chunk c - 1's buffers released\n"
            "for x0 in range(CHUNK_x, N_x, CHUNK_x):\n"
            + _indent(cur + landed + wait + s_issue + pv_issue + hand + f"S_regs_wg = wgmma_wait1_n{width}(S_regs_wg)\n" + s_unpack
                      + softmax_later + pv_wait
                      + "fence_proxy_async()  # chunk c - 1's reads are done\n"
                      + "if x0 + CHUNK_x + CHUNK_x < N_x:  # chunk c - 1's buffer is refilled with chunk c + 2\n"
                      + "    " + release[1] + "buf_prev" + release[2] + o_rescale + packs + advance, 4))
    epilogue = "# the last chunk's update\n" + pv_issue + pv_wait + last
    return head + _indent(prologue + loop + epilogue, 4) + tail


def score_turns(source: str, groups: int, through_wait: bool) -> str:
    """``source`` (the generated forward, two buffers, no overlap) with the warpgroups in turns
    around their score contraction alone: each issues ``S = Q K^T`` only after the previous one
    issued its own (``through_wait``: after the previous one's scores have landed), and hands the
    turn on after its commit (after its wait).  The update ``O += P V`` is issued outside the
    turns.  What the turns give without the overlap's three buffers and reordered loop."""
    assert source.count(LOOP) == 1, "one stream loop at the kernel's top level: the computing warpgroups'"
    head, rest = source.split(LOOP)
    end = re.search(r"^    \S", rest, re.M).start()
    body, tail = rest[:end], rest[end:]
    pick, first, wait, hand, last = _turns(groups, turn_ids(groups, buffers=2))
    issue = _one(r"^        K_s_desc = wgmma_desc16\(", body).start()
    body = body[:issue] + _indent(wait, 8) + body[issue:]
    after = list(re.finditer(r"^        wgmma_commit\(\)\n", body, re.M))[0]   # the scores' (the update's follows)
    if through_wait:   # the last of the score fragments' waits
        after = list(re.finditer(r"^        S_regs_wg\d* = wgmma_wait_n\d+\(S_regs_wg\d*\)\n(        S_regs\[[^\n]*\n)?",
                                 body, re.M))[-1]
    body = body[:after.end()] + _indent(hand, 8) + body[after.end():]
    assert "setmaxnreg_inc_" in head, "the loop rewritten is the computing warpgroups'"
    return head + "\n" + _indent(pick + first, 4) + LOOP.lstrip("\n") + body + _indent(last, 4) + tail


def rewritten(kernel, groups: int, turns: bool = False):
    """A copy of ``kernel`` (the generated forward) with three buffers and the overlap (in turns)."""
    source, extra = three_buffers(kernel.source, groups)
    return edited(kernel, overlap(source, groups if turns else None), extra)


def main():
    import napkin_cat as nc
    from op_forms import build, case_args, case_tensors, tunables_of
    ap = case_args(rounds=7)
    ap.add_argument("--form", action="append", default=[],
                    help="NAME=SPEC[:MODE] (SPEC: op_forms' tunables; MODE, ';'-separated: block symbols and threads "
                         "to lower the forward again with, 'overlap' to rewrite it, 'turns' for the overlap in turns, "
                         "'sturns' / 'swturns' for turns around the scores' issue / issue and wait alone)")
    args = ap.parse_args()
    causal, Q, K, V, dO, want = case_tensors(args)
    ops = {}
    for form in args.form or ["default=", "overlap=:overlap"]:
        name, spec = form.split("=", 1)
        spec, _, mode = spec.partition(":")
        op, _, _ = build(spec, causal, Q, K, V, dO)
        key = forward_key(op)
        tokens = [t for t in mode.split(";") if t]
        given = dict(t.split("=") for t in tokens if "=" in t)
        if given:    # the forward lowered again at other blocks: ":g_q=256;threads=512"
            threads = int(given.pop("threads")) if "threads" in given else None
            with tunables_of(spec):                    # as build() planned the op
                op._cache[key] = nc.lower(op._cache[("bound",) + key[1:3]], tiles={k: int(v) for k, v in given.items()},
                                          threads=threads, prefetch=op.prefetch, verify=False)
            print(f"{name}: {op._cache[key].launch}", flush=True)
        if "sturns" in tokens or "swturns" in tokens:
            kern = op._cache[key]
            op._cache[key] = edited(kern, score_turns(kern.source, kern.launch.block[0] // 128 - 1, "swturns" in tokens))
        elif "overlap" in tokens or "turns" in tokens:
            kern = op._cache[key]
            op._cache[key] = rewritten(kern, kern.launch.block[0] // 128 - 1, turns="turns" in tokens)
        ops[name] = checked(f"{name} ({spec or 'defaults'}{', ' + mode if mode else ''})", op, Q, K, V, dO, want)
    del want
    time_forwards(ops, args, Q, K, V, dO, causal, kernels=1)


if __name__ == "__main__":
    main()
