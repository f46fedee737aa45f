"""Counterexamples as code: a failing check prints a program that reproduces it."""

from __future__ import annotations

from ..core.diagram import Box, Diagram
from ..core.errors import NapkinError
from .problem import _Example, _Problem

def lowering_call(options: dict) -> str:
    """``threads=32, prefetch=False``: the keyword arguments of a lower() call, as code."""
    return "".join(f", {k}={v!r}" for k, v in options.items() if v is not None)


def _size_str(ex: _Example) -> str:
    return " ".join(f"{k}={v}" for k, v in {**ex.sizes, **ex.blocks}.items())


_NAMESPACE_CODE = ("from napkin_cat.core import *  # Diagram, Ty, Array, Axis, Box, Eqn, Relabel, dtypes\n"
                   "from napkin_cat.ops import AxisPower, IndexBias, Predicate")

SAVED: dict[str, Diagram] = {}   # diagrams whose repr does not evaluate back, by reproducer key


def saved(key: str) -> Diagram:
    """A diagram a reproducer could not print as code (a lambda inside), kept for this session."""
    try:
        return SAVED[key]
    except KeyError:
        raise NapkinError(f"no saved diagram {key!r} in this Python session: the reproducer that names it "
                          f"runs only in the session that printed it") from None


def _custom_functions(value) -> list:
    """The Python functions inside custom predicates and index biases of a diagram or box."""
    from ..ops.index import IndexBias, Predicate
    if isinstance(value, Diagram):
        return [f for e in value.eqns for f in _custom_functions(e.box)]
    if isinstance(value, Box):
        return [f for _, v in value.params for f in _custom_functions(v)]
    if isinstance(value, (Predicate, IndexBias)):
        return [value.fn] if value.fn is not None else []
    if isinstance(value, (tuple, list)):
        return [f for v in value for f in _custom_functions(v)]
    return []


def _diagram_code(d: Diagram, label: str) -> tuple[list[str], str]:
    """(import lines, ``label = ...``): the diagram as code that evaluates back to it; module
    functions in custom predicates are imported; what cannot be printed is kept in :data:`SAVED`."""
    ns: dict = {}
    exec(_NAMESPACE_CODE, ns)
    imports = []
    for fn in _custom_functions(d):
        mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if mod and mod != "__main__" and qual.isidentifier() and qual == getattr(fn, "__name__", None):
            line = f"from {mod} import {qual}"
            try:
                exec(line, ns)
            except (ImportError, AttributeError, SyntaxError):  # not importable: the SAVED fallback below
                continue
            imports.append(line)
    text = repr(d)
    try:
        if eval(text, ns) == d:
            return imports, f"{label} = {text}"
    except (SyntaxError, NameError, TypeError, AttributeError, ValueError):  # a lambda's repr does not evaluate back
        pass
    key = f"{label}-{len(SAVED)}"
    SAVED[key] = d
    return (["from napkin_cat.verify.reproduce import saved"],
            f"{label} = saved({key!r})  # the diagram passed as '{label}': its repr does not evaluate back "
            f"(a lambda in a predicate?), so it is kept for this Python session")


def _var_names(problem: _Problem) -> list[str]:
    taken = {"np", "nc", "a", "b", "rng", "sizes", "params", "out_a", "out_b", "masked_normal", "jumps",
             "kernel", "saved"}
    names = []
    for i, arr in enumerate(problem.a.dom):
        n = arr.name if arr.name.isidentifier() and arr.name != "_" else f"x{i}"
        while n in taken:
            n = f"{n}_{i}"
        taken.add(n)
        names.append(n)
    return names


def _kernel_line(failure: dict) -> str | None:
    """``kernel = nc.lower(...)``: the failing kernel rebuilt from its diagram and options."""
    k = failure.get("kernel")
    if k is None:
        return None
    opts = {**getattr(k, "options", {}), **failure.get("options", {})}
    imports, code = _diagram_code(k.diagram, "kd")
    return "\n".join(imports + [code, f"kernel = nc.lower(kd, verify=False{lowering_call(opts)})"])


def reproducer(problem: _Problem, ex: _Example, failure: dict) -> str:
    """Python code that rebuilds the inputs of ``ex`` and shows the difference."""
    names = _var_names(problem)
    lines = ["import numpy as np", "import napkin_cat as nc", _NAMESPACE_CODE]
    if ex.regime in ("masked", "jumps"):
        lines.append(f"from napkin_cat.verify.data import {'masked_normal' if ex.regime == 'masked' else 'jumps'}")
    kline = _kernel_line(failure)
    for d, label in ((problem.a, "a"), (problem.b, "b")):
        if label == "b" and kline is not None and failure.get("mode") == "kernel":
            continue
        imports, code = _diagram_code(d, label)
        lines += [ln for ln in imports if ln not in lines] + [code]
    sizes = problem.eval_sizes(ex)
    sizes_a, sizes_b = problem.sizes_for(problem.a, sizes), problem.sizes_for(problem.b, sizes)
    if sizes_a == sizes_b:
        lines.append(f"sizes = {sizes_a!r}")
    else:
        lines += [f"sizes_a = {sizes_a!r}", f"sizes_b = {sizes_b!r}  # with the block sizes"]
    lines.append(f"rng = np.random.default_rng({ex.seed})")
    pnames = []
    cast = ".astype(np.float32)" if kline is not None else ""
    for kind, key, arr, shape, (_, template) in problem.input_specs(ex):
        code = template.format(s=repr(shape))
        if kind == "in":
            lines.append(f"{names[key]} = ({code}){cast}" if cast else f"{names[key]} = {code}")
        else:
            pnames.append(key)
            lines.append(f"param_{key} = {code}")
    args = ", ".join(names)
    pkw = ", params=params" if pnames else ""
    kw_a, kw = (", sizes=sizes" + pkw,) * 2 if sizes_a == sizes_b else (", sizes=sizes_a" + pkw, ", sizes=sizes_b" + pkw)
    if pnames:
        lines.append("params = {" + ", ".join(f"{k!r}: param_{k}" for k in pnames) + "}")
    lines.append(f"out_a = nc.evaluate(a, {args}{kw_a})")
    if kline is not None:
        lines += kline.splitlines()
        lines.append(f"out_b = kernel({args})")
    elif failure["kind"] == "error":
        lines.append(f"out_b = nc.evaluate(b, {args}{kw})  # side {failure['side']} raises")
        return "\n".join(lines)
    else:
        lines.append(f"out_b = nc.evaluate(b, {args}{kw})")
    if failure["kind"] == "error":
        return "\n".join(lines[:-1] + [lines[-1] + "  # raises"])
    sel = "" if len(problem.a.cod) == 1 else f"[{failure['output']}]"
    idx = failure["index"]
    lines.append(f"print(out_a{sel}[{idx!r}], out_b{sel}[{idx!r}])  "
                 f"# {failure['a_value']!r} vs {failure['b_value']!r}")
    return "\n".join(lines)


def reproducer_for_kernel(oracle: Diagram, kernel, regime: str, seed: int, failure: dict) -> str:
    """The reproducer of a kernel's self-check (:func:`napkin_cat.verify.kernelcheck.self_check`)."""
    problem = _Problem.build(oracle, kernel.diagram, None, 1)
    ex = _Example({}, {}, regime, seed)
    return reproducer(problem, ex, {**failure, "kernel": kernel, "mode": "kernel"})


