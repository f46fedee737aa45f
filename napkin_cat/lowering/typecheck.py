"""Type-checking generated kernels without a GPU: numba-cuda's front end (typing and lowering
to LLVM IR), in a subprocess when this process runs the CUDA simulator (which checks no
types).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..core.errors import LoweringError
from .devices import import_cuda, simulator_active


# Run with NUMBA_ENABLE_CUDASIM=0; the request comes on stdin, the answer after a marker on
# stdout.  The broad except is the process boundary: numba raises errors of arbitrary types,
# and the parent must get any of them back as a message, not as a dead subprocess.
_TYPECHECK_SCRIPT = """
import json, sys
from napkin_cat.core.errors import LoweringError
from napkin_cat.lowering.typecheck import typecheck_kernel
req = json.load(sys.stdin)
try:
    ir = typecheck_kernel(req["source"], req["name"], req["signature"], cc=tuple(req["cc"]))
    out = {"ok": True, "llvm": ir}
except LoweringError as e:
    out = {"ok": False, "error": str(e)}
except Exception as e:
    out = {"ok": False, "error": type(e).__name__ + ": " + str(e)}
sys.stdout.write("\\n@@napkin@@" + json.dumps(out))
"""


def typecheck_kernel(source: str, name: str, signature: Any, *,
                     cc: tuple[int, int] = (9, 0)) -> str:
    """Type-check generated source for one signature and return the kernel's LLVM IR.

    The simulator runs kernels as plain Python and checks no types, so source that it runs
    may still be rejected by numba's compiler on the GPU.  This runs numba-cuda's front end
    (typing and lowering to LLVM IR, ``numba.cuda.compiler.compile_cuda``) for compute
    capability ``cc``; it needs no GPU and no NVRTC, but numba-cuda must find libNVVM.

    Typing needs the real ``numba.cuda``: when this process runs the simulator, the check
    runs in a subprocess with ``NUMBA_ENABLE_CUDASIM=0`` (about 2 s), and ``signature``
    must then be a string such as ``"void(float32[:, ::1], float32[::1], int32)"``.
    Raises :class:`~napkin_cat.core.errors.LoweringError` with numba's message on failure.
    """
    if simulator_active():
        if not isinstance(signature, str):
            raise LoweringError("typecheck_kernel under the simulator runs in a subprocess and "
                                "needs the signature as a string")
        return _typecheck_subprocess(source, name, signature, cc)
    import_cuda()
    from numba.cuda.compiler import compile_cuda

    from .runtime import compile_kernel, signature_argtypes

    disp = compile_kernel(source, name)
    argtypes = signature_argtypes(signature)
    try:
        cres = compile_cuda(disp.py_func, None, argtypes, cc=tuple(cc))
    except Exception as e:
        # a boundary: numba's typing and lowering raise errors of many unrelated types
        # (TypingError, UnsupportedError, NotImplementedError, KeyError, ...); all of them
        # mean this source does not compile for this signature
        raise LoweringError(f"kernel {name!r} does not compile for {signature}: "
                            f"{type(e).__name__}: {e}") from e
    return cres.library.get_llvm_str()


def _typecheck_subprocess(source: str, name: str, signature: str, cc) -> str:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    request = json.dumps({"source": source, "name": name, "signature": signature,
                          "cc": list(cc)})
    proc = subprocess.run([sys.executable, "-c", _TYPECHECK_SCRIPT], input=request,
                          capture_output=True, text=True, env=env, timeout=600)
    _, sep, payload = proc.stdout.rpartition("\n@@napkin@@")
    if not sep:
        raise LoweringError(f"typecheck subprocess for kernel {name!r} failed "
                            f"(exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out = json.loads(payload)
    if not out["ok"]:
        raise LoweringError(out["error"])
    return out["llvm"]
