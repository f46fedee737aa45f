"""The problem ``check_equivalent`` solves: two diagrams (or a diagram and a kernel), the sizes,
blocks and data regimes to draw, and the inputs of one example."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..core.diagram import Axis, Diagram
from ..core.errors import TypingError
from ..core.hierarchy import DEVICES
from ..relabel.devices import device_multiple
from ..ops.kinds import spec
from ..relabel.rules import requirements
from .data import _INT_DATA, REGIMES

# boxes through which a -inf score stays a masked score (the "masked" regime's reach)
_PASS_KINDS = ("mask", "index_bias", "cast")
_PASS_FNS = ("add", "sub", "scale", "shift", "identity", "maximum")



@dataclass(frozen=True)
class _Example:
    sizes: dict          # axis-size symbol -> int
    blocks: dict         # block-size symbol -> int
    regime: str
    seed: int
    options: dict = field(default_factory=dict)   # lower() options drawn (lowered=True)



@dataclass
class _Problem:
    a: Diagram
    b: Diagram
    fixed: dict                      # user-fixed sizes, str keys
    symbols: dict                    # axis-size symbol -> upper bound
    blocks: dict                     # block symbol -> required multiple
    masks: list                      # (row symbol, col symbol)
    regimes: tuple
    score_inputs: frozenset          # dom positions that reach a softmax-like box elementwise
    score_params: frozenset
    params: dict                     # param name -> Array
    max_size: int
    axis_symbol: dict = field(default_factory=dict)  # axis name -> size symbol or int
    devices: tuple = ()              # numbers of devices to draw (a split over the devices), or ()
    device_syms: frozenset = frozenset()   # size symbols of the axes split over the devices
    device_chunks: int = 1           # pieces per device (2 for a zig-zag layout: relabel/devices.py)

    @staticmethod
    def build(a: Diagram, b: Diagram, sizes: dict, max_size: int, max_chunks: int = 6) -> "_Problem":
        axis_symbol: dict[str, object] = {}
        for d in (a, b):
            for ax in d.axes:
                axis_symbol.setdefault(ax.name, ax.size)
        fixed = _fixed_sizes(sizes, a, b, axis_symbol)
        # an axis fixed by name fixes its symbol too
        for name, sym in list(axis_symbol.items()):
            if name in fixed and isinstance(sym, str):
                fixed.setdefault(sym, fixed[name])
        block_for: dict[str, int] = {}   # size symbol -> largest concrete block on its axes
        blocks: dict[str, int] = {}
        for d in (a, b):
            req = requirements(d)
            for r in d.schedule:
                if r.op not in ("tile", "stream") or r.size == DEVICES:
                    continue
                sym = axis_symbol.get(r.axis)
                if isinstance(r.size, int):
                    if isinstance(sym, str):
                        block_for[sym] = max(block_for.get(sym, 0), r.size)
                elif r.size not in fixed and r.size not in axis_symbol.values():
                    k = req.get(r.axis, 1)
                    blocks[r.size] = math.lcm(blocks.get(r.size, 1), k)
        masks = []
        for d in (a, b):
            for e in d.eqns:
                if spec(e.box).indexed:
                    rs, cs = axis_symbol[e.box.param("row")], axis_symbol[e.box.param("col")]
                    if isinstance(rs, str) and isinstance(cs, str) and rs != cs and (rs, cs) not in masks:
                        masks.append((rs, cs))
        # a mask compares global row and column indices: blocks on one matter to the other
        for rs, cs in masks:
            if rs in block_for or cs in block_for:
                block_for[rs] = block_for[cs] = max(block_for.get(rs, 0), block_for.get(cs, 0))
        symbols = {}   # symbol -> (upper bound, smallest size with two chunks, or 0)
        for sym in axis_symbol.values():
            if isinstance(sym, str) and sym not in fixed and sym not in symbols:
                blk = block_for.get(sym, 0)
                upper = max(max_size, max_chunks * blk - 1)   # up to max_chunks chunks, the last ragged
                symbols[sym] = (upper, blk if blk and blk < upper else 0)
        masks = [(rs, cs) for rs, cs in masks if rs in symbols and cs in symbols]
        score_inputs, score_params = set(), set()
        params = {}
        for d in (a, b):
            ins, ps = _score_like(d)
            score_inputs |= ins
            score_params |= ps
            for e in d.eqns:
                if e.box.kind == "param":
                    params.setdefault(e.box.param("pname"), e.box.cod[0])
        regimes = ("normal", "repeated", "huge", "huge_one_sign", "jumps") + \
            (("masked",) if score_inputs or score_params else ())
        split = {r.axis for d in (a, b) for r in d.schedule if r.size == DEVICES}
        whole = [fixed.get(axis_symbol[n], fixed.get(n, axis_symbol[n])) for n in split]
        chunks = max(device_multiple(a), device_multiple(b))
        devices = tuple(p for p in (1, 2, 3, 4) if all(not isinstance(n, int) or n % (chunks * p) == 0
                                                        for n in whole)) if split else ()
        return _Problem(a, b, fixed, symbols, blocks, masks, regimes, frozenset(score_inputs),
                        frozenset(score_params), params, max_size, axis_symbol, devices,
                        frozenset(axis_symbol[n] for n in split if isinstance(axis_symbol[n], str)), chunks)

    # ---- drawing
    def draw(self, data, st, options: dict | None = None) -> _Example:
        sizes: dict[str, int] = {}
        tall = {}
        for rs, cs in self.masks:  # rows beyond the columns: fully masked rows under a window
            if rs not in tall:
                tall[rs] = cs
        for sym, (upper, multi) in self.symbols.items():
            if sym in tall and tall[sym] in sizes and data.draw(st.booleans(), label=f"{sym} > {tall[sym]}"):
                lo = min(sizes[tall[sym]] + 1, upper)
                sizes[sym] = data.draw(st.integers(lo, upper), label=sym)
            elif multi:  # most draws cross a concrete block (multi): two or more chunks, or four or more
                many = min(3 * multi + 1, upper)
                sizes[sym] = data.draw(st.one_of(st.integers(1, upper), st.integers(multi + 1, upper),
                                                 st.integers(many, upper)), label=sym)
            else:
                sizes[sym] = data.draw(st.integers(1, upper), label=sym)
        blocks = {}
        if self.devices:   # one equal block per device: the axes split over them are multiples
            p = blocks[DEVICES] = data.draw(st.sampled_from(self.devices[::-1]), label=DEVICES)
            m = p * self.device_chunks
            for sym in self.device_syms & set(sizes):
                sizes[sym] = m * max(1, sizes[sym] // m)
        for sym, k in self.blocks.items():
            top = max(1, self.max_size // k)   # small blocks favoured: many chunks per axis
            blocks[sym] = k * data.draw(st.one_of(st.integers(1, min(3, top)), st.integers(1, top)),
                                        label=f"{sym} / {k}" if k > 1 else sym)
        regime = data.draw(st.sampled_from(self.regimes), label="regime")
        seed = data.draw(st.integers(0, 2 ** 32 - 1), label="seed")
        drawn = {k: data.draw(st.sampled_from(v), label=k) for k, v in (options or {}).items()}
        return _Example(sizes, blocks, regime, seed, drawn)

    def axis_sizes(self, ex: _Example) -> dict[str, int]:
        out = {}
        for name, sym in self.axis_symbol.items():
            if isinstance(sym, int):
                out[name] = sym
            else:
                out[name] = ex.sizes.get(sym, self.fixed.get(sym, self.fixed.get(name)))
        return out

    def eval_sizes(self, ex: _Example) -> dict:
        return {**self.fixed, **ex.sizes, **ex.blocks}

    @staticmethod
    def sizes_for(d: Diagram, sizes: dict) -> dict:
        """The entries of ``sizes`` that name an axis, size symbol or block of ``d``."""
        known = {ax.name for ax in d.axes} | {ax.size for ax in d.axes if ax.symbolic} | \
            {r.size for r in d.schedule if isinstance(r.size, str)}
        return {k: v for k, v in sizes.items() if k in known}

    def input_specs(self, ex: _Example):
        """(label, shape, (generator, template)) for every input then every param, in rng order."""
        ax = self.axis_sizes(ex)
        specs = []
        for i, arr in enumerate(self.a.dom):
            shape = tuple(int(ax[n]) for n in arr.axis_names)
            specs.append(("in", i, arr, shape, self._regime_for(arr, ex.regime, i in self.score_inputs)))
        for name in sorted(self.params):
            arr = self.params[name]
            shape = tuple(int(ax[n]) for n in arr.axis_names)
            specs.append(("param", name, arr, shape, self._regime_for(arr, ex.regime, name in self.score_params)))
        return specs

    @staticmethod
    def _regime_for(arr, regime, score_like):
        if arr.dtype.kind == "int":
            return _INT_DATA
        if regime == "masked" and not score_like:
            return REGIMES["normal"]
        return REGIMES[regime]

    def data(self, ex: _Example):
        rng = np.random.default_rng(ex.seed)
        inputs, params = [], {}
        for kind, key, arr, shape, (gen, _) in self.input_specs(ex):
            x = gen(rng, shape)
            if kind == "in":
                inputs.append(x)
            else:
                params[key] = x
        return inputs, params


def _fixed_sizes(sizes, a: Diagram, b: Diagram, axis_symbol: dict) -> dict[str, int]:
    """``sizes`` as ``{symbol or name: int}``; unknown keys and non-positive or non-integer
    sizes are refused by name."""
    if sizes is None:
        return {}
    if not isinstance(sizes, dict):
        raise TypingError(f"check_equivalent: sizes must be a dict {{axis: size}}, got {type(sizes).__name__}")
    known = set(axis_symbol) | {s for s in axis_symbol.values() if isinstance(s, str)}
    known |= {r.size for d in (a, b) for r in d.schedule if isinstance(r.size, str)}
    fixed = {}
    for key, n in sizes.items():
        name = key.size if isinstance(key, Axis) and key.symbolic else getattr(key, "name", key)
        if not isinstance(name, str) or name not in known:
            raise TypingError(f"check_equivalent: sizes names {key!r}, which is no axis, size symbol or block "
                              f"of the diagrams; known: {sorted(known)}")
        if isinstance(n, bool) or not hasattr(n, "__index__") or int(n) < 1:
            raise TypingError(f"check_equivalent: sizes[{name!r}] must be a positive integer, got {n!r}")
        fixed[name] = int(n)
    return fixed


def _score_like(d: Diagram) -> tuple[set, set]:
    """Inputs (dom positions) and params (names) whose values reach the score operand of a
    softmax-like box through elementwise boxes only: where ``-inf`` means "masked"."""
    score: set[int] = set()
    for e in d.eqns:
        box = e.box
        soft = spec(box).softmax_like(box)
        if soft:
            score.add(e.ins[0])
    for k in reversed(range(len(d.eqns))):
        e = d.eqns[k]
        if not any(v in score for v in d.eqn_outputs(k)):
            continue
        box = e.box
        passes = box.kind in _PASS_KINDS or (box.kind == "map" and box.param("fn") in _PASS_FNS) or \
            (box.kind == "reindex" and box.param("op") == "transpose")
        if passes:
            score.update(e.ins)
    n = len(d.dom)
    ins = {v for v in score if v < n}
    params = set()
    for k, e in enumerate(d.eqns):
        if e.box.kind == "param" and d.eqn_outputs(k)[0] in score:
            params.add(e.box.param("pname"))
    return ins, params


