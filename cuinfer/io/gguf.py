"""GGUF import: a GGUF file of an architecture with GGUF names (cuinfer.model.arch) -> a checkpoint directory.

    convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "out/")     (python -m cuinfer.convert)

Tensors of type F32, F16, BF16, Q8_0, Q4_0 and Q4_1 are dequantized to float32 here (NumPy,
in float32 as ggml does: Q8_0 d*q, Q4_0 d*(q-8), Q4_1 d*q + m, with d and m stored as fp16).
The names are the architecture's (Llama, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3: cuinfer.model.arch),
and so is what a family's metadata means beyond the shared keys (Arch.gguf_read: Gemma's softcaps,
windows and attention scale, Phi-3's longrope factors). For Llama, llama.cpp's converter permutes the
rows of Q and K so that rotary pairs are adjacent (interleaved RoPE); `unpermute_rows` puts them back
in the Hugging Face half-split layout. Gemma's norms are stored as 1 + w: the import subtracts the 1
(Arch.gguf_norm_shift). A sliding window llama.cpp stores applies to every layer (Phi-3; 0: none)
unless the family says otherwise. Linear RoPE scaling is read; other GGUF scaling is refused.
`raw_tensors` yields the undequantized blocks (rows already in Hugging Face order) for a
direct INT8/INT4 import.

The tokenizer is rebuilt from the vocabulary: gpt2-style byte-level BPE, or llama-style
SentencePiece BPE (Llama 2, Mistral, Phi-3: `sentencepiece_bpe`). The byte-level pre-tokenizer
follows llama.cpp's `tokenizer.ggml.pre`; for "smollm" that is single digits split off before the
GPT-2 byte-level regex, as SmolLM2's own tokenizer.json does.
(transformers' GGUF loader uses the plain GPT-2 regex for "smollm", which differs where
whitespace runs precede a digit: "  1" -> [" ", " ", "1"] there, ["  ", "1"] here.)

The `gguf` package is imported lazily: only conversion needs it.
"""
from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..errors import CuinferError
from ..model.arch import ARCHES, SLIDING, Arch
from .checkpoint import expected_tensors, save_checkpoint
from .config import ModelConfig

# general.architecture -> the Arch whose GGUF files cuinfer imports (its gguf_names: the name table)
GGUF_ARCHES = {a.gguf_arch: a for a in ARCHES.values() if a.gguf_arch}

# ggml type -> (elements per block, bytes per block)
BLOCKS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18),
          "Q4_1": (32, 20)}
# llama.cpp tokenizer.ggml.pre -> how to split text before byte-level BPE
PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe", "qwen2")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # Qwen2 / Qwen3: single digits
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6  # llama.cpp token types


class RawTensor(NamedTuple):
    name: str  # Hugging Face name
    gguf_name: str
    type: str  # "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"
    blocks: np.ndarray  # uint8 [rows, row_bytes]: a row's blocks, rows in Hugging Face order
    shape: tuple  # Hugging Face shape, e.g. [out_features, in_features]


def hf_name(gguf_name: str, arch: Arch = GGUF_ARCHES["llama"]) -> str:
    """The Hugging Face name of a GGUF tensor of `arch`'s files."""
    for g, name in arch.gguf_names.items():
        m = re.fullmatch(re.escape(g).replace(r"\{i\}", r"(\d+)"), gguf_name)
        if m:
            return name.format(i=m.group(1)) if m.groups() else name
    raise CuinferError(f"unknown GGUF tensor {gguf_name!r}: cuinfer maps {', '.join(arch.gguf_names)}")


# ------------------------------------------------------------------ dequantization


