"""The FlashAttention forward with its logsumexp (the backward's residual) reads the scores once:
the logsumexp is the online softmax's row statistics (``L = mu + log z``, lowering/fuse.py),
so the scores stay in registers as they do without it."""
import pytest

import napkin_cat as nc

q, x, d, h = nc.axes("q x d h")


def _lower(dtype, nq, nx, D, causal, tiles, threads):
    a = nc.library.attention(q=q, x=x, d=d, heads=h, logsumexp=True, dtype=dtype, causal=causal)
    return nc.lower(a.bind({q: nq, x: nx, d: D, h: 2}), tiles=tiles, threads=threads, verify=True)


def _reads_statistics(k):
    src = k.source
    return "O_mu_s" in src and "logsumexp over chunks" not in src and "with S in registers" in src


def test_logsumexp_from_online_softmax_statistics_matches_oracle_fp32():
    k = _lower(nc.f32, 21, 29, 8, True, {"q": 16, "x": 8}, 64)
    assert k.verified and _reads_statistics(k), k.source[:2000]


@pytest.mark.slow
@pytest.mark.parametrize("dtype,causal", [(nc.f16, False), (nc.bf16, True)])
def test_logsumexp_from_online_softmax_statistics_on_tensor_cores(dtype, causal):
    k = _lower(dtype, 40, 37, 16, causal, {"q": 32, "x": 16}, 64)
    assert k.verified and _reads_statistics(k)
    assert "mma_" in k.source and "weights stay in registers" in k.source
