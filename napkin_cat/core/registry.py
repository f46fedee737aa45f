"""Where later stages plug into :class:`~napkin_cat.core.diagram.Diagram`'s fluent verbs.

``d.stream(x, "s_x").tile(q, "g_q")``, ``d.loop_nest()`` and ``d.draw()`` read like methods of
the diagram, but they belong to later stages (relabel, drawing).  Each stage registers its
verbs here when it is imported; :class:`Diagram` looks them up by name, so :mod:`napkin_cat.core`
imports nothing above it.  ``import napkin_cat`` registers every verb.
"""

from __future__ import annotations

from typing import Callable

from .errors import NapkinError

VERBS: dict[str, Callable] = {}


def register(name: str, fn: Callable) -> None:
    VERBS[name] = fn


def verb(name: str) -> Callable:
    try:
        return VERBS[name]
    except KeyError:
        raise NapkinError(f"{name} is provided by a stage that is not imported; import napkin_cat "
                          f"(registered: {sorted(VERBS)})") from None
