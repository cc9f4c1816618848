"""Quality checks: python -m cuinfer.eval perplexity CKPT --text FILE [--quant none int8 int4 ...].

Perplexity with a sliding window (as in the Hugging Face perplexity guide): windows of
`--window` tokens start every `--stride` tokens; each token is scored once, by the first
window that holds it with context before it, so every token after the first window
sees at least window - stride tokens of context. Each window is a fresh sequence
(positions from 0) in one paged KV cache that is reused. Several `--quant` values run
the same text and print their perplexity relative to the first. `--kv-cache-dtype fp8` keeps
that cache in fp8 (E4M3), to measure what an fp8 KV cache costs in perplexity.
"""
from __future__ import annotations

import argparse
import math
import sys

import numpy as np

from .cli import add_kv_cache_dtype_argument, check_dtype, int_in
from .ops import runtime


def token_nll(logits, targets):
    """Negative log-likelihood (float64) of targets [n] under logits [n, vocab]."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(z).sum(axis=1))
    return log_norm - z[np.arange(len(targets)), targets]


def windows(n_tokens: int, window: int, stride: int):
    """(begin, end, first scored index) per window; with stride < window every token t >= 1 is
    scored exactly once, with at least window - stride tokens of context once t >= window."""
    scored = 1  # token 0 has no context
    for begin in range(0, n_tokens, stride):
        end = min(begin + window, n_tokens)
        if end > scored:
            yield begin, end, scored
            scored = end
        if end == n_tokens:
            return


def perplexity(model, ids, window: int = 512, stride: int = 256, block_size: int = 16, kv_cache_dtype: str = "auto"):
    """(perplexity, tokens scored) of the token ids under `model` (cuinfer.model.decoder.Model), its
    KV cache in kv_cache_dtype ("auto": the model's dtype, or "fp8")."""
    from .model.kv_cache import CacheShape, KVCache, kv_cache_dtype_for
    from .model.step_inputs import Batch

    if stride < 1 or stride >= window:
        raise runtime.CuinferError(f"--stride {stride}: need 1 <= stride < window ({window})")
    if len(ids) < 2:
        raise runtime.CuinferError("the text has fewer than 2 tokens: nothing to score")
    cfg = model.config
    n_blocks = -(-window // block_size)
    cache = KVCache(CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size),
                    n_blocks, kv_cache_dtype_for(kv_cache_dtype, model.dtype), model.xp)
    table = list(range(n_blocks))
    ids = np.asarray(ids, dtype=np.int64)
    nll, count = 0.0, 0
    for begin, end, first in windows(len(ids), window, stride):
        batch = Batch.from_chunks([(ids[begin:end], 0, table)], block_size)
        logits = model.forward(batch.to(model.xp), cache, all_logits=True)
        logits = runtime.cupy_or_none().asnumpy(logits) if runtime.is_device_array(logits) else logits
        # logits[j] predicts ids[begin + j + 1]: the scored targets first .. end - 1
        nll += token_nll(logits[first - begin - 1:end - begin - 1], ids[first:end]).sum()
        count += end - first
    return math.exp(nll / count), count


def read_ids(checkpoint, path):
    """Token ids of a UTF-8 text file under the checkpoint's tokenizer."""
    from .io.tokenizer import Tokenizer

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise runtime.CuinferError(f"{path}: {e.strerror}") from None
    return Tokenizer.from_pretrained(checkpoint).encode(text)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m cuinfer.eval", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("perplexity", help="sliding-window perplexity of a text file")
    p.add_argument("checkpoint", help="checkpoint directory (config.json, *.safetensors, tokenizer.json) or GGUF file")
    p.add_argument("--text", required=True, help="UTF-8 text file")
    p.add_argument("--window", type=int_in(2), default=512)
    p.add_argument("--stride", type=int_in(1), default=256)
    p.add_argument("--max-tokens", type=int_in(2), default=None, help="score only the first N tokens")
    p.add_argument("--device", choices=("gpu", "cpu"), help="default: gpu when one is found")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"),
                   help="GPU: float16 or bfloat16 (default from the checkpoint); CPU: float32")
    p.add_argument("--quant", nargs="+", default=["none"],
                   help="weight formats to compare: none, int8, int4 (g128, fit minmax), int4-g32, int4-g32-mse, "
                        "int4-gptq, ... (cuinfer.ops.quant.parse_spec; a group size not dividing in_features shrinks "
                        "to one that does); a checkpoint saved quantized (python -m cuinfer.quantize) runs as none")
    add_kv_cache_dtype_argument(p)
    p.add_argument("--calib", help="calibration text for the -gptq formats (another text than --text)")
    p.add_argument("--calib-tokens", type=int_in(1), default=4096, help="calibration tokens (sequences of 512)")
    args = parser.parse_args(argv)
    try:
        from .io.checkpoint import load_checkpoint, resolve_checkpoint
        from .model.decoder import Model
        from .model.gptq import gptq_model
        from .ops.quant import parse_spec

        gptq = [q for q in args.quant if q != "none" and parse_spec(q)[2] == "gptq"]  # a bad value fails here
        if gptq and not args.calib:
            raise runtime.CuinferError(f"--quant {gptq[0]}: needs --calib FILE (calibration text)")
        args.device = runtime.pick_device(args.device)
        check_dtype(args.device, args.dtype)
        args.checkpoint = resolve_checkpoint(args.checkpoint)
        ids = read_ids(args.checkpoint, args.text)[: args.max_tokens]
        config, tensors = load_checkpoint(args.checkpoint)
        calib_ids = read_ids(args.checkpoint, args.calib)[: args.calib_tokens] if gptq else None
        base = None
        print(f"{len(ids)} tokens, window {args.window}, stride {args.stride}, device {args.device}, "
              f"kv cache {args.kv_cache_dtype}")
        for quant in args.quant:
            if quant in gptq:
                model = gptq_model(config, tensors, calib_ids, parse_spec(quant)[1], args.device, args.dtype)
            else:
                model = Model.from_tensors(config, tensors, args.device, args.dtype, None if quant == "none" else quant)
            ppl, n = perplexity(model, ids, args.window, args.stride, kv_cache_dtype=args.kv_cache_dtype)
            base = base or ppl
            print(f"{quant:>16}: perplexity {ppl:.4f} over {n} tokens ({100 * (ppl / base - 1):+.2f}% vs {args.quant[0]})")
            del model
    except runtime.CuinferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
