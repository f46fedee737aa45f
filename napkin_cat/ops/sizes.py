"""Sizes that follow from other sizes: a box parameter that derives an output axis's length.

A convolution's output length follows from its input length, kernel, stride, padding and
dilation (PyTorch's formula).  The unfold box that makes the windows carries the rule as a
parameter (:class:`ConvLength`); :meth:`napkin_cat.core.Diagram.bind` binds it with the other
parameters and asks every parameter with a ``derived_sizes`` method for the sizes it now
determines: binding the input axes binds the output axes, and a size given that disagrees
is refused, naming the size the rule gives.

>>> import napkin_cat as nc
>>> c, o, h = nc.axes("c o h")
>>> d = nc.library.conv1d(c, o, h, 3, stride=2, padding=1)
>>> print(d.bind({c: 2, o: 4, h: 9}))
X[c=2 h=9] f32, W[o=4 c=2 k=3] f32, bias[o=4] f32 -> Y[o=4 ho=5] f32
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import Axis


@dataclass(frozen=True)
class ConvLength:
    """``out`` has the length of a convolution along ``axis`` with kernel ``kernel``:
    ``(n + 2p - d(k-1) - 1) // s + 1``, or transposed ``(n-1)s - 2p + d(k-1) + output_padding + 1``."""

    out: str
    axis: Axis
    kernel: Axis
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    transposed: bool = False
    output_padding: int = 0

    def bind(self, sizes) -> "ConvLength":   # Box.bind reaches it through core's parameter binding
        return ConvLength(self.out, self.axis.bind(sizes), self.kernel.bind(sizes), self.stride, self.padding,
                          self.dilation, self.transposed, self.output_padding)

    def length(self) -> int | None:
        """The output length, or None while the input or kernel size is symbolic."""
        n, k = self.axis.size, self.kernel.size
        if isinstance(n, str) or isinstance(k, str):
            return None
        s, p, dl = self.stride, self.padding, self.dilation
        if self.transposed:
            return (n - 1) * s - 2 * p + dl * (k - 1) + self.output_padding + 1
        return (n + 2 * p - dl * (k - 1) - 1) // s + 1

    def derived_sizes(self) -> dict[str, int]:
        m = self.length()
        return {} if m is None else {self.out: m}

    def explain(self) -> str:
        how = (f"stride {self.stride}, padding {self.padding}, dilation {self.dilation}"
               + (f", transposed, output_padding {self.output_padding}" if self.transposed else ""))
        return (f"a convolution along {self.axis.describe()} with kernel {self.kernel.describe()} ({how}) has "
                f"{self.length()} outputs")

    def __repr__(self) -> str:   # evaluates in vars(napkin_cat), like every diagram's repr
        return (f"ops.sizes.ConvLength({self.out!r}, {self.axis!r}, {self.kernel!r}, {self.stride!r}, "
                f"{self.padding!r}, {self.dilation!r}, {self.transposed!r}, {self.output_padding!r})")


__all__ = ["ConvLength"]
