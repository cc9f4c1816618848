"""Flag helpers the command-line tools share (generate, serve, eval, quantize, bench): argparse types
that refuse a bad value while parsing, before any model loads, and the checks made once the device is
known."""
from __future__ import annotations

import argparse

from .ops import runtime


def add_speculative_arguments(p) -> None:
    """--speculative, --speculative-model, --num-speculative-tokens (generate and serve)."""
    from .serving.spec import MAX_SPECULATIVE_TOKENS

    g = p.add_mutually_exclusive_group()
    g.add_argument("--speculative", choices=("ngram",),
                   help="speculative decoding with prompt lookup (drafts from the prompt and output)")
    g.add_argument("--speculative-model", metavar="CKPT",
                   help="speculative decoding with a draft model: a checkpoint with the same tokenizer "
                        "(e.g. an int4 copy of the target made by python -m cuinfer.quantize)")
    p.add_argument("--num-speculative-tokens", type=int_in(1, MAX_SPECULATIVE_TOKENS), default=4, metavar="K",
                   help="draft tokens verified per step (default 4)")


KV_CACHE_DTYPES = ("auto", "fp8")


def add_kv_cache_dtype_argument(p) -> None:
    """--kv-cache-dtype {auto,fp8} (Engine.from_pretrained's kv_cache_dtype, cuinfer.ops.fp8)."""
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="KV cache element type: auto (the model's dtype) or fp8 (E4M3, half the bytes a token: "
                        "twice the tokens in the same memory)")


def speculative_options(args) -> dict:
    """Engine.from_pretrained's speculative keywords from the parsed flags."""
    return dict(speculative=args.speculative, speculative_model=args.speculative_model,
                num_speculative_tokens=args.num_speculative_tokens)


def check_dtype(device: str, dtype) -> None:
    """--dtype for the device picked (None: the default): float32 on the CPU, float16 / bfloat16 on the GPU."""
    if device == "cpu" and dtype not in (None, "float32"):
        raise runtime.CuinferError(f"--dtype {dtype}: the CPU backend runs float32")
    if device == "gpu" and dtype == "float32":
        raise runtime.CuinferError("--dtype float32: the GPU attention kernels need float16 or bfloat16")


def int_in(lo: int, hi: int | None = None):
    """An argparse type: an integer in lo..hi (no upper bound without hi), refused while parsing,
    before any model loads."""
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            n = None
        if n is None or n < lo or (hi is not None and n > hi):
            need = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"got {value!r}, need an integer {need}")
        return n
    return parse


def quant_spec(value: str) -> str:
    """argparse type of --quant: a cuinfer.ops.quant.parse_spec string."""
    from .ops.quant import parse_spec

    try:
        parse_spec(value)
    except runtime.CuinferError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value
