"""Paged KV cache: one K pool and one V pool of fixed-size blocks.

    k, v: [num_layers, num_blocks, block_size, n_kv_heads, head_dim]

Token t of a sequence lives in slot table[t // block_size] * block_size + t % block_size
of every layer, where table is the sequence's block table. Who holds which block, and the
prefix cache, are serving's BlockManager: the arrays here know nothing of it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..errors import CuinferError
from ..ops import fp8

DEFAULT_BLOCK_SIZE = 16


def bytes_per_token(num_layers: int, n_kv_heads: int, head_dim: int, dtype) -> int:
    """K and V bytes one token takes across all layers."""
    return 2 * num_layers * n_kv_heads * head_dim * np.dtype(dtype).itemsize


def kv_cache_dtype_for(name: str, model_dtype) -> np.dtype:
    """The cache's element dtype for a kv_cache_dtype name (`--kv-cache-dtype`): "auto" -> the
    model's dtype, "fp8" / "fp8_e4m3" -> uint8 E4M3 codes (cuinfer.ops.fp8); a bad name is a
    CuinferError."""
    try:
        return fp8.parse_kv_cache_dtype(name, model_dtype)
    except ValueError as e:
        raise CuinferError(str(e)) from None


def kv_memory(token_counts, block_size: int, token_bytes: int, max_len: int) -> dict:
    """KV bytes a set of sequences holds in the paged cache vs a contiguous cache of max_len each."""
    paged = sum(-(-n // block_size) for n in token_counts) * block_size * token_bytes
    contiguous = len(token_counts) * max_len * token_bytes
    return {"paged_bytes": paged, "contiguous_bytes": contiguous,
            "saving": 1.0 - paged / contiguous if contiguous else 0.0}


def free_bytes(xp) -> int:
    """Memory a new array could take: the host's available RAM (numpy), or the GPU's free memory
    plus what CuPy's pool holds unused (cupy)."""
    if xp is np:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    free, _ = xp.cuda.runtime.memGetInfo()
    return free + xp.get_default_memory_pool().free_bytes()


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    n_kv_heads: int
    head_dim: int
    block_size: int = DEFAULT_BLOCK_SIZE

    def pool(self, num_blocks: int) -> tuple:
        return (self.num_layers, num_blocks, self.block_size, self.n_kv_heads, self.head_dim)


class KVCache:
    """The K and V pools of every layer plus their allocator."""

    def __init__(self, shape: CacheShape, num_blocks: int, dtype, xp=np):
        self.shape = shape
        self.dtype = np.dtype(dtype)
        self.k = xp.zeros(shape.pool(num_blocks), dtype=self.dtype)
        self.v = xp.zeros(shape.pool(num_blocks), dtype=self.dtype)
        self.num_blocks = num_blocks

    @classmethod
    def allocate(cls, shape: CacheShape, dtype, xp=np, kv_tokens=None, memory_fraction=0.8):
        """A cache for `kv_tokens` tokens, or (kv_tokens None, GPU) `memory_fraction` of free memory."""
        token_bytes = bytes_per_token(shape.num_layers, shape.n_kv_heads, shape.head_dim, dtype)
        if kv_tokens is None:
            if xp is np:
                raise ValueError("kv_tokens: needed for a CPU cache (no free-memory query on the host)")
            kv_tokens = int(free_bytes(xp) * memory_fraction) // token_bytes
        elif kv_tokens * token_bytes > free_bytes(xp):
            raise CuinferError(f"a KV cache of {kv_tokens} tokens needs {kv_tokens * token_bytes / 2 ** 30:.1f} GiB, "
                               f"{free_bytes(xp) / 2 ** 30:.1f} GiB of {'host' if xp is np else 'GPU'} memory is free")
        num_blocks = kv_tokens // shape.block_size
        if num_blocks < 1:
            raise CuinferError(f"a KV budget of {kv_tokens} tokens is less than one block "
                                   f"of {shape.block_size}")
        return cls(shape, num_blocks, dtype, xp)

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    @property
    def token_bytes(self) -> int:
        return bytes_per_token(self.shape.num_layers, self.shape.n_kv_heads, self.shape.head_dim, self.dtype)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_size * self.token_bytes

    def layer(self, i: int) -> tuple:
        """(k, v) of layer i: [num_blocks, block_size, n_kv_heads, head_dim] views of the pools."""
        return self.k[i], self.v[i]
