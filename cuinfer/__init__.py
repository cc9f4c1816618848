"""cuinfer: decoder-only LLM inference (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3) with CUDA C++
kernels compiled at run time through CuPy.

    from cuinfer import Engine, SamplingParams

`import cuinfer` and every NumPy path work without CuPy; GPU paths import it lazily. The public
names load on first use, so `import cuinfer.errors` alone imports nothing else.
"""
__version__ = "0.1.0"
__all__ = ["Engine", "RequestOutput", "SamplingParams"]


def __getattr__(name):
    if name == "Engine":
        from .serving.engine import Engine

        return Engine
    if name == "RequestOutput":
        from .serving.request import RequestOutput

        return RequestOutput
    if name == "SamplingParams":
        from .serving.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'cuinfer' has no attribute {name!r}")
