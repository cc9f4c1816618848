"""Model configuration of a decoder, read explicitly from a Hugging Face config.json.

The architectures are those of cuinfer.model.arch (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2,
Gemma 3 text); the fields shared by all are read here, each family's own (biases, windows per
layer, softcaps, ...) by its module's `read`. Every field the engine uses is read by name and
validated here, so a config the engine cannot run is refused when it is loaded, not half-way
through a forward.

Transformers 5 writes `dtype` for `torch_dtype` and `rope_parameters` for rope_theta/rope_scaling
(per layer type for Gemma 3: the full layers' here, the sliding layers' base in
rope_local_base_freq); both spellings are read.

A checkpoint saved by cuinfer.quantize carries a `quantization` entry (quant_io.quantization_config),
kept as read here and validated by quant_io.check_entry when the checkpoint loads (config imports no
quantization code); Hugging Face's own `quantization_config` (AWQ, GPTQ, bitsandbytes exports) is refused.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import CuinferError, bfloat16
from ..model.arch import ARCHES, FULL, SLIDING, Arch

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # hidden_act: SwiGLU or GELU-tanh GEGLU

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": bfloat16}

# the keys rope_scaling {"rope_type": "llama3", ...} must carry
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
OPTIONAL_NUMBERS = ("rope_local_base_freq", "query_pre_attn_scalar", "attn_logit_softcapping",
                   "final_logit_softcapping")


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
    # None (plain RoPE), {"rope_type": "linear", factor} or {"rope_type": "llama3", factor,
    # low_freq_factor, high_freq_factor, original_max_position_embeddings} or {"rope_type": "longrope",
    # short_factor, long_factor, original_max_position_embeddings, attention_factor} (Phi-3)
    rope_scaling: dict | None = field(default=None, hash=False)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    torch_dtype: str = "float32"
    hidden_act: str = "silu"
    sliding_window: int | None = None
    # None (every layer full) or per layer "sliding_attention" (keys within sliding_window) / "full_attention"
    layer_types: tuple | None = None
    rope_local_base_freq: float | None = None  # the sliding layers' RoPE base when it differs (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale query_pre_attn_scalar^-1/2, else head_dim^-1/2
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    bos_token_id: int | None = None
    eos_token_id: tuple = ()
    # None (float weights) or the entry cuinfer.quantize writes: {"method": "int8" | "int4", "bits",
    # "group_size" (int4), "fit" (int4), "modules": the arch's linear modules, "lm_head": "int8",
    # "layout": quant.INT4_LAYOUT (int4)}
    quantization: dict | None = field(default=None, hash=False)

    @property
    def arch(self) -> Arch:
        return ARCHES[self.architecture]

    @property
    def model_type(self) -> str:
        return self.arch.names[self.architecture]

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in keys (a query sees itself and the window - 1 before it);
        0 for full attention."""
        sliding = self.layer_types is not None and self.layer_types[layer] == SLIDING
        return self.sliding_window if sliding else 0

    @property
    def attention_scale(self) -> float:
        """query_pre_attn_scalar^-1/2 (else head_dim^-1/2), times longrope's attention_factor squared
        (transformers scales cos and sin, so q and k, by it; cuinfer scales the scores instead)."""
        m = (self.rope_scaling or {}).get("attention_factor", 1.0)
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5 * m * m

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
        supported = [a for a in archs if a in ARCHES]
        if not supported:
            got = ", ".join(archs) or f"none (model_type {d.get('model_type')!r})"
            raise CuinferError(f"unsupported architecture {got}: cuinfer runs {', '.join(ARCHES)}")
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
        rope = rope.get(FULL, rope)  # per layer type (Gemma 3): the full layers' (arch reads the others')
        rope_theta = float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_scaling = _rope_scaling(d.get("rope_scaling") or rope or None, d)
        dtype = d.get("torch_dtype") or d.get("dtype") or "float32"
        numpy_dtype(dtype)
        eos = d.get("eos_token_id")
        eos = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        max_pos = int(d.get("max_position_embeddings") or 4096)
        family = {"hidden_act": d.get("hidden_act") or "silu",
                  "tie_word_embeddings": bool(d.get("tie_word_embeddings")), **ARCHES[arch].read(d)}
        _check_family(d, family)
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
            torch_dtype=dtype,
            sliding_window=d.get("sliding_window") if family["layer_types"] else None,
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=eos,
            quantization=d.get("quantization"),  # checked by quant_io.check_entry when loaded
            **family,
        )

    def to_dict(self) -> dict:
        """A Hugging Face config.json dict; ModelConfig.from_dict(c.to_dict()) == c."""
        d = {"architectures": [self.architecture], "model_type": self.model_type}
        for f in dataclasses.fields(self):
            if f.name != "architecture" and not (f.name == "quantization" and self.quantization is None):
                d[f.name] = getattr(self, f.name)
        d["eos_token_id"] = list(self.eos_token_id)
        d["layer_types"] = None if self.layer_types is None else list(self.layer_types)
        d["use_sliding_window"] = self.layer_types is not None  # Qwen's switch for the windows
        d["hidden_activation"] = self.hidden_act  # Gemma's spelling
        return d

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _check_family(d: dict, f: dict):
    """The fields an architecture module read: CuinferError for one the engine cannot run."""
    if f["hidden_act"] not in ACTIVATIONS:
        raise CuinferError(f"config: hidden_act {f['hidden_act']!r} is not supported: need one of "
                           f"{', '.join(ACTIVATIONS)}")
    types = f["layer_types"]
    if len(types) != d["num_hidden_layers"] or not set(types) <= {SLIDING, FULL}:
        raise CuinferError(f"config: layer_types {json.dumps(list(types))}: need one of {SLIDING!r} / {FULL!r} "
                           f"per layer ({d['num_hidden_layers']})")
    window = d.get("sliding_window")
    if SLIDING in types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise CuinferError(f"config: sliding_window is {json.dumps(window)}, need a positive integer")
    for k in OPTIONAL_NUMBERS:  # kept as written (transformers checks int / float when it reads them back)
        v = f.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise CuinferError(f"config: {k} is {json.dumps(v)}, need a positive number")
    f["layer_types"] = None if set(types) <= {FULL} else tuple(types)


