"""Checkpoint directories in the Hugging Face layout: load and save.

A directory holds config.json, model.safetensors (or shards listed in
model.safetensors.index.json), and the tokenizer files (tokenizer.json,
tokenizer_config.json, generation_config.json). Tensor names are the Hugging Face names of the
config's architecture (cuinfer.model.arch); `expected_tensors(config)` derives every name and
shape from the config, and loading checks the files against it: a missing, unexpected,
mis-shaped or mis-typed tensor or a truncated file is one CuinferError naming the tensor and the file.

A quantized checkpoint (config.quantization, written by cuinfer.quantize) stores each quantized
weight as the arrays of its Int8Weight / Int4Weight (quant_io.saved_parts); load_checkpoint returns
the weight objects under the `.weight` names, and save_checkpoint takes them the same way.

safetensors files are read here directly (8-byte header length, JSON header, raw data)
through np.memmap, so a tensor already in the run dtype is a read-only view of the page
cache, and a truncated file is reported by tensor name. Writing streams one tensor at a
time, so a mapping that builds tensors on access (convert.RandomTensors) never holds the
whole model in memory.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..errors import CuinferError, bfloat16
from ..ops import quant
from . import quant_io
from .config import DTYPES, ModelConfig, dtype_name, load_config, numpy_dtype

# safetensors dtype tag <-> numpy dtype (the float types a checkpoint may hold, and the quantized arrays')
ST_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": bfloat16,
             "I8": np.dtype(np.int8), "U32": np.dtype(np.uint32)}
ST_TAGS = {v: k for k, v in ST_DTYPES.items()}

# Buffers some exporters store although they derive from the config: skipped on load.
DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)

# files copied by save_checkpoint(tokenizer_files_from=...)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json")
SHARD_BYTES = 5 * 2**30
PROGRESS_BYTES = 2**28  # show a progress bar when a checkpoint holds more than this (the default model: 540 MB)


def weight_shapes(config: ModelConfig) -> dict:
    """Every weight the model takes, Hugging Face name -> shape, in file order. lm_head.weight is
    there when the embeddings are not tied, or when the checkpoint is quantized (its int8 lm_head
    is a tensor of its own)."""
    out = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size)}
    layer = config.arch.layer_shapes(config)  # the architecture's names (cuinfer.model.arch)
    for i in range(config.num_hidden_layers):
        out.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    out["model.norm.weight"] = (config.hidden_size,)
    if not config.tie_word_embeddings or config.quantization:
        out["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return out


def expected_tensors(config: ModelConfig) -> dict:
    """Every tensor name of a checkpoint for `config`, in file order -> its shape."""
    return {n: s for parts in _layout(config, config.dtype).values() for n, (s, _) in parts.items()}


def _layout(config: ModelConfig, dtype) -> dict:
    """weight name -> {stored name: (shape, dtype)}: a float weight under its own name in `dtype`, a
    quantized one as its arrays in theirs (quant_io.saved_parts)."""
    q = config.quantization
    return {name: quant_io.saved_parts(q, name, shape) if q and quant_io.is_quantized(name, q) else
            {name: (shape, np.dtype(dtype))} for name, shape in weight_shapes(config).items()}


# ------------------------------------------------------------------ safetensors files


def read_safetensors_header(file: Path) -> tuple[dict, int]:
    """(header without __metadata__, byte offset where the data starts)."""
    try:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CuinferError(f"{file}: truncated or not a safetensors file ({len(raw)} bytes)")
            (n,) = struct.unpack("<Q", raw)
            text = f.read(n)
            if len(text) < n:
                raise CuinferError(f"{file}: truncated safetensors header")
            header = json.loads(text)
    except OSError as e:
        raise CuinferError(f"{file}: cannot read: {e.strerror}") from None
    except ValueError:
        raise CuinferError(f"{file}: not a safetensors file (bad header)") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def read_safetensors(file: Path, names=None) -> dict:
    """name -> read-only memory-mapped array for `names` (default: every tensor in the file)."""
    header, start = read_safetensors_header(file)
    size = file.stat().st_size
    out = {}
    for name in header if names is None else names:
        info = header[name]
        if info["dtype"] not in ST_DTYPES:
            raise CuinferError(f"{file}: tensor {name} has dtype {info['dtype']}: "
                               f"need one of {', '.join(ST_DTYPES)}")
        dtype, shape = ST_DTYPES[info["dtype"]], tuple(info["shape"])
        begin, end = info["data_offsets"]
        if end - begin != int(np.prod(shape)) * dtype.itemsize:
            raise CuinferError(f"{file}: tensor {name}: {end - begin} bytes for shape {shape} {dtype}")
        if start + end > size:
            raise CuinferError(f"{file}: truncated: tensor {name} ends at byte {start + end}, "
                               f"the file has {size}")
        if end == begin:
            out[name] = np.zeros(shape, dtype)
        else:
            out[name] = np.memmap(file, dtype, "r", offset=start + begin, shape=shape)
    return out


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape)) * dtype.itemsize


def write_safetensors(file: Path, layout: dict, tensors: Mapping, progress=None):
    """Write tensors[name] for each name of layout (weight name -> {stored name: (shape, dtype)}),
    one weight at a time: a float array converted to its dtype, a quantized weight's arrays as they are."""
    header, offset = {}, 0
    for parts in layout.values():
        for n, (shape, dtype) in parts.items():
            end = offset + _nbytes(shape, dtype)
            header[n] = {"dtype": ST_TAGS[dtype], "shape": list(shape), "data_offsets": [offset, end]}
            offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, parts in layout.items():
            w = tensors[name]
            quantized = isinstance(w, quant.QUANTIZED)
            arrays = quant_io.weight_arrays(name, w) if quantized else {name: w}
            if set(arrays) != set(parts):
                raise CuinferError(f"tensor {name}: got {type(w).__name__}, this config stores it as "
                                   f"{', '.join(parts)}")
            for n, (shape, dtype) in parts.items():
                a = np.asarray(arrays[n])
                if quantized and a.dtype != dtype:
                    raise CuinferError(f"tensor {n}: got dtype {a.dtype}, need {dtype}")
                a = np.ascontiguousarray(a, dtype=dtype)
                if a.shape != tuple(shape):
                    raise CuinferError(f"tensor {n}: got shape {a.shape}, need {tuple(shape)}")
                f.write(a.tobytes() if a.nbytes else b"")
                if progress is not None:
                    progress.update(a.nbytes)


