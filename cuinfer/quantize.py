"""Save a quantized checkpoint: python -m cuinfer.quantize SRC DST --quant SPEC [--calib FILE --calib-tokens N].

SRC is a float checkpoint directory; DST gets every decoder linear weight quantized as --quant
SPEC quantizes it at load (quant.parse_spec: int8, int4, int4-g32, int4-g64-mse, ...), or fitted
by GPTQ for the -gptq specs (calibration text read through SRC's tokenizer), the lm_head in
model.LM_HEAD_QUANT, the other tensors as they are, config.json with a `quantization` entry and
the tokenizer files. DST then loads with no --quant (generate, eval, Engine.from_pretrained),
with the same logits as quantizing SRC at load; a --quant given for it is an error.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .cli import int_in
from .errors import CuinferError
from .io.checkpoint import expected_tensors, load_checkpoint, progress_bar, save_checkpoint, weight_shapes
from .io.quant_io import is_quantized, quantization_config
from .ops.quant import parse_spec, quantize_spec


class QuantizedTensors(Mapping):
    """name -> tensor of the quantized checkpoint (config: its ModelConfig), made when looked up: a
    quantized weight from `fitted` (name -> weight, e.g. GPTQ's) or rounded to nearest from the float
    `tensors` (the lm_head from the embedding when tied), the rest as `tensors` holds it."""

    def __init__(self, config, tensors, spec, fitted):
        self.names, self.entry = list(weight_shapes(config)), config.quantization
        self.tensors, self.spec, self.fitted = tensors, spec, fitted

    def __getitem__(self, name):
        if name in self.fitted:
            return self.fitted[name]
        if not is_quantized(name, self.entry):
            return self.tensors[name]
        spec = self.entry["lm_head"] if name == "lm_head.weight" else self.spec
        w = self.tensors[name if name in self.tensors else "model.embed_tokens.weight"]  # a tied lm_head: the embedding
        return quantize_spec(np.asarray(w, dtype=np.float32), spec)

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


def quantize_checkpoint(src, dst, spec, calib_ids=None, overwrite=False) -> Path:
    """Write the quantized checkpoint DST of the float checkpoint SRC (module docstring); returns its path.
    calib_ids: the calibration token ids, needed for a -gptq spec."""
    from .model.decoder import LM_HEAD_QUANT, Model
    from .model.gptq import gptq_weights
    from .model.weights import linear_tensors

    config, tensors = load_checkpoint(src)
    if config.quantization:
        raise CuinferError(f"{src}: quantized already ({config.quantization['method']}): "
                                   "quantize a float checkpoint")
    _, group_size, fit = parse_spec(spec)
    qconfig = config.replace(quantization=quantization_config(spec, LM_HEAD_QUANT, config.arch.modules(config)))
    expected_tensors(qconfig)  # an int4 group for every matrix, or the error now rather than after GPTQ
    fitted = {}
    if fit == "gptq":
        if calib_ids is None:
            raise CuinferError(f"--quant {spec}: needs --calib FILE (calibration text)")
        layer_bytes = sum(a.nbytes for n, a in tensors.items() if n.startswith("model.layers.0."))
        with progress_bar(config.num_hidden_layers * layer_bytes, f"GPTQ {Path(src).name}") as bar:
            weights = gptq_weights(Model.from_tensors(config, tensors, "cpu"), calib_ids, group_size,
                                   progress=lambda i: bar.update(layer_bytes))
        fitted = linear_tensors(config, weights)
    return save_checkpoint(dst, qconfig, QuantizedTensors(qconfig, tensors, spec, fitted), tokenizer_files_from=src,
                           overwrite=overwrite)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cuinfer.quantize", description=__doc__.splitlines()[0])
    p.add_argument("src", help="float checkpoint directory or GGUF file")
    p.add_argument("dst", help="the quantized checkpoint directory to create")
    p.add_argument("--quant", required=True, metavar="SPEC",
                   help="int8, int4 (group 128, fit minmax), int4-g32, int4-g64-mse, int4-gptq, ... (quant.parse_spec)")
    p.add_argument("--calib", help="calibration text for the -gptq formats")
    p.add_argument("--calib-tokens", type=int_in(1), default=4096, help="calibration tokens (sequences of 512)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    args = p.parse_args(argv)
    try:
        from .eval import read_ids
        from .io.checkpoint import resolve_checkpoint

        args.src = resolve_checkpoint(args.src)
        gptq = parse_spec(args.quant)[2] == "gptq"
        if args.calib and not gptq:
            raise CuinferError(f"--calib: only the -gptq formats calibrate, not --quant {args.quant}")
        calib_ids = read_ids(args.src, args.calib)[: args.calib_tokens] if gptq and args.calib else None
        out = quantize_checkpoint(args.src, args.dst, args.quant, calib_ids, args.overwrite)
    except CuinferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = lambda d: sum(f.stat().st_size for f in Path(d).glob("*.safetensors")) / 2**20
    print(f"wrote {out} ({args.quant}: {size(out):.1f} MiB of weights, {size(args.src):.1f} MiB in {args.src})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
