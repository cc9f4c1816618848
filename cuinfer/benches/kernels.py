"""Element-wise kernels (norms, RoPE, gated activations, softmax, embedding): GB/s against copy and torch eager.

Bytes count each input read once and each output written once. Every tensor is well above the
50 MB L2 (the smallest, rope's q + k at 16384 tokens, is 168 MB), so rows measure HBM. The peer is
torch eager on same-shaped tensors in the same run: F.rms_norm (after x + residual for the fused
form: two kernels), F.silu(g) * u, F.gelu(g, approximate="tanh") * u, torch.softmax,
F.layer_norm, F.embedding, and Hugging Face's rotate-half RoPE with cos/sin precomputed (HF
computes them once per forward, so the peer is not charged for them). CuPy and torch both run on
the legacy default stream, so the same CUDA events time both. Each timing is REPS back-to-back
calls divided by REPS, for ours and the peer alike: the launcher's Python (argument checks, about
30-50 us) then overlaps the previous kernel instead of adding to a 0.1-0.2 ms kernel; the decoder
replays these kernels from CUDA graphs, where that cost is gone.
"""
from __future__ import annotations

import numpy as np

from .. import bench
from ..ops import runtime
from ..ops.activation import gelu_and_mul, silu_and_mul
from ..ops.embedding import embedding
from ..ops.layer_norm import layer_norm
from ..ops.rms_norm import rms_norm
from ..ops.rope import rope
from ..ops.softmax import softmax

EPS = 1e-5
REPS = 10
TORCH_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32"}


def add_arguments(parser):
    parser.add_argument("--quick", action="store_true", help="one shape per op")


def _rand(cp, shape, dtype):
    return cp.random.standard_normal(shape, dtype=cp.float32).astype(dtype)


def _ms(fn):
    """Milliseconds per fn() over REPS back-to-back calls (median of bench.time_ms)."""
    return bench.time_ms(lambda: [fn() for _ in range(REPS)]) / REPS


def _peer(torch, name, fn):
    if torch is None:
        return {}
    torch.cuda.synchronize()
    return dict(peer=name, peer_ms=_ms(fn))


def rms_norm_rows(cp, torch, dt, rows, hidden):
    x, res, w = _rand(cp, (rows, hidden), dt), _rand(cp, (rows, hidden), dt), _rand(cp, (hidden,), dt)
    out = cp.empty_like(x)
    n = x.nbytes
    plain = dict(name="rms_norm", shape=f"{rows}x{hidden}", dtype=str(x.dtype),
                 ms=_ms(lambda: rms_norm(x, w, EPS, out=out)), bytes=2 * n + w.nbytes)
    fused = dict(name="rms_norm + residual", shape=f"{rows}x{hidden}", dtype=str(x.dtype),
                 ms=_ms(lambda: rms_norm(x, w, EPS, residual=res, out=(out, res))),
                 bytes=4 * n + w.nbytes)
    if torch is not None:
        F, tdt = torch.nn.functional, getattr(torch, TORCH_DTYPES[str(x.dtype)])
        tx, tr = (torch.randn(rows, hidden, device="cuda", dtype=tdt) for _ in range(2))
        tw = torch.randn(hidden, device="cuda", dtype=tdt)
        plain.update(_peer(torch, "F.rms_norm", lambda: F.rms_norm(tx, (hidden,), tw, EPS)))
        fused.update(_peer(torch, "add + F.rms_norm", lambda: F.rms_norm(tr.add_(tx), (hidden,), tw, EPS)))
    return [plain, fused]


def layer_norm_rows(cp, torch, dt, rows, hidden):
    x, w, b = _rand(cp, (rows, hidden), dt), _rand(cp, (hidden,), dt), _rand(cp, (hidden,), dt)
    out = cp.empty_like(x)
    row = dict(name="layer_norm", shape=f"{rows}x{hidden}", dtype=str(x.dtype),
               ms=_ms(lambda: layer_norm(x, w, b, EPS, out=out)), bytes=2 * x.nbytes + 2 * w.nbytes)
    if torch is not None:
        tdt = getattr(torch, TORCH_DTYPES[str(x.dtype)])
        tx, tw, tb = (torch.randn(*s, device="cuda", dtype=tdt) for s in ((rows, hidden), (hidden,), (hidden,)))
        row.update(_peer(torch, "F.layer_norm", lambda: torch.nn.functional.layer_norm(tx, (hidden,), tw, tb, EPS)))
    return [row]