def progress_bar(total: int, desc: str):
    """A tqdm bar over `total` bytes, shown only past PROGRESS_BYTES."""
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=total < PROGRESS_BYTES)


# ------------------------------------------------------------------ load


def checkpoint_files(path: Path) -> dict:
    """tensor name -> safetensors file holding it."""
    index, single = path / "model.safetensors.index.json", path / "model.safetensors"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError):
            raise CuinferError(f"{index}: not a safetensors index (no weight_map)") from None
        return {name: path / file for name, file in weight_map.items()}
    if single.exists():
        header, _ = read_safetensors_header(single)
        return {name: single for name in header}
    raise CuinferError(f"{path}: no model.safetensors or model.safetensors.index.json")


def load_checkpoint(path, dtype=None) -> tuple[ModelConfig, dict]:
    """(config, name -> array) from a checkpoint directory, the names of weight_shapes(config).

    dtype: the run dtype of the float tensors ("float32", "float16", "bfloat16" or a numpy dtype);
    default the checkpoint's torch_dtype. Tensors stored in that dtype come back as read-only
    memmaps. A quantized weight comes back as its Int8Weight / Int4Weight over memmaps of its arrays.
    """
    path = Path(path)
    if not path.is_dir():
        raise CuinferError(f"{path}: no such checkpoint directory")
    config = load_config(path)
    config = config.replace(quantization=quant_io.check_entry(config.quantization, config.arch.modules(config)))
    dtype = numpy_dtype(dtype or config.torch_dtype)
    layout = _layout(config, dtype)
    expected = {n: shape_dtype for parts in layout.values() for n, shape_dtype in parts.items()}
    files = checkpoint_files(path)
    for name in list(files):
        if name.endswith(DERIVED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
            del files[name]
    missing = [n for n in expected if n not in files]
    if missing:
        raise CuinferError(f"{path}: missing tensor {missing[0]}"
                           + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = sorted(set(files) - set(expected))
    if unexpected:
        raise CuinferError(f"{files[unexpected[0]]}: unexpected tensor {unexpected[0]} "
                           f"for {config.architecture}")
    by_file = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    tensors = {}
    for file, names in by_file.items():
        if not file.exists():
            raise CuinferError(f"{file}: no such file (listed in the index for {names[0]})")
        header, _ = read_safetensors_header(file)
        absent = [n for n in names if n not in header]
        if absent:
            raise CuinferError(f"{file}: tensor {absent[0]} is listed in the index but not in the file")
    floats = set(DTYPES.values())
    with progress_bar(sum(_nbytes(*sd) for sd in expected.values()), f"loading {path.name}") as bar:
        for file, names in by_file.items():
            for name, a in read_safetensors(file, names).items():
                shape, want = expected[name]
                if a.shape != shape:
                    raise CuinferError(f"{file}: tensor {name} has shape {a.shape}, "
                                       f"{config.architecture} config needs {shape}")
                if a.dtype != want and not {a.dtype, want} <= floats:
                    need = " or ".join(ST_TAGS[d] for d in DTYPES.values()) if want in floats else ST_TAGS[want]
                    raise CuinferError(f"{file}: tensor {name} has dtype {ST_TAGS[a.dtype]}, "
                                       f"{config.architecture} config needs {need}")
                tensors[name] = a if a.dtype == want else np.array(a, dtype=want)
                bar.update(tensors[name].nbytes)
    shapes = weight_shapes(config)
    return config, {name: tensors[name] if name in parts else  # a float weight, else a quantized one's arrays
                    quant_io.weight_from_arrays(config.quantization, name, shapes[name], tensors)
                    for name, parts in layout.items()}


# ------------------------------------------------------------------ save


def save_checkpoint(path, config: ModelConfig, tensors: Mapping, tokenizer_files_from=None,
                    dtype=None, shard_bytes=SHARD_BYTES, overwrite=False) -> Path:
    """Write a checkpoint directory; returns its path.

    tensors: name -> array (a Mapping, read once per name, one at a time), exactly the names of
    weight_shapes(config); with config.quantization the quantized ones are Int8Weight /
    Int4Weight in its format (as load_checkpoint returns them), stored as their arrays.
    dtype: stored dtype of the float tensors (default config.torch_dtype; config.json records it).
    Writes into a temporary sibling directory and renames it into place, so a failure
    leaves nothing that looks like a checkpoint.
    """
    path = Path(path)
    dtype = numpy_dtype(dtype or config.torch_dtype)
    config = config.replace(torch_dtype=dtype_name(dtype))
    layout = _layout(config, dtype)
    given = set(tensors)  # the names only: a Mapping may build a tensor when it is looked up
    missing = [n for n in layout if n not in given]
    unexpected = [n for n in tensors if n not in layout]
    if missing or unexpected:
        what = f"missing tensor {missing[0]}" if missing else f"unexpected tensor {unexpected[0]}"
        raise CuinferError(f"save_checkpoint: {what} for this {config.architecture} config")
    if path.exists() and (not path.is_dir() or (any(path.iterdir()) and not overwrite)):
        raise CuinferError(f"{path}: already exists (choose a new directory or pass overwrite)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
        os.chmod(tmp, 0o755)
    except OSError as e:
        raise CuinferError(f"{path}: cannot write here: {e.strerror}") from None
    try:
        _write_dir(tmp, config, tensors, layout, shard_bytes, tokenizer_files_from)
        if path.exists():  # overwrite: move the old one aside first, so a path always exists
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.replace(path, old / path.name)
            os.rename(tmp, path)
            shutil.rmtree(old)
        else:
            os.rename(tmp, path)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CuinferError(f"{path}: cannot write checkpoint: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _write_dir(tmp: Path, config, tensors, layout, shard_bytes, tokenizer_files_from):
    # split weights into shards of at most shard_bytes (a larger weight gets its own shard)
    shards, size = [[]], 0
    sizes = {name: sum(_nbytes(*sd) for sd in parts.values()) for name, parts in layout.items()}
    for name, n in sizes.items():
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    total = sum(sizes.values())
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    with progress_bar(total, f"writing {tmp.name}") as bar:
        for file, names in zip(files, shards):
            write_safetensors(tmp / file, {n: layout[n] for n in names}, tensors, bar)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {part: f for f, names in zip(files, shards) for n in names for part in layout[n]}}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    if tokenizer_files_from is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_files_from) / name
            if src.exists():
                shutil.copyfile(src, tmp / name)
    if not (tmp / "generation_config.json").exists():
        gen = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_id)}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))


def resolve_checkpoint(path=None) -> Path:
    """The checkpoint directory to load: `path` itself; with None the default model (fetched and
    converted once into the cache: io.default_model); a GGUF file is converted once into
    <cache>/models/<its name>-<hash of its path, size and time> (float32, as the default model) and
    that directory is reused while the file is unchanged."""
    if path is None:
        from .default_model import default_model_dir

        return default_model_dir()
    path = Path(path)
    if not (path.is_file() and path.suffix.lower() == ".gguf"):
        return path
    import hashlib
    import sys

    from .default_model import cache_root
    from .gguf import convert_gguf

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_root() / "models" / f"{path.stem}-{key}"
    if not (out / "config.json").exists():
        print(f"converting {path} into {out} (once)", file=sys.stderr)
        convert_gguf(path, out, "float32", overwrite=True)
    return out
