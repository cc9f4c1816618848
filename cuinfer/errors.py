"""The errors a user can cause, and the dtypes every layer names: a leaf (NumPy and ml_dtypes only).

A module that only needs `CuinferError` imports it from here, not from the GPU runtime.
"""
import numpy as np

try:
    import ml_dtypes

    bfloat16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a core dependency
    bfloat16 = None


class CuinferError(Exception):
    """An error a user can cause or fix; the CLI prints its message, not a traceback."""


class NoDeviceError(CuinferError):
    pass


class CompileError(CuinferError):
    pass
