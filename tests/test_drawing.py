"""Drawing: every library diagram draws, to SVG and PNG, with every axis labelled."""

import dataclasses
import re

import pytest

import napkin_cat as nc
from napkin_cat import drawing, ops
from napkin_cat.core import Array, Box, Diagram, Ty
from napkin_cat.drawing import layout as drawing_layout
from napkin_cat.drawing import styles
from napkin_cat.ops.kinds import SPECS

L = nc.library
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _library():
    h, g, b = nc.Axis("h"), nc.Axis("g"), nc.Axis("b")
    return {
        "matmul": L.matmul(),
        "matmul_sized": L.matmul(a=64, b=32, c=16),
        "batched_matmul": L.batched_matmul(),
        "linear": L.linear(),
        "linear_plain": L.linear(bias=False, activation=None),
        "mlp": L.mlp(),
        "softmax": L.softmax(),
        "layernorm": L.layernorm(),
        "rmsnorm": L.rmsnorm(),
        "attention": L.attention(),
        "attention_heads": L.attention(heads=h),
        "attention_gqa": L.attention(heads=h, groups=g),
        "attention_batch": L.attention(batch=b),
        "attention_causal": L.attention(causal=True),
        "attention_bias": L.attention(bias="input"),
        "attention_everything": L.attention(heads=h, groups=g, batch=b, causal=True, bias="input"),
        "attention_alibi_window": L.attention(bias=nc.alibi(0.5), window_size=4),
        "multihead_attention": L.multihead_attention(),
        "normalized_attention": L.normalized_attention(),
        "normalized_attention_heads": L.normalized_attention(heads=h, kind="softmax"),
    }


LIBRARY = _library()


def _svg_text(svg: str) -> str:
    """The strings inside the SVG's <text> elements (labels are kept as text, not paths)."""
    return " ".join(re.findall(r"<text[^>]*>([^<]*)</text>", svg))


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_library_diagram_draws_to_svg_and_png(name, tmp_path):
    d = LIBRARY[name]
    svg_path, png_path = tmp_path / f"{name}.svg", tmp_path / f"{name}.png"
    drawing.draw(d, str(svg_path), title=name)
    d.draw(str(png_path))
    assert svg_path.stat().st_size > 0 and "<svg" in svg_path.read_text()
    png = png_path.read_bytes()
    assert png.startswith(PNG_MAGIC)


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_to_svg_labels_every_axis(name):
    d = LIBRARY[name]
    svg = drawing.to_svg(d)
    assert "<svg" in svg
    labels = _svg_text(svg).split()
    for ax in d.axes:
        assert any(lab == ax.name or lab.startswith(ax.name + "=") for lab in labels), ax.name
    for arr in d.var_types():
        assert arr.name in labels


def test_repr_svg_is_to_svg():
    d = L.softmax()
    assert d._repr_svg_() == drawing.to_svg(d)


def test_copy_and_discard_draw(tmp_path):
    q, d_ = nc.axes("q d")
    A = Array((q, d_), nc.f32, "A")
    B = Array((q,), nc.f16, "B")
    mm = L.matmul()
    cases = [
        Diagram.copy(A, 3),
        Diagram.discard(Ty(A, B)),
        Diagram.swap(A, B),
        Diagram.id(Ty()),
        mm >> Diagram.copy(mm.cod[0]),
        (mm @ Diagram.id(A)) >> (Diagram.id(mm.cod) @ Diagram.discard(A)),
        L.matmul() @ L.softmax(),
    ]
    for k, d in enumerate(cases):
        path = tmp_path / f"wiring{k}.png"
        drawing.draw(d, str(path))
        assert path.read_bytes().startswith(PNG_MAGIC)
        assert "<svg" in drawing.to_svg(d)


def test_every_box_kind_draws():
    q, x, d = nc.axes("q x d", d=8)
    g = ops.Builder()
    X = g.input("X", q, d)
    W = g.param("W", d, x)
    one = g.const(1.0, x, name="one")
    Y = g.map("add", g.contract(X, W, out=(q, x), name="Y"), one)
    Y = g.cast(g.transpose(g.mask(Y, q, x, nc.causal()), x, q), nc.f16)
    S = g.box(ops.split_box(g.ty(X), d, nc.Axis("d1", 2), nc.Axis("d2", 4)), X)
    R = g.reduce("max", g.map("mul", X, X), d)
    diagram = g.diagram(Y, S, R)
    text = _svg_text(drawing.to_svg(diagram)).split()
    for label in ("W", "one", "d1=2", "d2=4", "transpose", "max[d]"):
        assert label in text


def test_schedule_marks_tiles_and_streams():
    d = dataclasses.replace(L.attention(), schedule=(nc.Relabel("tile", "q", 32, "SMEM"),
                                                     nc.Relabel("stream", "x", 16, "SMEM")))
    svg = drawing.to_svg(d)
    text = _svg_text(svg)
    assert "stream" in text and "tile" in text
    assert "q→g_q" in text and "x→s_x" in text
    assert drawing.LEVEL_COLOURS["SMEM"] in svg


def test_levels_colour_wires():
    d = L.attention()
    svg = drawing.to_svg(d, levels={"Q": "registers", 5: "L2", "K": "#123456"})
    for colour in (drawing.LEVEL_COLOURS["registers"], drawing.LEVEL_COLOURS["L2"], "#123456"):
        assert colour in svg


def test_place_colours_one_array():
    d = dataclasses.replace(L.matmul(), schedule=(nc.Relabel("place", "A", None, "registers"),))
    svg = drawing.to_svg(d)
    assert drawing.LEVEL_COLOURS["registers"] in svg