def _rope_scaling(rs: dict | None, d: dict) -> dict | None:
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return None
    if kind == "longrope":
        return _longrope(rs, d)
    if kind == "linear":
        factor = rs.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise CuinferError(f"rope_scaling linear: factor is {json.dumps(factor)}, need a positive number")
        return {"rope_type": "linear", "factor": float(factor)}
    if kind != "llama3":
        raise CuinferError(f"rope_scaling type {kind!r} is not supported: cuinfer implements "
                           "plain RoPE and rope_type 'linear', 'llama3' and 'longrope'")
    missing = [k for k in LLAMA3_ROPE_KEYS if rs.get(k) is None]
    if missing:
        raise CuinferError(f"rope_scaling llama3: missing {', '.join(missing)}")
    return {"rope_type": "llama3", **{k: float(rs[k]) for k in LLAMA3_ROPE_KEYS[:3]},
            "original_max_position_embeddings": int(rs["original_max_position_embeddings"])}


def _longrope(rs: dict, d: dict) -> dict:
    """Phi-3's longrope (transformers' _compute_longrope_parameters): frequency i divided by
    short_factor[i], or long_factor[i] for a sequence longer than original_max_position_embeddings;
    cos and sin times attention_factor (default sqrt(1 + ln(factor) / ln(original)), factor
    max_position_embeddings / original unless given; 1 when factor <= 1)."""
    orig = rs.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
    half = (d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]) // 2
    for key in ("short_factor", "long_factor"):
        f = rs.get(key)
        if not isinstance(f, (list, tuple)) or len(f) != half or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in f):
            raise CuinferError(f"rope_scaling longrope: {key} is {json.dumps(f)}, need {half} positive numbers "
                               "(head_dim / 2)")
    if isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
        raise CuinferError(f"rope_scaling longrope: original_max_position_embeddings is {json.dumps(orig)}, "
                           "need a positive integer")
    factor = rs.get("factor") or (d.get("max_position_embeddings") or 4096) / orig
    attention = rs.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return {"rope_type": "longrope", "short_factor": [float(x) for x in rs["short_factor"]],
            "long_factor": [float(x) for x in rs["long_factor"]], "original_max_position_embeddings": orig,
            "attention_factor": float(attention)}


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
