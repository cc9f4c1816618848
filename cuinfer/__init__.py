"""cuinfer: LLaMA-family inference with CUDA C++ kernels compiled at run time through CuPy.

`import cuinfer` and every NumPy path work without CuPy; GPU paths import it lazily.
"""
__version__ = "0.1.0"
