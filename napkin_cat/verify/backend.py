"""How kernels reach the verification stage without it importing the lowering stage.

``check_equivalent`` accepts kernels and can lower a diagram at every drawn size
(``lowered=True``); :func:`napkin_cat.lower` self-checks through :mod:`.kernelcheck`.  The
lowering stage sits above this one, so it fills this table when it is imported (as
``import napkin_cat`` does): ``lower`` (the function), ``Kernel`` and ``MultiKernel`` (the classes),
``simulator_active`` and ``driver_present`` (where kernels would run).
"""

from __future__ import annotations

from typing import Any

from ..core.errors import LoweringError

BACKEND: dict[str, Any] = {}


def register(**entries) -> None:
    BACKEND.update(entries)


def backend(name: str):
    try:
        return BACKEND[name]
    except KeyError:
        raise LoweringError(f"no kernel backend registered ({name!r}): import napkin_cat.lowering") from None
