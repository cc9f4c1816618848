"""NumPy-style ops: numpy arrays run the NumPy reference, CuPy arrays launch the CUDA kernel.

A kernel family is three files: cuda_src/<family>.cu, cuinfer/ops/<family>.py and
tests/ops/test_<family>.py. The module holds the public op(s), the NumPy
reference and the launcher side by side, plus `INSTANTIATIONS`: every template
instantiation its launcher can ask for (the compile check builds them all for
sm_80 and sm_90). No family module imports CuPy at import time, so importing
them all here is cheap and works without CuPy.

The ops are bound here after their modules are imported: `cuinfer.ops.linear` is
the function, and the family's internals are reached as `from cuinfer.ops.linear
import tile_config` (Python binds a submodule as a package attribute when it is
first imported; importing every family here first keeps the function on top).
"""
import importlib

from . import build
from .activation import gelu_and_mul, silu_and_mul
from .embedding import embedding
from .flash_attention import flash_attention, flash_attention_paged
from .layer_norm import layer_norm
from .linear import argmax_workspace_size, linear, linear_argmax
from .linear_mma import linear_mma
from .paged_attention import paged_attention
from .rms_norm import rms_norm
from .rope import rope
from .sampling import sampling
from .softmax import softmax
from .write_kv import write_kv

FAMILIES = tuple(sorted(p.stem for p in build.source_dir().glob("*.cu")))


def family_module(family: str):
    """The Python module of a kernel family (its launcher, reference and INSTANTIATIONS)."""
    return importlib.import_module(f"cuinfer.ops.{family}")


__all__ = ["argmax_workspace_size", "embedding", "flash_attention", "flash_attention_paged", "gelu_and_mul",
           "layer_norm", "linear", "linear_argmax", "linear_mma", "paged_attention", "rms_norm", "rope", "sampling",
           "silu_and_mul", "softmax", "write_kv"]
