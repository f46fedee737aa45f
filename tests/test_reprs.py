"""Notebook views: equivalence reports, derivations and final forms render as self-contained,
escaped HTML (``_repr_html_``)."""

import dataclasses
import re

import pytest

import napkin_cat as nc
import napkin_cat.drawing  # noqa: F401  (registers the final form's HTML table)
from napkin_cat.relabel.loopnest import final_form
from napkin_cat.verify.check import EquivalenceReport
from napkin_cat.verify.derive import Derivation, Step

q, x, d = nc.axes("q x d")
ATTN = nc.library.attention(q=q, x=x, d=d)


def _self_contained(html: str) -> None:
    """No script, no external resource, no document prolog inside the fragment."""
    assert "<script" not in html and "<?xml" not in html and "<!DOCTYPE" not in html
    assert not re.search(r"""(src|href)=["']https?:""", html)


def _report(**kw) -> EquivalenceReport:
    base = dict(examples=7, max_abs_error=3e-15, max_rel_error=1e-15, seconds=0.5,
                sizes_tried=(("q", 1, 9),), regimes_tried=(("normal", 5), ("huge", 2)))
    return EquivalenceReport(**{**base, **kw})


def test_report_html_shows_verdict_errors_sizes_and_regimes():
    html = _report()._repr_html_()
    _self_contained(html)
    for text in ("equivalent", "7", "3e-15", "q in 1..9", "normal ×5", "huge ×2"):
        assert text in html
    assert "kernels run" not in html


def test_report_html_shows_kernels_and_escapes_refusals():
    html = _report(kernels=3, refused=("block <g_q> & more",), stopped_by_time=True)._repr_html_()
    assert "kernels run" in html and "time budget" in html
    assert "block &lt;g_q&gt; &amp; more" in html and "<g_q>" not in html


def test_derivation_html_draws_every_step_with_its_check():
    flash = ATTN.stream(x, "s_x")
    steps = (Step("stream", ("x", "s_x"), flash, True, _report()),
             Step("place", ("O", "SMEM"), flash.place("O", "SMEM"), False, None))
    der = Derivation(ATTN, steps)
    html = der._repr_html_()
    _self_contained(html)
    assert html.count("<svg") == 3                     # the original and one picture per step
    assert "1. stream(x, s_x)" in html and "2. place(O, SMEM)" in html
    assert "verified on 7 examples" in html and "not verified" in html
    assert "-&gt;" in html                             # the diagram's text, escaped
    assert der._repr_html_() == html                   # pictures are kept per diagram
    assert steps[1]._repr_html_().count("<svg") == 1


def test_derive_result_renders():
    der = nc.derive(ATTN, [("stream", x), ("tile", q)], examples=2)
    html = der._repr_html_()
    assert html.count("<svg") == 3 and html.count("✓ verified on 2 examples") == 2


def test_final_form_html_is_the_pseudocode_with_memory_columns():
    ff = final_form(ATTN.stream(x, 16).tile(q, 32))
    html = ff._repr_html_()
    _self_contained(html)
    assert "napkin-final-form" in html and "<table" in html
    for line in ff.pseudocode(memory=False).splitlines():
        assert line.replace(">", "&gt;").replace("<", "&lt;") in html
    header = re.findall(r"<th[^>]*>([^<]*)</th>", html)
    assert header == ["loop nest", "SMEM", "registers"]   # slow levels first
    assert "peak memory" in html and "<b>  for x in chunks of 16" in html   # loops in bold


@pytest.mark.parametrize("name", ["matmul", "softmax"])
def test_final_form_html_of_an_unrelabelled_diagram(name):
    html = final_form(getattr(nc.library, name)())._repr_html_()
    assert "<table" in html and "HBM" in html


def test_kernel_notebook_view_shows_launch_notes_and_source():
    import napkin_cat as nc
    q, x, d = nc.axes("q x d")
    k = nc.lower(nc.library.attention(q=q, x=x, d=d).bind({q: 6, x: 5, d: 4}), threads=32)
    html = k._repr_html_()
    assert f"kernel {k.name}" in html and str(k.launch.grid) in html and "verified against the oracle" in html
    assert "<details><summary>source (" in html
    assert k.notes and all(n.split()[0] in html for n in k.notes)
