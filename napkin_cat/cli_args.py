"""What the ``napkin`` subcommands read from the command line: a diagram, its relabelling, sizes,
a hardware profile and a dtype.

``DIAGRAM`` is a library name (``napkin diagrams`` style: :data:`LIBRARY`) or
``module:function`` / ``path/to/file.py:function``, a function called with no argument that
returns a :class:`~napkin_cat.core.diagram.Diagram`.  Relabel options are applied in the order
given on the command line: ``--stream x=s_x`` (a symbolic chunk size), ``--stream x=64``,
``--tile q=g_q@SMEM`` (a level after ``@``), ``--place O=SMEM``.

Malformed text is a usage error (:class:`UsageError`, exit status 2); a well-formed request the
diagram refuses is a :class:`~napkin_cat.core.errors.NapkinError` (exit status 1).

>>> parse_sizes("q=8192,x=8192,d=128")
{'q': 8192, 'x': 8192, 'd': 128}
>>> parse_relabel("stream", "x=64@SMEM"), parse_relabel("place", "O=SMEM")
(('stream', 'x', 64, 'SMEM'), ('place', 'O', 'SMEM', None))
>>> print(build("attention", causal=True))
Q[q d] f32, K[x d] f32, V[x d] f32 -> O[q d] f32
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

RELABELS = ("stream", "tile", "place")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class UsageError(Exception):
    """The command line is malformed (exit status 2)."""


@dataclass(frozen=True)
class Entry:
    """A library diagram and the options that make sense for it."""

    function: str
    options: frozenset = frozenset()
    help: str = ""


_ATTENTION = frozenset({"causal", "window", "heads", "batch"})
LIBRARY = {
    "attention": Entry("attention", _ATTENTION, "softmax(Q K^T / sqrt(d)) V"),
    "multihead_attention": Entry("multihead_attention", _ATTENTION - {"heads"}, "attention weaved over heads h"),
    "l2_attention": Entry("normalized_attention", frozenset({"heads"}), "attention with an l2 normalisation"),
    "matmul": Entry("matmul", help="C[a c] = A[a b] B[b c]"),
    "batched_matmul": Entry("batched_matmul"),
    "linear": Entry("linear"),
    "mlp": Entry("mlp"),
    "softmax": Entry("softmax"),
    "layernorm": Entry("layernorm"),
    "rmsnorm": Entry("rmsnorm"),
}


def build(spec: str, *, causal: bool = False, window: int | None = None, heads: bool = False,
          batch: bool = False):
    """The diagram named by ``spec``, with the options it accepts (others are usage errors)."""
    from . import library
    from .core.diagram import Axis, Diagram

    given = {name for name, on in (("causal", causal), ("window", window is not None), ("heads", heads),
                                   ("batch", batch)) if on}
    if spec in LIBRARY:
        entry = LIBRARY[spec]
        extra = given - entry.options
        if extra:
            takers = sorted(n for n, e in LIBRARY.items() if extra <= e.options)
            raise UsageError(f"--{sorted(extra)[0]} does not apply to {spec}"
                             + (f" (it applies to {', '.join(takers)})" if takers else ""))
        kwargs = {}
        if causal:
            kwargs["causal"] = True
        if window is not None:
            kwargs["window_size"] = window
        if heads:
            kwargs["heads"] = Axis("h", "h")
        if batch:
            kwargs["batch"] = Axis("b", "b")
        return getattr(library, entry.function)(**kwargs)
    if ":" not in spec:
        raise UsageError(f"unknown diagram {spec!r}: a library name ({', '.join(LIBRARY)}) "
                         f"or module:function")
    if given:
        raise UsageError(f"--{sorted(given)[0]} applies to library diagrams only, not to {spec}")
    module_name, _, fn_name = spec.rpartition(":")
    fn = getattr(_load_module(module_name), fn_name, None)
    if not callable(fn):
        raise UsageError(f"{spec}: {module_name} has no function {fn_name!r}")
    d = fn()
    if not isinstance(d, Diagram):
        raise UsageError(f"{spec}() returned {type(d).__name__}, not a Diagram")
    return d


def _load_module(name: str):
    if name.endswith(".py"):
        path = Path(name)
        if not path.is_file():
            raise UsageError(f"no such file: {name}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise UsageError(f"cannot import {name}: {e}") from None


def parse_relabel(kind: str, text: str) -> tuple:
    """``AXIS=SIZE[@LEVEL]`` (stream, tile) or ``ARRAY=LEVEL`` (place) -> (kind, name, value, level)."""
    name, eq, value = text.partition("=")
    name, value = name.strip(), value.strip()
    if kind == "place":
        if not eq or not _NAME.match(name) or not value:
            raise UsageError(f"--place {text!r}: expected ARRAY=LEVEL, e.g. --place O=SMEM")
        return (kind, name, value, None)
    value, _, level = value.partition("@")
    if not eq or not _NAME.match(name) or not value:
        raise UsageError(f"--{kind} {text!r}: expected AXIS=SIZE or AXIS=SYMBOL, e.g. --{kind} x=64 or "
                         f"--{kind} x=s_x (optionally @LEVEL)")
    if value.isdigit():
        size = int(value)
    elif _NAME.match(value):
        size = value
    else:
        raise UsageError(f"--{kind} {text!r}: the size must be a positive integer or a symbol name")
    return (kind, name, size, level or None)


def ordered_relabels(argv: list[str] | None, values: dict[str, list[str]]) -> list[tuple]:
    """The relabel options in command-line order: ``values`` has each option's values (in
    order, as the parser collected them), ``argv`` says how the options interleave."""
    kinds = []
    for tok in argv or ():
        if tok == "--":
            break
        kinds += [k for k in RELABELS if tok == f"--{k}" or tok.startswith(f"--{k}=")]
    if any(kinds.count(k) != len(values.get(k, ())) for k in RELABELS):
        kinds = [k for k in RELABELS for _ in values.get(k, ())]   # no interleaving known
    queues = {k: list(values.get(k, ())) for k in RELABELS}
    return [parse_relabel(k, queues[k].pop(0)) for k in kinds]


def apply_relabels(d, relabels: list[tuple]):
    """``d.stream(...)``, ``d.tile(...)``, ``d.place(...)`` in order."""
    for kind, name, value, level in relabels:
        d = d.place(name, value) if kind == "place" else getattr(d, kind)(name, value, level)
    return d


def parse_sizes(text: str | None) -> dict[str, int]:
    """``q=8192,x=8192,d=128`` -> ``{'q': 8192, ...}`` (axis or tile/stream symbol names)."""
    sizes: dict[str, int] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, eq, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not _NAME.match(name) or not value.isdigit() or int(value) < 1:
            raise UsageError(f"--sizes: {part.strip()!r} is not NAME=POSITIVE_INT (e.g. --sizes q=8192,x=8192,d=128)")
        sizes[name] = int(value)
    return sizes


HARDWARE = {"h100": "H100", "h200": "H200", "a100": "A100_SXM4"}
DTYPE_NAMES = ("f16", "bf16", "f32")


def hardware(name: str):
    from .core.hardware import PROFILES
    return PROFILES[HARDWARE[name]]


def dtype(name: str):
    from .core.diagram import DTYPES
    return DTYPES[name]
