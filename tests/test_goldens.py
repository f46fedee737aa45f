"""The golden kernels in kernels/ are what the code generator emits today.

A failing test shows the diff; after reviewing it, ``python -m napkin_cat.lowering.goldens
--update`` rewrites the files.  Generating source needs no GPU and no simulator.
"""

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # as the other kernel tests: one choice per process

import pytest  # noqa: E402

from napkin_cat.lowering import goldens  # noqa: E402


@pytest.mark.parametrize("name", sorted(goldens.canonical()))
def test_golden_kernel_is_unchanged(name):
    text = goldens.diff(name)
    assert not text, (f"kernels/{name}.py differs from the generated source; review and run "
                      f"`python -m napkin_cat.lowering.goldens --update`:\n{text[:6000]}")


def test_goldens_compile_as_python():
    for name in goldens.canonical():
        compile(goldens.generate(name), f"kernels/{name}.py", "exec")
