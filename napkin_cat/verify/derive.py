"""Derivations: a replayable trace of relabelings, each step verified against the original.

``derive(d, steps)`` applies the registered rules of :data:`napkin_cat.relabel.RULES` one
after the other and checks every intermediate diagram against ``d`` with
:func:`~napkin_cat.verify.check.check_equivalent`.  A step is a tuple:

``("stream", x)``, ``("stream", x, 16)``, ``("stream", x, "s_x", "SMEM")``
``("tile", q)``, ``("tile", q, "g_q", "SMEM")``       default sizes are symbols ``s_<axis>`` / ``g_<axis>``
``("place", "O", "SMEM")``    ``("require", q, 16)``    ``("order", x, b)``
``("fuse_softmax_contract", x)``, ``("fuse_norm_contract", x)``   rewrites by name

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> der = nc.derive(nc.library.attention(q=q, x=x, d=d), [("stream", x), ("tile", q)], examples=5)
>>> [(s.name, s.args, s.verified) for s in der.steps]
[('stream', ('x', 's_x'), True), ('tile', ('q', 'g_q'), True)]
>>> print(der.final)
Q[q d] f32, K[x d] f32, V[x d] f32 -> O[q d] f32  | stream(x, s_x), tile(q, g_q)
>>> der.replay(verify=False).final == der.final
True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape

from .check import EquivalenceReport, check_equivalent
from ..core import registry
from ..core.diagram import Axis, Diagram
from ..core.errors import EquivalenceError, NapkinError, RelabelError, UnverifiedError
from ..relabel.rules import RULES

_PREFIX = {"stream": "s", "tile": "g"}


@dataclass(frozen=True)
class Step:
    """One applied rule: its name, normalised arguments, the diagram after it, and whether
    it was verified against the original (with the check's report)."""

    name: str
    args: tuple
    diagram: Diagram
    verified: bool
    report: EquivalenceReport | None = None

    @property
    def spec(self) -> tuple:
        """The step as ``derive`` reads it: ``(name, *args)``."""
        return (self.name, *self.args)

    def __str__(self) -> str:
        call = f"{self.name}({', '.join(map(str, self.args))})"
        if self.verified and self.report is not None:
            how = (f"verified on {self.report.examples} examples "
                   f"(max abs error {self.report.max_abs_error:.2g})")
        else:
            how = "not verified"
        return f"{call:<32} {how}"

    @property
    def call(self) -> str:
        """The step as the call that made it: ``stream(x, s_x)``, ``place(O, SMEM)``."""
        return f"{self.name}({', '.join(map(str, self.args))})"

    def _repr_html_(self) -> str:
        """The step's diagram drawn, under its call and its check result (Jupyter)."""
        return _step_html(self.call, self.diagram, self.verified, self.report)


@dataclass(frozen=True)
class Derivation:
    original: Diagram
    steps: tuple[Step, ...]
    options: tuple = field(default=(), compare=False)   # the check options, for replay

    @property
    def final(self) -> Diagram:
        return self.steps[-1].diagram if self.steps else self.original

    def replay(self, on: Diagram | None = None, **options) -> "Derivation":
        """Re-apply the recorded steps (to ``on``, default the original), re-verifying them
        with the same options unless overridden."""
        return derive(self.original if on is None else on, [s.spec for s in self.steps],
                      **{**dict(self.options), **options})

    def __str__(self) -> str:
        lines = [f"derivation of {self.original}"]
        for i, s in enumerate(self.steps, 1):
            lines.append(f"  {i}. {s}")
        lines.append(f"final: {self.final}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """One picture per step (Jupyter): the original, then each step's diagram with the call
        that made it and its check against the original; self-contained HTML."""
        parts = [_step_html("original", self.original, None, None)]
        parts += [_step_html(f"{i}. {s.call}", s.diagram, s.verified, s.report) for i, s in enumerate(self.steps, 1)]
        head = f"derivation of {self.original} in {len(self.steps)} step(s)"
        return f'<div class="napkin-derivation"><p><b>{escape(head)}</b></p>{"".join(parts)}</div>'


def _step_html(title: str, d: Diagram, verified: bool | None, report: EquivalenceReport | None) -> str:
    if verified is None:
        verdict = ""
    elif verified and report is not None:
        verdict = (f'<span style="color:#2e7d32">✓ verified on {report.examples} examples '
                   f"(max abs error {report.max_abs_error:.2g}, {report.seconds:.2f} s)</span>")
    else:
        verdict = '<span style="color:#b26a00">not verified (verify=False)</span>'
    return (f'<div style="margin:0.5em 0"><div><b>{escape(title)}</b> <code>{escape(str(d))}</code> {verdict}</div>'
            f"{_svg(d)}</div>")


def _svg(d: Diagram) -> str:
    """The diagram's picture as inline SVG (the drawing stage registers ``to_svg``); without it,
    nothing: the text above names the diagram."""
    try:
        svg = d.memo("repr_svg", lambda: registry.verb("to_svg")(d))  # a notebook re-displays
    except NapkinError:
        return ""
    start = svg.find("<svg")
    return f'<div style="max-width:100%;overflow-x:auto">{svg[start:] if start >= 0 else ""}</div>'


def _name(a) -> str:
    return a.name if isinstance(a, Axis) else a


def _fresh(d: Diagram, base: str) -> str:
    used = {r.size for r in d.schedule if isinstance(r.size, str)} | {str(a.size) for a in d.axes}
    name, k = base, 2
    while name in used:
        name, k = f"{base}_{k}", k + 1
    return name


def _kwargs(d: Diagram, name: str, args: tuple) -> tuple[tuple, dict]:
    """Normalised args (for the record) and keyword args of the rule's ``apply``."""
    if name in ("stream", "tile"):
        if not 1 <= len(args) <= 3:
            raise RelabelError(f"{name} step takes (axis, size=None, level=None), got {args!r}")
        axis = _name(args[0])
        size = args[1] if len(args) > 1 and args[1] is not None else _fresh(d, f"{_PREFIX[name]}_{axis}")
        level = args[2] if len(args) > 2 else None
        rec = (axis, size) if level is None else (axis, size, level)
        return rec, {"axis": axis, "size": size, "level": level}
    if name == "place":
        if len(args) != 2:
            raise RelabelError(f"place step takes (array, level), got {args!r}")
        return tuple(args), {"array": args[0], "level": args[1]}
    if name == "require":
        if len(args) != 2:
            raise RelabelError(f"require step takes (axis, multiple_of), got {args!r}")
        return (_name(args[0]), args[1]), {"axis": _name(args[0]), "multiple_of": args[1]}
    if name == "order":
        axes_ = tuple(_name(a) for a in (args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args))
        return axes_, {"axes": axes_}
    rule = RULES[name]
    if rule.kind == "rewrite":
        if len(args) != 1:
            raise RelabelError(f"{name} step takes (axis,), got {args!r}")
        return (_name(args[0]),), {"axis": _name(args[0])}
    raise RelabelError(f"derive does not know how to pass arguments to rule {name!r}")


def derive(d: Diagram, steps, *, verify: bool = True, examples: int = 25, **check_options) -> Derivation:
    """Apply ``steps`` to ``d``, verifying each result against ``d`` (``examples`` per step;
    other keywords go to :func:`check_equivalent`).  A refused step raises
    :class:`RelabelError` with its reason; a step that fails verification raises
    :class:`EquivalenceError` with the counterexample."""
    if not isinstance(d, Diagram):
        raise RelabelError(f"derive needs a Diagram, got {type(d).__name__}")
    check_options.setdefault("progress", False)
    options = (("verify", verify), ("examples", examples), *sorted(check_options.items()))
    current = d
    done: list[Step] = []
    for i, raw in enumerate(steps, 1):
        if isinstance(raw, str):
            raw = (raw,)
        if not isinstance(raw, (tuple, list)) or not raw or not isinstance(raw[0], str):
            raise RelabelError(f"derive step {i}: expected a tuple (rule name, *args), got {raw!r}")
        name, args = raw[0], tuple(raw[1:])
        if name not in RULES:
            raise RelabelError(f"derive step {i}: unknown rule {name!r}; registered rules: {sorted(RULES)}")
        rule = RULES[name]
        try:
            rec, kw = _kwargs(current, name, args)
            reason = rule.check(current, **kw)
            if reason is not None:
                raise RelabelError(reason)
            new = rule.apply(current, **kw)
        except RelabelError as e:
            raise RelabelError(f"derive step {i} {name}{tuple(args)!r} refused: {e}") from None
        report = None
        if verify:
            try:
                report = check_equivalent(d, new, examples=examples, **check_options)
            except UnverifiedError as e:
                raise UnverifiedError(f"derive step {i} {name}{rec!r} was not verified: {e}") from None
            except EquivalenceError as e:
                raise EquivalenceError(f"derive step {i} {name}{rec!r} changes the function:\n{e}",
                                       e.counterexample) from None
        done.append(Step(name, rec, new, verify, report))
        current = new
    return Derivation(d, tuple(done), options)


__all__ = ["derive", "Derivation", "Step"]
