"""NumPy references for the attention ops (flash_attention, flash_attention_paged, paged_attention).

One routine, `causal_attention`, serves every form: a chunk of `m` queries that are
the last `m` positions of a sequence of `n` keys (query j sees keys 0 .. n - m + j),
or every key when not causal. A sliding window w > 0 keeps the last w of those keys
(the query's own and the w - 1 before it); a softcap c > 0 maps each scaled score x to
c * tanh(x / c) before the softmax (Gemma 2). The paged forms gather a sequence's keys from the
block table and call it. Vectorised over heads (GQA without repeating K/V); queries
are processed in chunks so the score matrix stays small for long sequences.
"""
from __future__ import annotations

import itertools

import numpy as np

from . import fp8

_SCORES_PER_CHUNK = 1 << 24  # float32 scores held at once (64 MiB)


def default_scale(head_dim: int) -> float:
    return 1.0 / float(np.sqrt(head_dim))


def causal_attention(q, k, v, scale, causal=True, dtype=np.float32, window=0, softcap=0.0):
    """softmax(cap(q k^T * scale) + mask) v for one sequence, computed in `dtype`.

    q: [m, n_heads, head_dim]; k, v: [n, n_kv_heads, head_dim]; when causal, query j sees keys
    0 .. n - m + j (none if that is negative), and with window > 0 only the last `window` of them.
    Returns [m, n_heads, head_dim] in `dtype`; rows that see no key are zero.
    """
    m, n_heads, d = q.shape
    n, n_kv = k.shape[0], k.shape[1]
    g = n_heads // n_kv
    out = np.zeros((m, n_heads, d), dtype=dtype)
    if m == 0 or n == 0:
        return out
    kt = k.astype(dtype).transpose(1, 2, 0)  # kt: [n_kv, head_dim, n]
    vt = v.astype(dtype).transpose(1, 0, 2)  # vt: [n_kv, n, head_dim]
    step = max(1, _SCORES_PER_CHUNK // (n_heads * n))
    for a in range(0, m, step):
        b = min(m, a + step)
        # qg: [n_kv, g * (b - a), head_dim], rows ordered (group head, query)
        qg = q[a:b].astype(dtype).reshape(b - a, n_kv, g, d).transpose(1, 2, 0, 3)
        # keys lo.. only: those before the window of the chunk's first query are not read
        lo = max(0, n - m + a - window + 1) if causal and window else 0
        keys = np.arange(lo, n)
        s = (qg.reshape(n_kv, g * (b - a), d) @ kt[..., lo:]) * dtype(scale)  # s: [n_kv, g*(b-a), n - lo]
        s = s.reshape(n_kv, g, b - a, n - lo)
        if softcap:
            s = np.tanh(s / dtype(softcap)) * dtype(softcap)
        if causal:
            last = n - m + np.arange(a, b)  # last visible key of each query
            seen = keys[None, :] <= last[:, None]
            if window:
                seen &= keys[None, :] > last[:, None] - window
            s = np.where(seen, s, -np.inf)
        mx = s.max(axis=-1, keepdims=True)
        p = np.exp(s - np.where(np.isfinite(mx), mx, 0))
        l = p.sum(axis=-1, keepdims=True)
        o = (p.reshape(n_kv, g * (b - a), n - lo) @ vt[:, lo:]).reshape(n_kv, g, b - a, d)
        o = o / np.where(l > 0, l, 1)
        out[a:b] = o.transpose(2, 0, 1, 3).reshape(b - a, n_heads, d)
    return out


def varlen_attention(q, k, v, cu_seqlens, causal=True, scale=None, window=0, softcap=0.0):
    """Packed variable-length attention; q: [tokens, n_heads, head_dim], k, v: [tokens, n_kv_heads, head_dim]."""
    scale = default_scale(q.shape[-1]) if scale is None else scale
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    out = np.zeros(q.shape, dtype=np.float32)
    for s, e in itertools.pairwise(cu):
        out[s:e] = causal_attention(q[s:e], k[s:e], v[s:e], scale, causal, window=window, softcap=softcap)
    return out


def gather_kv(cache, block_table, n):
    """The first n rows of one sequence from a paged cache (an fp8 cache's rows decoded to float32).

    cache: [num_blocks, block_size, n_kv_heads, head_dim]; block_table: [max_blocks]
    Returns [n, n_kv_heads, head_dim].
    """
    bs = cache.shape[1]
    blocks = np.asarray(block_table[: -(-n // bs)], dtype=np.int64)
    return fp8.values(cache[blocks].reshape(-1, *cache.shape[2:])[:n])


def paged_prefix_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale=None, window=0,
                           softcap=0.0):
    """Chunked-prefill attention: the q rows of sequence i are its last q_len_i of context_lens[i] positions.

    q: [tokens, n_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, n_kv_heads, head_dim]
    block_tables: [num_seqs, max_blocks_per_seq]; cu_seqlens_q: [num_seqs + 1]; context_lens: [num_seqs]
    A query that sees no key (context_lens[i] < q_len_i, e.g. an empty decode slot) gives zeros.
    """
    scale = default_scale(q.shape[-1]) if scale is None else scale
    cu = np.asarray(cu_seqlens_q, dtype=np.int64)
    ctx = np.asarray(context_lens, dtype=np.int64)
    out = np.zeros(q.shape, dtype=np.float32)
    for i, (s, e) in enumerate(itertools.pairwise(cu)):
        n = int(ctx[i])
        k = gather_kv(k_cache, block_tables[i], n)
        v = gather_kv(v_cache, block_tables[i], n)
        out[s:e] = causal_attention(q[s:e], k, v, scale, causal=True, window=window, softcap=softcap)
    return out
