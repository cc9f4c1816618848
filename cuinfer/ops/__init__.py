"""NumPy-style ops: numpy arrays run the NumPy reference, CuPy arrays launch the CUDA kernel.

A kernel family is three files: cuda_src/<family>.cu, cuinfer/ops/<family>.py and
tests/ops/test_<family>.py. The module holds the public op(s), the NumPy
reference and the launcher side by side, plus `INSTANTIATIONS`: every template
instantiation its launcher can ask for (the compile check builds them all for
sm_80 and sm_90). Families are found from cuda_src/*.cu; ops are imported lazily
so `import cuinfer.ops` never needs CuPy.
"""
import importlib

from .. import runtime

FAMILIES = tuple(sorted(p.stem for p in runtime.source_dir().glob("*.cu")))

# public op name -> the family module that defines it
_OPS = {
    "rms_norm": "rms_norm",
    "layer_norm": "layer_norm",
    "rope": "rope",
    "silu_and_mul": "activation",
    "gelu_and_mul": "activation",
    "softmax": "softmax",
    "embedding": "embedding",
    "flash_attention": "flash_attention",
    "flash_attention_paged": "flash_attention",
    "paged_attention": "paged_attention",
    "write_kv": "write_kv",
    "linear": "linear",
}


def family_module(name):
    return importlib.import_module(f"cuinfer.ops.{name}")


def __getattr__(name):
    if name in _OPS:
        return getattr(family_module(_OPS[name]), name)
    raise AttributeError(f"module 'cuinfer.ops' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_OPS))
