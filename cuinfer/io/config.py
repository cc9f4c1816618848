"""Model configuration of a LLaMA-family decoder, read explicitly from a Hugging Face config.json.

Supported architectures: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (q/k/v
projections with bias). Every field the engine uses is read by name and validated here, so
a config the engine cannot run is refused when it is loaded, not half-way through a forward.

Notes on fields that are read but not honoured:
- sliding_window (Mistral v0.1, Qwen2 with use_sliding_window): attention is always full.
  Outputs match the reference up to the window length; a warning says so when a window
  shorter than max_position_embeddings is active.
- Transformers 5 writes `dtype` for `torch_dtype` and `rope_parameters` for
  rope_theta/rope_scaling; both spellings are read.

A checkpoint saved by cuinfer.quantize carries a `quantization` entry (quant_io.quantization_config),
kept as read here and validated by quant_io.check_entry when the checkpoint loads (config imports no
quantization code); Hugging Face's own `quantization_config` (AWQ, GPTQ, bitsandbytes exports) is refused.
"""
from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import CuinferError, bfloat16

# Hugging Face architecture name -> model_type written back by to_dict()
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": bfloat16}

# the keys rope_scaling {"rope_type": "llama3", ...} must carry
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def numpy_dtype(name) -> np.dtype:
    """numpy dtype for "float32" / "float16" / "bfloat16" (a numpy dtype passes through)."""
    if isinstance(name, str):
        if name not in DTYPES:
            raise CuinferError(f"dtype {name!r} is not supported: need one of {', '.join(DTYPES)}")
        return DTYPES[name]
    dtype = np.dtype(name)
    if dtype not in DTYPES.values():
        raise CuinferError(f"dtype {dtype} is not supported: need one of {', '.join(DTYPES)}")
    return dtype


def dtype_name(dtype) -> str:
    """Inverse of numpy_dtype: "float32" / "float16" / "bfloat16"."""
    dtype = numpy_dtype(dtype)
    return next(k for k, v in DTYPES.items() if v == dtype)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None (plain RoPE) or {"rope_type": "llama3", factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings}
    rope_scaling: dict | None = field(default=None, hash=False)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: tuple = ()
    # None (float weights) or the entry cuinfer.quantize writes: {"method": "int8" | "int4", "bits",
    # "group_size" (int4), "fit" (int4), "modules": quant_io.LINEAR_MODULES, "lm_head": "int8",
    # "layout": quant.INT4_LAYOUT (int4)}
    quantization: dict | None = field(default=None, hash=False)

    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture]

    @property
    def dtype(self) -> np.dtype:
        """The checkpoint's stored dtype (torch_dtype) as a numpy dtype."""
        return numpy_dtype(self.torch_dtype)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """Read a Hugging Face config.json dict; CuinferError names the first problem found."""
        archs = d.get("architectures") or []
        supported = [a for a in archs if a in ARCHITECTURES]
        if not supported:
            got = ", ".join(archs) or f"none (model_type {d.get('model_type')!r})"
            raise CuinferError(
                f"unsupported architecture {got}: cuinfer runs {', '.join(ARCHITECTURES)}"
            )
        arch = supported[0]
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if d.get(k) is None]
        if missing:
            raise CuinferError(f"config: missing {', '.join(missing)}")
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = d.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise CuinferError(f"config: {k} is {json.dumps(v)}, need a positive integer")
        n_heads = int(d["num_attention_heads"])
        n_kv = int(d.get("num_key_value_heads") or n_heads)
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim")
        if head_dim is None:
            if hidden % n_heads:
                raise CuinferError(f"config: hidden_size {hidden} is not a multiple of "
                                   f"num_attention_heads {n_heads} and no head_dim is given")
            head_dim = hidden // n_heads
        if n_heads % n_kv:
            raise CuinferError(f"config: num_attention_heads {n_heads} is not a multiple of "
                               f"num_key_value_heads {n_kv}")
        rope = d.get("rope_parameters") or {}
        rope_theta = float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_scaling = _rope_scaling(d.get("rope_scaling") or rope or None)
        dtype = d.get("torch_dtype") or d.get("dtype") or "float32"
        numpy_dtype(dtype)
        eos = d.get("eos_token_id")
        eos = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        max_pos = int(d.get("max_position_embeddings") or 4096)
        window = d.get("sliding_window")
        if window and d.get("use_sliding_window", arch == "MistralForCausalLM") and window < max_pos:
            warnings.warn(f"sliding_window={window} is ignored: cuinfer attends to the whole "
                          f"context, so outputs past {window} tokens differ from the original")
        bos = d.get("bos_token_id")
        if d.get("quantization_config"):
            raise CuinferError("config: a Hugging Face quantization_config is not supported: cuinfer loads float "
                               "checkpoints and its own quantized ones (python -m cuinfer.quantize)")
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama/Mistral configs may ask for it
            attention_bias=arch == "Qwen2ForCausalLM" or bool(d.get("attention_bias", False)),
            torch_dtype=dtype,
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=eos,
            quantization=d.get("quantization"),  # checked by quant_io.check_entry when loaded
        )

    def to_dict(self) -> dict:
        """A Hugging Face config.json dict; ModelConfig.from_dict(c.to_dict()) == c."""
        d = {"architectures": [self.architecture], "model_type": self.model_type}
        for f in dataclasses.fields(self):
            if f.name != "architecture" and not (f.name == "quantization" and self.quantization is None):
                d[f.name] = getattr(self, f.name)
        d["eos_token_id"] = list(self.eos_token_id)
        d["hidden_act"] = "silu"
        return d

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _rope_scaling(rs: dict | None) -> dict | None:
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise CuinferError(f"rope_scaling type {kind!r} is not supported: cuinfer implements "
                           "plain RoPE and rope_type 'llama3'")
    missing = [k for k in LLAMA3_ROPE_KEYS if rs.get(k) is None]
    if missing:
        raise CuinferError(f"rope_scaling llama3: missing {', '.join(missing)}")
    return {"rope_type": "llama3", **{k: float(rs[k]) for k in LLAMA3_ROPE_KEYS[:3]},
            "original_max_position_embeddings": int(rs["original_max_position_embeddings"])}


def load_config(path) -> ModelConfig:
    """ModelConfig from a checkpoint directory or a config.json file."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        d = json.loads(file.read_text())
    except FileNotFoundError:
        raise CuinferError(f"{file}: no such file (a checkpoint directory holds config.json)") from None
    except (OSError, ValueError) as e:
        raise CuinferError(f"{file}: cannot read config: {e}") from None
    if not isinstance(d, dict):
        raise CuinferError(f"{file}: config is not a JSON object")
    return ModelConfig.from_dict(d)