def dequantize(blocks: np.ndarray, kind: str, n: int) -> np.ndarray:
    """float32 [rows, n] from uint8 [rows, row_bytes] blocks of ggml type `kind`."""
    rows = blocks.shape[0]
    if kind == "F32":
        return blocks.view("<f4").reshape(rows, n).copy()
    if kind == "F16":
        return blocks.view("<f2").reshape(rows, n).astype(np.float32)
    if kind == "BF16":  # the top half of a float32
        return (blocks.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(rows, n)
    size, nbytes = BLOCKS[kind]
    b = blocks.reshape(rows, n // size, nbytes)
    d = b[..., 0:2].copy().view("<f2").astype(np.float32)  # [rows, n_blocks, 1]
    if kind == "Q8_0":
        return (d * b[..., 2:].view(np.int8).astype(np.float32)).reshape(rows, n)
    qs = b[..., -16:]  # element j in the low nibble of byte j, element j + 16 in the high one
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
    if kind == "Q4_0":
        return (d * (q - 8.0)).reshape(rows, n)
    m = b[..., 2:4].copy().view("<f2").astype(np.float32)
    return (d * q + m).reshape(rows, n)  # Q4_1


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head, rows (pair p, half h) -> (half h, pair p)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ------------------------------------------------------------------ reading


def open_gguf(path):
    """A gguf.GGUFReader for a GGUF file of an architecture cuinfer imports; CuinferError for anything else."""
    try:
        import gguf
    except ImportError:
        raise CuinferError("GGUF import needs the gguf package: pip install gguf") from None
    path = Path(path)
    if not path.is_file():
        raise CuinferError(f"{path}: no such file")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError, ...
        raise CuinferError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHES:
        raise CuinferError(f"{path}: GGUF architecture {arch!r} is not supported: cuinfer "
                           f"converts {', '.join(GGUF_ARCHES)} GGUF files")
    for t in reader.tensors:
        if t.tensor_type.name not in BLOCKS:
            raise CuinferError(f"{path}: tensor {t.name} has GGUF type {t.tensor_type.name}: "
                               f"cuinfer converts {', '.join(BLOCKS)}")
    return reader


def field(reader, key, default=KeyError):
    f = reader.fields.get(key)
    if f is None:
        if default is KeyError:
            raise CuinferError(f"GGUF metadata has no {key}")
        return default
    return f.contents()


def gguf_config(reader) -> ModelConfig:
    kind = field(reader, "general.architecture")
    a, arch = f"{kind}.", GGUF_ARCHES[kind]
    n_heads = field(reader, a + "attention.head_count")
    hidden = field(reader, a + "embedding_length")
    scaling = field(reader, a + "rope.scaling.type", None)
    if scaling not in (None, "none", "linear") or any(
            t.name.startswith("rope_") and t.name not in arch.gguf_config_tensors for t in reader.tensors):
        raise CuinferError(f"GGUF rope scaling {scaling or 'by tensor'} (rope.scaling.type / rope_freqs / "
                           "rope_factors) is not supported: cuinfer imports linear scaling and Phi-3's longrope")
    names = {t.name for t in reader.tensors}
    # llama.cpp's sliding window: every layer's (Phi-3; 0: none), unless the family says otherwise
    window = field(reader, a + "attention.sliding_window", None) or None
    n_layers = field(reader, a + "block_count")
    fields = {
        "architecture": next(iter(arch.names)),
        # the embedding's rows (llama.cpp drops Gemma 3's rows past its tokenizer), else the metadata's
        "vocab_size": next((int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight"), None)
        or field(reader, a + "vocab_size", None) or len(field(reader, "tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": field(reader, a + "feed_forward_length"),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": field(reader, a + "attention.head_count_kv", n_heads),
        "head_dim": field(reader, a + "attention.key_length", None) or hidden // n_heads,
        "rms_norm_eps": float(field(reader, a + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field(reader, a + "rope.freq_base", 10000.0)),
        "rope_scaling": None if scaling != "linear" else
        {"rope_type": "linear", "factor": float(field(reader, a + "rope.scaling.factor"))},
        "max_position_embeddings": field(reader, a + "context_length"),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "sliding_window": window,
        "layer_types": None if window is None else (SLIDING,) * n_layers,
        "torch_dtype": "float32",
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": tuple(e for e in [field(reader, "tokenizer.ggml.eos_token_id", None)] if e is not None),
    }
    if arch.gguf_read is not None:
        def tensor(name):
            t = next((t for t in reader.tensors if t.name == name), None)
            return None if t is None else dequantize(reader.data[t.data_offset:t.data_offset + t.n_bytes].reshape(
                1, -1), t.tensor_type.name, int(np.prod(t.shape)))[0]

        fields.update(arch.gguf_read(lambda key, default=None: field(reader, a + key, default), tensor, fields))
    return ModelConfig(**fields)


def raw_tensors(path):
    """Yield a RawTensor per tensor of a GGUF file: the blocks as stored (memory-mapped),
    Q/K rows in Hugging Face order. For importing Q8_0/Q4_0/Q4_1 weights without dequantizing."""
    reader = open_gguf(path)
    yield from _raw_tensors(reader, gguf_config(reader))


def _raw_tensors(reader, config: ModelConfig):
    arch = config.arch
    for t in reader.tensors:
        if t.name in arch.gguf_config_tensors:  # read into the config
            continue
        name, kind = hf_name(t.name, arch), t.tensor_type.name
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists the innermost size first
        rows = int(np.prod(shape[:-1]))
        blocks = reader.data[t.data_offset:t.data_offset + t.n_bytes].reshape(rows, -1)
        if arch.gguf_norm_shift and name.endswith("norm.weight"):  # stored as shift + w (Gemma's 1 + w)
            w = dequantize(blocks, kind, shape[-1]) - np.float32(arch.gguf_norm_shift)
            kind, blocks = "F32", w.view(np.uint8)
        elif arch.gguf_permuted_qk and ".q_proj." in name:
            blocks = unpermute_rows(blocks, config.num_attention_heads)
        elif arch.gguf_permuted_qk and ".k_proj." in name:
            blocks = unpermute_rows(blocks, config.num_key_value_heads)
        yield RawTensor(name, t.name, kind, blocks, shape)


class GGUFTensors(Mapping):
    """Hugging Face name -> dequantized float32 array, made when looked up."""

    def __init__(self, reader, config: ModelConfig):
        self.raw = {r.name: r for r in _raw_tensors(reader, config)}

    def __getitem__(self, name):
        r = self.raw[name]
        return dequantize(r.blocks, r.type, r.shape[-1]).reshape(r.shape)

    def __iter__(self):
        return iter(self.raw)

    def __len__(self):
        return len(self.raw)


# ------------------------------------------------------------------ tokenizer


def sentencepiece_bpe(tokens, types, scores, add_space_prefix: bool):
    """A tokenizers BPE equal to SentencePiece's BPE over llama.cpp's "llama" vocabulary: a space is
    "\u2581" (one prepended when add_space_prefix), pieces merge best score first (the merges are
    every split of a piece into two pieces, ranked by the piece's score), characters outside the
    vocabulary fall back to their <0xXX> byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = {t: sc for t, ty, sc in zip(tokens, types, scores) if ty in (NORMAL, USER_DEFINED)}
    merges = sorted(((t[:j], t[j:], sc) for t, sc in mergeable.items() for j in range(1, len(t))
                     if t[:j] in mergeable and t[j:] in mergeable),
                    key=lambda m: (-m[2], vocab[m[0]], vocab[m[1]]))
    unk = next((t for t, ty in zip(tokens, types) if ty == UNKNOWN), None)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges], unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    space = [normalizers.Replace(" ", "\u2581")]
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend("\u2581")] if add_space_prefix else []) + space)
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     *strip])
    return tok


def tokenizer_files(reader, out_dir: Path):
    """Write tokenizer.json and tokenizer_config.json rebuilt from the GGUF vocabulary."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    kind, pre = field(reader, "tokenizer.ggml.model"), field(reader, "tokenizer.ggml.pre", "default")
    if kind not in ("gpt2", "llama"):
        raise CuinferError(f"GGUF tokenizer model {kind!r} is not supported: cuinfer rebuilds gpt2-style "
                           "byte-level BPE and llama-style SentencePiece BPE tokenizers")
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    if kind == "llama":
        tok = sentencepiece_bpe(tokens, types, field(reader, "tokenizer.ggml.scores"),
                                bool(field(reader, "tokenizer.ggml.add_space_prefix", True)))
    else:
        if pre not in PRE_TOKENIZERS:
            raise CuinferError(f"GGUF pre-tokenizer {pre!r} is not supported: need one of "
                               f"{', '.join(PRE_TOKENIZERS)}")
        merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges")]
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                   continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in ("llama-bpe", "qwen2"))
        split = {"smollm": pre_tokenizers.Digits(individual_digits=True),
                 "llama-bpe": pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                 "qwen2": pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated")}.get(pre)
        tok.pre_tokenizer = byte_level if split is None else pre_tokenizers.Sequence([split, byte_level])
        tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    special = {k: tokens[i] for k, key in (("bos_token", "bos"), ("eos_token", "eos"),
                                          ("unk_token", "unknown"), ("pad_token", "padding"))
               if (i := field(reader, f"tokenizer.ggml.{key}_token_id", None)) is not None}
    add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", False)) and "bos_token" in special
    if add_bos:
        bos = (special["bos_token"], tokens.index(special["bos_token"]))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos[0]}:0 $A:0", pair=f"{bos[0]}:0 $A:0 {bos[0]}:1 $B:1", special_tokens=[bos])
    tok.save(str(out_dir / "tokenizer.json"))
    tconf = {**special, "add_bos_token": add_bos, "tokenizer_class": "PreTrainedTokenizerFast",
             "model_max_length": field(reader, f"{field(reader, 'general.architecture')}.context_length")}
    template = field(reader, "tokenizer.chat_template", None)
    if template is not None:
        tconf["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tconf, indent=2, ensure_ascii=False))


# ------------------------------------------------------------------ conversion


def convert_gguf(path, out_dir, dtype="float32", overwrite=False) -> Path:
    """Convert a llama GGUF file into a checkpoint directory (see module doc); returns its path."""
    reader = open_gguf(path)
    config = gguf_config(reader)
    tensors = GGUFTensors(reader, config)
    unexpected = [n for n in tensors if n not in expected_tensors(config)]
    if unexpected:
        raise CuinferError(f"{path}: tensor {tensors.raw[unexpected[0]].gguf_name} does not fit "
                           f"the config ({config.num_hidden_layers} layers)")
    with tempfile.TemporaryDirectory() as tok:
        tokenizer_files(reader, Path(tok))
        gen = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_id)}
        (Path(tok) / "generation_config.json").write_text(json.dumps(gen, indent=2))
        return save_checkpoint(out_dir, config, tensors, tok, dtype=dtype, overwrite=overwrite)
