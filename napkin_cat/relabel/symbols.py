"""The one place sympy symbols for sizes are made.

A symbol made with other assumptions never cancels with its twin, so every size symbol in
napkin_cat (axis sizes, tile and stream sizes) comes from :func:`size_symbol`.
"""

from __future__ import annotations

from functools import lru_cache

import sympy as sp


@lru_cache(maxsize=None)
def size_symbol(name: str) -> sp.Symbol:
    return sp.Symbol(name, integer=True, positive=True)


def size_expr(size) -> sp.Expr:
    """An int or symbol name as a sympy expression."""
    if isinstance(size, str):
        return size_symbol(size)
    return sp.Integer(size)