def act_rows(cp, torch, dt, rows, d, gelu):
    x = _rand(cp, (rows, 2 * d), dt)
    out = cp.empty((rows, d), dtype=dt)
    op = gelu_and_mul if gelu else silu_and_mul
    row = dict(name=op.__name__, shape=f"{rows}x(2*{d})", dtype=str(x.dtype),
               ms=_ms(lambda: op(x, out=out)), bytes=x.nbytes + out.nbytes)
    if torch is not None:
        F = torch.nn.functional
        tx = torch.randn(rows, 2 * d, device="cuda", dtype=getattr(torch, TORCH_DTYPES[str(x.dtype)]))
        g, u = tx[:, :d], tx[:, d:]
        fn = (lambda: F.gelu(g, approximate="tanh") * u) if gelu else (lambda: F.silu(g) * u)
        row.update(_peer(torch, "F.gelu(g)*u" if gelu else "F.silu(g)*u", fn))
    return [row]


def softmax_rows(cp, torch, dt, rows, n):
    x = _rand(cp, (rows, n), dt)
    out = cp.empty_like(x)
    row = dict(name="softmax", shape=f"{rows}x{n}", dtype=str(x.dtype),
               ms=_ms(lambda: softmax(x, out=out)), bytes=2 * x.nbytes)
    if torch is not None:
        tx = torch.randn(rows, n, device="cuda", dtype=getattr(torch, TORCH_DTYPES[str(x.dtype)]))
        row.update(_peer(torch, "torch.softmax", lambda: torch.softmax(tx, -1)))
    return [row]


def rope_rows(cp, torch, dt, tokens, n_heads, n_kv, d):
    q, k = _rand(cp, (tokens, n_heads, d), dt), _rand(cp, (tokens, n_kv, d), dt)
    pos = cp.arange(tokens, dtype=cp.int32)
    q_out, k_out = cp.empty_like(q), cp.empty_like(k)
    row = dict(name="rope", shape=f"{tokens}x({n_heads}+{n_kv})x{d}", dtype=str(q.dtype),
               ms=_ms(lambda: rope(q, k, pos, 500000.0, out=(q_out, k_out))),
               bytes=2 * (q.nbytes + k.nbytes))
    if torch is not None:
        tdt = getattr(torch, TORCH_DTYPES[str(q.dtype)])
        tq = torch.randn(1, n_heads, tokens, d, device="cuda", dtype=tdt)  # HF layout [b, heads, s, d]
        tk = torch.randn(1, n_kv, tokens, d, device="cuda", dtype=tdt)
        inv = 1.0 / 500000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d)
        emb = torch.cat([torch.outer(torch.arange(tokens, device="cuda").float(), inv)] * 2, dim=-1)
        cos, sin = emb.cos().to(tdt)[None, None], emb.sin().to(tdt)[None, None]

        def rotate_half(x):
            return torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)

        row.update(_peer(torch, "HF rotate-half", lambda: (tq * cos + rotate_half(tq) * sin,
                                                           tk * cos + rotate_half(tk) * sin)))
    return [row]


def embedding_rows(cp, torch, dt, n, vocab, hidden):
    table = _rand(cp, (vocab, hidden), dt)
    ids = cp.random.randint(0, vocab, n, dtype=cp.int32)
    out = cp.empty((n, hidden), dtype=dt)
    row = dict(name="embedding", shape=f"{n} of {vocab}x{hidden}", dtype=str(table.dtype),
               ms=_ms(lambda: embedding(ids, table, out=out)), bytes=2 * out.nbytes + ids.nbytes)
    if torch is not None:
        tt = torch.randn(vocab, hidden, device="cuda", dtype=getattr(torch, TORCH_DTYPES[str(table.dtype)]))
        tids = torch.randint(0, vocab, (n,), device="cuda")
        row.update(_peer(torch, "F.embedding", lambda: torch.nn.functional.embedding(tids, tt)))
    return [row]


def run(args):
    cp = runtime.require_cupy()
    torch = bench.torch_or_none()
    f16, bf16, f32 = np.float16, runtime.bfloat16, np.float32
    cases = [(rms_norm_rows, f16, 16384, 8192), (act_rows, f16, 16384, 14336, False),
             (softmax_rows, f32, 4096, 128256), (softmax_rows, f16, 4096, 128256),
             (rope_rows, f16, 16384, 32, 8, 128), (layer_norm_rows, f16, 16384, 8192),
             (embedding_rows, f16, 16384, 128256, 4096)]
    if not args.quick:
        cases += [(rms_norm_rows, bf16, 16384, 4096), (rms_norm_rows, f32, 16384, 8192),
                  (act_rows, bf16, 16384, 14336, True), (softmax_rows, f16, 32768, 4096),
                  (rope_rows, bf16, 16384, 32, 8, 64), (layer_norm_rows, bf16, 16384, 4096)]
    rows = []
    for fn, *shape in cases:
        rows += fn(cp, torch, *shape)
        cp.get_default_memory_pool().free_all_blocks()
        if torch is not None:
            torch.cuda.empty_cache()
    return rows
