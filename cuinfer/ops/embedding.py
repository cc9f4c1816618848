"""Embedding lookup.

embedding(ids, table, out=None, scale=1.0)
    ids: int32/int64 [n]; table: [vocab, hidden] -> out: [n, hidden], rows times scale (in float32,
    rounded once to the dtype; Gemma's sqrt(hidden))
numpy arrays run the reference, which raises ValueError on an id outside [0, vocab); cupy arrays
launch cuda_src/embedding.cu (one CTA per id), which cannot raise: it never reads the table for
such an id and writes a row of zeros instead.
"""
from __future__ import annotations

import numpy as np

from . import runtime

ID_CTYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}


def instantiation(dtype, vec, id_dtype) -> str:
    return f"embedding_kernel<{runtime.ctype(dtype)}, {vec}, {ID_CTYPES[np.dtype(id_dtype)]}>"


INSTANTIATIONS = [instantiation(dt, v, i) for dt in runtime.FLOAT_DTYPES for v in runtime.vector_widths(dt)
                  for i in ID_CTYPES]


def embedding_reference(ids, table):
    """table[ids]: [n, hidden]; ValueError naming the first id outside [0, vocab)."""
    ids = np.asarray(ids)
    bad = (ids < 0) | (ids >= table.shape[0])
    if bad.any():
        raise ValueError(f"ids: got id {ids[bad][0]} at index {np.flatnonzero(bad)[0]}, "
                         f"need 0 <= id < vocab ({table.shape[0]})")
    return table[ids]


def embedding(ids, table, out=None, scale=1.0):
    dev = runtime.on_device(ids, table, out)
    runtime.check("ids", ids, dtype=tuple(ID_CTYPES), ndim=1)
    runtime.check("table", table, dtype=runtime.FLOAT_DTYPES, ndim=2)
    n, (vocab, hidden) = ids.shape[0], table.shape
    out = runtime.check_out(out, (n, hidden), table.dtype, table)
    if not dev:
        rows = embedding_reference(ids, table)
        out[...] = rows if scale == 1.0 else (rows.astype(np.float32) * np.float32(scale)).astype(table.dtype)
        return out
    vec = runtime.vector_width(table, out)
    threads = min(256, max(32, (hidden // vec + 31) // 32 * 32))
    kern = runtime.kernel("embedding", instantiation(table.dtype, vec, ids.dtype))
    runtime.launch(kern, (n,), (threads,), (ids, table, out, np.int64(vocab), np.int32(hidden), np.float32(scale)))
    return out
