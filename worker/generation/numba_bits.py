"""Two numba intrinsics the CPU decode attention kernel needs: reinterpreting bits as a
float32, which numba's Python-level operations cannot express for a scalar.

Both compile to one or two instructions that LLVM vectorizes inside a loop, unlike a
round trip through an array view. Imported only where numba is (the kernel compiles
lazily, and the engine falls back to ``sdpa`` without it). numba's on-disk cache of the
kernel is keyed on ``decode_attention.py``, not on this file: a change here needs that
file's cached kernels dropped (its ``__pycache__/*.nbi``) or the file touched.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir  # type: ignore[import-untyped]
from numba.core import types
from numba.extending import intrinsic


def _as_float32(typingctx: Any, x: Any) -> Any:
    """The float32 whose bit pattern is ``x``'s low 32 bits (``x`` an integer): ``2**e``
    from an exponent shifted into place."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        bits = args[0]
        if bits.type.width != 32:
            bits = builder.trunc(bits, ir.IntType(32))
        return builder.bitcast(bits, ir.FloatType())

    return types.float32(x), codegen


def _widen(typingctx: Any, x: Any) -> Any:
    """A key or value element as a float32: a float32 as it is; a bfloat16's bit pattern
    (``uint16``, numpy has no bfloat16) as the float32 it is the upper half of."""
    if x == types.float32:
        return types.float32(x), lambda context, builder, sig, args: args[0]
    if x != types.uint16:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        bits = builder.zext(args[0], ir.IntType(32))
        return builder.bitcast(builder.shl(bits, ir.Constant(ir.IntType(32), 16)), ir.FloatType())

    return types.float32(x), codegen


# (typed Any: called from compiled code with one argument, numba passes the typing context)
as_float32: Any = intrinsic(_as_float32)
widen: Any = intrinsic(_widen)
