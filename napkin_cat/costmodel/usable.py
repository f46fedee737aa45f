"""What a kernel can use: block sizes on the granule of the thread mappings, and the register level.

:meth:`Cost.optimize <napkin_cat.costmodel.Cost.optimize>` searches, by default, only

* **usable block sizes**: multiples of :data:`GRANULE` = 16 up to the axis size (every power of
  two from 16 on, and every multiple of a warp's 32, is one), and the whole axis when it is
  shorter than 16.  16 is the granule the lowering divides a block into: the rows and columns
  of its register micro-tiles (``TY x TX`` threads, ``TX`` up to a warp of 32, ``RY x RX`` up to
  8 x 8 accumulators each) and the ``m16n8k16`` tensor-core fragment; a chunk of 1 key or a
  tile of 453 rows is no block a kernel runs;
* **what fits the registers** (with a hardware profile): a group's register-resident buffers
  (what the final form puts at ``registers``, and every accumulator state, which the kernel
  holds in registers whatever level the final form stages it at), one value per 32-bit
  register, spread over the block's ``threads``:

  - *per thread, one micro-tile*: the largest such buffer over the threads, at most
    ``registers_per_block / (4 max_threads_per_block)`` values (64 on every profile: a thread's
    share of the register file in a full block, and the 8 x 8 micro-tile the lowering uses at most);
  - *per thread, all of them*: at most ``min(255, registers_per_block / (4 threads))``
    (:data:`MAX_REGISTERS_PER_THREAD`, CUDA C++ Programming Guide, compute capabilities);
  - *per SM*: at most ``min(registers_per_sm, registers_per_block) / 4`` values.

>>> usable_size(48, 8192), usable_size(453, 8192), usable_size(8, 8), usable_size(4, 8)
(True, False, True, False)
>>> from napkin_cat.core.hardware import H100
>>> register_capacity(H100, 256)
{'micro per thread': 64, 'per thread': 255, 'per SM': 65536}
"""

from __future__ import annotations

import sympy as sp

GRANULE = 16
MAX_REGISTERS_PER_THREAD = 255   # CUDA-PG: maximum number of 32-bit registers per thread
THREADS = 256                    # threads per block of a kernel (the lowering's GPU default)
RULE = f"multiples of {GRANULE} up to the axis (the whole axis when shorter)"


def usable_size(v: int, n: int) -> bool:
    """``v`` is a block size of an axis of ``n`` that the kernel mapping can use."""
    return v % GRANULE == 0 or (n < GRANULE and v == n)


def register_capacity(hw, threads: int) -> dict[str, int]:
    """Values (32-bit registers) a group may hold: one micro-tile per thread, all per thread,
    all per SM."""
    return {"micro per thread": hw.registers_per_block // (4 * hw.max_threads_per_block),
            "per thread": min(MAX_REGISTERS_PER_THREAD, hw.registers_per_block // (4 * threads)),
            "per SM": min(hw.registers_per_sm, hw.registers_per_block) // 4}


def register_exprs(columns) -> tuple[sp.Expr, sp.Expr] | None:
    """``(largest buffer, total)`` a group holds in registers at its fullest program point
    (values), counting accumulator states as register-resident; None when nothing is."""
    micro, total = [], []
    for col in columns:
        held = [r.size for r in col if r.level == "registers" or r.state]
        if held:
            micro.extend(held)
            total.append(sp.Add(*held))
    if not total:
        return None
    return sp.Max(*micro), sp.Max(*total)


def register_use(micro: int, total: int, threads: int) -> dict[str, int]:
    """What :func:`register_capacity` bounds, at one choice of blocks."""
    return {"micro per thread": -(-micro // threads), "per thread": -(-total // threads), "per SM": total}