def test_weaved_axes():
    h = nc.Axis("h")
    assert drawing.weaved_axes(L.attention(heads=h)) == ("h", "q")
    assert drawing.weaved_axes(L.attention(heads=h, causal=True)) == ("h",)  # the mask reads q
    assert drawing.weaved_axes(L.layernorm()) == ("t",)
    assert drawing.weaved_axes(Diagram.copy(Array((h,)))) == ()
    assert "weaved over h" in _svg_text(drawing.to_svg(L.attention(heads=h, causal=True)))
    assert "weaved over" not in _svg_text(drawing.to_svg(L.attention(heads=h), weaved=()))


def test_draw_into_given_axes():
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot()
    assert drawing.draw(L.softmax(), ax=ax) is fig


def test_layout_keeps_items_apart():
    """Items of a column never overlap, so wires and labels of different arrays cannot."""
    for d in LIBRARY.values():
        lay = drawing_layout.layout(d)
        for col in lay.columns:
            spans = sorted((it.top, it.top + it.height) for it in col)
            for (_, end), (start, _) in zip(spans, spans[1:]):
                assert start >= end + styles.GAP - 1e-9


def test_kind_styles_cover_every_kind():
    """One box style per kind of ops.kinds.SPECS, and no style for a kind that does not exist."""
    assert set(drawing.KIND_STYLES) == set(SPECS)
    for kind, style in drawing.KIND_STYLES.items():
        assert style.outline in ("round", "square", "dashed", "trapezoid"), kind


def test_unknown_kind_is_refused_by_name():
    A = Array((nc.Axis("q"),), nc.f32, "A")
    with pytest.raises(nc.NapkinError, match="frobnicate"):
        drawing.to_svg(Box("frobnicate", Ty(A), Ty(A)).diagram())


def test_intermediates_have_their_own_names():
    """No two wires of a picture carry one name: a box's output named like an input, an output
    or an earlier intermediate gets primes; inputs and outputs keep theirs."""
    assert drawing_layout.display_names(L.attention()) == ("Q", "K", "V", "S", "S′", "P", "O")
    assert drawing_layout.display_names(L.rmsnorm()) == ("X", "gamma", "X′", "ms", "ms′", "ms″", "X″", "Y")
    for name, d in LIBRARY.items():
        names = drawing_layout.display_names(d)
        inner = [names[v] for v in range(len(d.dom), len(names)) if v not in d.outs]
        ends = {names[v] for v in range(len(d.dom))} | {names[v] for v in d.outs}
        assert len(set(inner)) == len(inner) and not set(inner) & ends, name
    text = _svg_text(drawing.to_svg(L.rmsnorm())).split()
    assert "X′" in text and "X″" in text


def test_legend_explains_the_symbols_drawn():
    text = _svg_text(drawing.to_svg(L.attention()))
    for meaning in ("weaved axis", "summed or reduced axis", "axis normalised along"):
        assert meaning in text
    assert "index read" not in text and "copied wire" not in text   # only what the picture uses
    text = _svg_text(drawing.to_svg(L.attention(causal=True)))
    assert "index read (mask, bias)" in text
    mm = L.matmul()
    text = _svg_text(drawing.to_svg(mm >> Diagram.copy(mm.cod[0])))
    assert "copied wire" in text
    text = _svg_text(drawing.to_svg(Diagram.discard(Ty(Array((nc.Axis("q"),), nc.f32, "A")))))
    assert "discarded wire" in text


def test_relabelled_legend_names_the_levels_wires_live_at():
    """FlashAttention: Q, K, V are loaded into SMEM whole (every axis), the scores live in
    registers; no wire is called HBM, the caps are (in / out of HBM)."""
    q, x, d = nc.axes("q x d")
    flash = L.attention(q=q, x=x, d=d).stream(x, "s_x").tile(q, "g_q")
    svg = drawing.to_svg(flash)
    legend = _svg_text(svg)
    assert "SMEM" in legend and "registers" in legend and "in / out of HBM" in legend
    assert drawing.LEVEL_COLOURS["HBM"] not in svg
    colours = styles.Colours(flash, {})
    for v in range(3):   # Q, K, V: every wire at SMEM, partitioned or not
        assert {colours.level(v, a.name) for a in flash.var_types()[v].axes} == {"SMEM"}
    assert colours.level(3, "q") == "registers"


def test_place_is_labelled_with_its_array_and_level():
    q, x, d = nc.axes("q x d")
    flash = L.attention(q=q, x=x, d=d).stream(x, "s_x").tile(q, "g_q").place("O", "registers")
    assert styles.schedule_text(flash) == "stream(x, s_x), tile(q, g_q), place(O, registers)"
    text = _svg_text(drawing.to_svg(flash))
    assert "place(O, registers)" in text and "place()" not in text
    assert styles.relabel_text(nc.Relabel("tile", "q", 32, "L2")) == "tile(q, 32, L2)"
    assert styles.relabel_text(nc.Relabel("require", "q", 16)) == "require(q, 16)"


def test_docs_pictures_regenerate(tmp_path):
    from napkin_cat.drawing import plots

    paths = plots.diagram_pictures(str(tmp_path))
    assert len(paths) == 8
    for p in paths:
        data = open(p, "rb").read()
        assert data.startswith(PNG_MAGIC) if p.endswith(".png") else b"<svg" in data
    assert "FlashAttention derived: stream(x, s_x), tile(q, g_q)" in open(tmp_path / "attention_relabelled.svg").read()
