"""The house, checked: stages import only earlier stages, no cycles, no long modules.

``python -m napkin_cat.imports`` prints the graph these tests read; planted violations in a
throw-away package show that the checker can fail.
"""

from __future__ import annotations

import ast
import importlib
import textwrap

import pytest

import napkin_cat as nc
from napkin_cat import imports


def test_import_graph_points_one_way_and_modules_are_short():
    text, ok = imports.report()
    print(text)
    assert ok, text


def _package(tmp_path, files: dict[str, str]):
    root = tmp_path / "napkin_cat"
    for rel, src in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(src))
    for folder in {p.parent for p in root.rglob("*.py")} | {root}:
        (folder / "__init__.py").touch()
    return root


def test_checker_finds_an_upward_arrow(tmp_path):
    root = _package(tmp_path, {"core/a.py": "from ..lowering import b\n", "lowering/b.py": "X = 1\n"})
    text, ok = imports.report(root)
    assert not ok and "upward arrow: napkin_cat.core.a (core) imports napkin_cat.lowering.b" in text


def test_checker_finds_an_arrow_between_folders_of_one_rank(tmp_path):
    root = _package(tmp_path, {"library/a.py": "def f():\n    from ..relabel import b\n", "relabel/b.py": ""})
    text, ok = imports.report(root)
    assert not ok and "napkin_cat.library.a (library) imports napkin_cat.relabel.b" in text


def test_checker_finds_a_cycle_through_a_function_level_import(tmp_path):
    root = _package(tmp_path, {"ops/a.py": "from . import b\n", "ops/b.py": "def f():\n    from .a import X\n"})
    text, ok = imports.report(root)
    assert not ok and "import cycle: napkin_cat.ops.a <-> napkin_cat.ops.b" in text


def test_checker_finds_a_long_module(tmp_path):
    root = _package(tmp_path, {"ops/a.py": "x = 1\n" * (imports.MAX_LINES + 1)})
    text, ok = imports.report(root)
    assert not ok and f"long module: napkin_cat.ops.a has {imports.MAX_LINES + 1} lines" in text


def test_core_imports_neither_numpy_nor_sympy():
    for name, path in imports.modules().items():
        if imports.stage(name) != "core":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            assert not any(m.split(".")[0] in ("numpy", "sympy", "torch", "numba") for m in mods), (name, mods)


def test_functions_do_not_shadow_their_stage_modules():
    """``nc.lower`` and ``nc.cost`` are functions; their stages are importable by path."""
    assert callable(nc.lower) and callable(nc.cost) and callable(nc.draw)
    for mod in ("napkin_cat.lowering.runtime", "napkin_cat.costmodel", "napkin_cat.drawing",
                "napkin_cat.verify.check", "napkin_cat.relabel.loopnest", "napkin_cat.ops.semantics"):
        assert importlib.import_module(mod).__name__ == mod


def test_fluent_verbs_are_registered_by_their_stages():
    from napkin_cat.core.registry import VERBS
    assert {"weave_box", "tile", "stream", "place", "require", "order", "loop_nest", "draw", "to_svg"} <= set(VERBS)
    q, x, d = nc.axes("q x d")
    att = nc.library.attention(q=q, x=x, d=d)
    r = att.stream(x, "s_x").tile(q, "g_q")
    assert r.loop_nest() is r.loop_nest(), "the final form is computed once per diagram"


@pytest.mark.parametrize("verb", ["tile", "stream", "loop_nest"])
def test_an_unregistered_verb_is_a_napkin_error(verb, monkeypatch):
    from napkin_cat.core import registry
    monkeypatch.delitem(registry.VERBS, verb)
    q, x, d = nc.axes("q x d")
    att = nc.library.attention(q=q, x=x, d=d)
    call = {"tile": lambda: att.tile(q, 4), "stream": lambda: att.stream(x, 4), "loop_nest": att.loop_nest}[verb]
    with pytest.raises(nc.NapkinError, match=verb):
        call()


def test_cli_imports_checks_the_graph(capsys):
    from napkin_cat import cli
    assert cli.main(["imports"]) == 0
    assert "no upward arrow, no cycle" in capsys.readouterr().out
