"""HBM bytes predicted with an L2 level: blocks resident at once share L2, modelled as an
L2-level tile of the axes their grid covers (``nc.cost`` of the relabelled diagram).

Run: ``PYTHONPATH=. python kernels/l2_model.py`` (CPU only); compares with the Nsight Compute DRAM bytes
recorded in kernels/BENCHMARKS.md for the same kernels.
"""

import napkin_cat as nc

MB = 1e6


def attention_prediction(n=4096, d_=64, b_=2, h_=8, q_tile=256, x_chunk=64):
    q, x, d, h, b = nc.axes("q x d h b")
    attn = nc.library.attention(q=q, x=x, d=d, heads=h, batch=b)
    # the grid runs every query tile of a head together; a wave of resident blocks spans whole
    # heads, so each head's K and V are staged in L2 once (one head per L2 group, the smallest)
    f = (attn.tile(b, 1, level="L2").tile(h, 1, level="L2")
         .tile(b, 1).tile(h, 1).stream(x, x_chunk).tile(q, q_tile))
    c = nc.cost(f).subs({q: n, x: n, d: d_, h: h_, b: b_})
    reads = sum(float(m.values) * 4 for m in c.moves
                if m.kind == "load" and m.upper == "HBM")
    writes = sum(float(m.values) * 4 for m in c.moves
                 if m.kind == "store" and m.upper == "HBM")
    return reads, writes


if __name__ == "__main__":
    r, w = attention_prediction()
    print(f"attention N=4096 d=64 B*H=16: predicted HBM read {r / MB:.1f} MB, write {w / MB:.1f} MB")
