"""Make checkpoint directories: from a GGUF file, or with random weights for a config preset.

    python -m cuinfer.convert MODEL.gguf OUT_DIR
    python -m cuinfer.convert --random PRESET OUT_DIR [--dtype float16] [--seed 0]

PRESET is a name from models/ (llama3-8b, llama2-7b, mistral-7b, qwen2.5-7b, qwen3-8b, phi3-mini,
gemma2-9b, gemma3-12b-text, smollm2-135m, tiny, tiny-qwen2, tiny-qwen3, tiny-phi3, tiny-gemma2) or a
path to a config.json. Random weights have realistic scale: linear weights N(0, 1/fan_in)
(activations keep unit scale through every matmul), embeddings N(0, 1) (Gemma's N(0, 1/hidden):
the model scales them by sqrt(hidden)), norms multiplying by 1 + N(0, 0.05^2) (Gemma's (1 + w)
norms: w = N(0, 0.05^2)), biases N(0, 0.1^2). Each tensor is drawn from its own generator seeded
by (seed, crc32(name)), so a tensor does not depend on which others are made or in what order,
and a checkpoint is written one tensor at a time.

The tokenizer files of a random checkpoint are copied from the default model when it is
already in the cache, else a tiny byte-level BPE tokenizer is generated (works offline).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import zlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .cli import int_in
from .errors import CuinferError
from .io.checkpoint import expected_tensors, save_checkpoint
from .io.config import ModelConfig, load_config, numpy_dtype


def presets_dir() -> Path:
    """models/ beside cuinfer/ in a checkout, cuinfer/models when installed (as cuda_src is)."""
    here = Path(__file__).resolve().parent
    for d in (here.parent / "models", here / "models"):
        if d.is_dir():
            return d
    raise CuinferError(f"models/ (the config presets) not found next to {here}: reinstall cuinfer")


def preset_names() -> list:
    return sorted(p.stem for p in presets_dir().glob("*.json"))


def load_preset(preset) -> ModelConfig:
    """ModelConfig of a preset name in models/ or of a config.json path."""
    path = Path(preset)
    if path.suffix == ".json" or path.is_dir():
        return load_config(path)
    file = presets_dir() / f"{preset}.json"
    if not file.exists():
        raise CuinferError(f"unknown preset {preset!r}: need one of {', '.join(preset_names())} "
                           "or a path to a config.json")
    return load_config(file)


class RandomTensors(Mapping):
    """name -> random array for every tensor of `config`, made when it is looked up."""

    def __init__(self, config: ModelConfig, dtype="float16", seed: int = 0):
        self.config, self.dtype, self.seed = config, numpy_dtype(dtype), seed
        self.shapes = expected_tensors(config)

    def __getitem__(self, name):
        shape = self.shapes[name]  # KeyError for a name the config does not have
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        if name.endswith("norm.weight"):
            a = (1.0 - self.config.arch.norm_offset) + 0.05 * rng.standard_normal(shape, np.float32)
        elif name.endswith(".bias"):
            a = 0.1 * rng.standard_normal(shape, np.float32)
        elif name == "model.embed_tokens.weight":  # N(0, 1) after the model's embedding scale, if any
            scale = shape[1] ** -0.5 if self.config.arch.embed_scale else 1.0
            a = rng.standard_normal(shape, np.float32) * np.float32(scale)
        else:  # a linear weight [out, in]
            a = rng.standard_normal(shape, np.float32) * np.float32(shape[1] ** -0.5)
        return a.astype(self.dtype)

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self):
        return len(self.shapes)


def random_tensors(config: ModelConfig, dtype="float16", seed: int = 0) -> dict:
    """Every tensor of `config` with random weights, in memory (see RandomTensors)."""
    return dict(RandomTensors(config, dtype, seed))


def random_checkpoint(preset, out_dir, dtype="float16", seed: int = 0, tokenizer_from=None,
                      overwrite=False) -> Path:
    """Write a random-weight checkpoint directory for a preset; returns its path.

    tokenizer_from: a directory with tokenizer files; default the cached default model if it
    was already converted, else a generated tiny tokenizer.
    """
    from .io.default_model import cached_default_model_dir
    from .io.tokenizer import write_tiny_tokenizer

    config = load_preset(preset)
    tokenizer_from = tokenizer_from or cached_default_model_dir()
    with tempfile.TemporaryDirectory() as tiny:
        if tokenizer_from is None:
            write_tiny_tokenizer(tiny)
            tokenizer_from = tiny
        return save_checkpoint(out_dir, config, RandomTensors(config, dtype, seed), tokenizer_from,
                               dtype=dtype, overwrite=overwrite)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cuinfer.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a GGUF file, or with --random a preset name or config.json")
    p.add_argument("out_dir", help="the checkpoint directory to create")
    p.add_argument("--random", action="store_true", help="random weights for the preset SOURCE")
    p.add_argument("--dtype", default=None,
                   help="stored dtype: float32, float16, bfloat16 (default: float16 for --random, "
                        "float32 for GGUF, which holds its dequantized values exactly)")
    p.add_argument("--seed", type=int_in(0), default=0)
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    args = p.parse_args(argv)
    try:
        if args.random:
            out = random_checkpoint(args.source, args.out_dir, args.dtype or "float16", args.seed,
                                    overwrite=args.overwrite)
        else:
            from .io.gguf import convert_gguf

            out = convert_gguf(args.source, args.out_dir, args.dtype or "float32",
                               overwrite=args.overwrite)
    except CuinferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = json.loads((Path(out) / "config.json").read_text())
    print(f"wrote {out} ({config['architectures'][0]}, {config['num_hidden_layers']} layers, "
          f"{config['torch_dtype']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
