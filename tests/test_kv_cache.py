"""Block allocator, cache sizing and the paged-vs-contiguous memory report."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuinfer.model.kv_cache import (
    BlockAllocator,
    CacheShape,
    KVCache,
    OutOfBlocksError,
    blocks_for,
    bytes_per_token,
    kv_memory,
)


def test_allocate_free_reuse():
    a = BlockAllocator(4)
    x = a.allocate(3)
    assert sorted(x) == [0, 1, 2] and a.num_free == 1
    with pytest.raises(OutOfBlocksError, match="need 2 KV blocks, 1 of 4 free"):
        a.allocate(2)
    assert a.num_free == 1  # a failed allocation takes nothing
    a.free(x[:2])
    assert a.num_free == 3
    with pytest.raises(ValueError, match="freed twice"):
        a.free([x[0]])


def test_shared_block_lives_until_last_owner_frees():
    a = BlockAllocator(2)
    (b,) = a.allocate(1)
    a.share(b)
    a.free([b])
    assert a.num_free == 1
    a.free([b])
    assert a.num_free == 2
    with pytest.raises(ValueError, match="not allocated"):
        a.share(b)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5)), max_size=60))
def test_allocator_never_hands_out_a_block_twice(ops):
    a = BlockAllocator(16)
    owned = []
    for alloc, n in ops:
        if alloc and n <= a.num_free:
            owned += a.allocate(n)
        elif owned:
            a.free(owned[-n:])
            del owned[-n:]
        assert len(set(owned)) == len(owned)
        assert a.num_free + len(owned) == 16


def test_cache_shape_and_budget():
    shape = CacheShape(num_layers=3, n_kv_heads=2, head_dim=64, block_size=16)
    c = KVCache.allocate(shape, np.float32, kv_tokens=100)
    assert c.k.shape == (3, 6, 16, 2, 64) and c.v.shape == c.k.shape  # 100 tokens -> 6 whole blocks
    assert c.token_bytes == 2 * 3 * 2 * 64 * 4 and c.nbytes == 6 * 16 * c.token_bytes
    k0, v0 = c.layer(0)
    assert k0.shape == (6, 16, 2, 64) and k0.flags.c_contiguous
    with pytest.raises(OutOfBlocksError, match="less than one block"):
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
