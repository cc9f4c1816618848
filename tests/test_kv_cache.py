"""KV cache sizing and the paged-vs-contiguous memory report (blocks: test_block_manager.py)."""
import numpy as np
import pytest

from cuinfer.errors import CuinferError
from cuinfer.model.kv_cache import CacheShape, KVCache, bytes_per_token, kv_memory
from cuinfer.serving.block_manager import blocks_for


def test_cache_shape_and_budget():
    shape = CacheShape(num_layers=3, n_kv_heads=2, head_dim=64, block_size=16)
    c = KVCache.allocate(shape, np.float32, kv_tokens=100)
    assert c.k.shape == (3, 6, 16, 2, 64) and c.v.shape == c.k.shape  # 100 tokens -> 6 whole blocks
    assert c.token_bytes == 2 * 3 * 2 * 64 * 4 and c.nbytes == 6 * 16 * c.token_bytes
    k0, v0 = c.layer(0)
    assert k0.shape == (6, 16, 2, 64) and k0.flags.c_contiguous
    with pytest.raises(CuinferError, match="less than one block"):
        KVCache.allocate(shape, np.float32, kv_tokens=15)
    with pytest.raises(ValueError, match="kv_tokens"):
        KVCache.allocate(shape, np.float32)


def test_kv_memory_report():
    tb = bytes_per_token(30, 3, 64, np.float16)
    assert tb == 2 * 30 * 3 * 64 * 2
    r = kv_memory([1, 16, 17], block_size=16, token_bytes=tb, max_len=2048)
    assert r["paged_bytes"] == (1 + 1 + 2) * 16 * tb
    assert r["contiguous_bytes"] == 3 * 2048 * tb
    assert r["saving"] == pytest.approx(1 - 64 / 6144)
    assert [blocks_for(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
