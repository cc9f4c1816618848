"""Eager steps (prefill chunks, mixed steps) with everything between two attentions replayed from
CUDA graphs, one set per token bucket: piecewise graphs, as vLLM captures them.

    steps = PiecewiseForward(model, kv_cache, max_tokens)
    logits = steps.forward(batch)                    # = Model.forward(batch, kv_cache): float32
    logits = steps.forward(batch, all_logits=True)   # [num_seqs, vocab], or [tokens, vocab]

Why: Model.forward launches about ten kernels and cuBLAS calls a layer, each behind 25-80 us of
Python (argument checks, CuPy's launch, ctypes): 14-34 ms of host time a llama3-8b step on the H100
machines, more than the GPU's work where the chunks are short. What a step computes between two
attentions depends on its token count alone; only the attention depends on the batch (sequences,
their lengths, contexts and blocks). So a step of T tokens runs at its bucket's Tb >= T rows
(token_bucket) as L + 1 pieces, each a graph captured on the bucket's second step (CAPTURE_AT; the
first runs the same pieces eagerly) or by capture_all:

    piece 0:    s = embedding(tokens);               qkv = layer 0's normed q, k, v projection
    piece i:    s = layer i-1 after its attention;   qkv = layer i's projection
    piece L:    s = layer L-1 after its attention, its deferred add done

over static buffers (the token ids, the residual stream s, qkv and the attention output a: views of
arrays sized for the largest bucket, which every bucket shares). Between pieces i and i+1 the
attention of layer i runs eagerly on the T real rows (Model.prefill_attention: write_kv,
flash_attention_paged over the chunks, paged_attention over the decodes) into a; then the lm_head
on the rows asked for. The Tb - T padding rows carry stale token ids and a stale attention output:
finite values that no real row reads (the GEMMs, norms and activations are row-wise).
The graphs' temporaries come from `pool` (DecodeGraph's in the engine: all these graphs replay one
at a time on the current stream). Steps of more tokens than the largest bucket run Model.forward.
use_graphs=False runs the same pieces eagerly on the same buffers: the same kernels, the same logits.
"""
from __future__ import annotations

import numpy as np

from ..ops import runtime
from ..ops.embedding import embedding
from .runner import capture

# a bucket is captured on its second step (the first runs the pieces eagerly): a capture costs about
# five eager steps (llama3-8b, H100: 1,320 graphs in 2.6 s, ~65 ms a bucket, against a 7-18 ms step),
# which a one-off shape (a `generate` call's single prefill) would never earn back
CAPTURE_AT = 2


def token_bucket(n: int) -> int:
    """The rows a step of n tokens runs: 16 up to 16 tokens, then steps of 16 to 128, of 32 to 256
    and of 64 past that. A step's GEMMs grow with its rows, so padding adds at most 63 rows
    (coarser steps of an eighth of the power of two cost a 1,152-token llama3-8b step 5 % on the
    H100: cuBLAS at 1,280 rows)."""
    step = 16 if n <= 128 else 32 if n <= 256 else 64
    return max(16, -(-n // step) * step)


def token_buckets(max_tokens: int) -> list:
    """Every bucket up to the one of max_tokens, in order."""
    out = [16]
    while out[-1] < token_bucket(max_tokens):
        out.append(token_bucket(out[-1] + 1))
    return out


class PiecewiseForward:
    def __init__(self, model, kv_cache, max_tokens: int, pool=None, stream=None, use_graphs: bool = True):
        self.cp = runtime.require_cupy()
        self.model, self.kv_cache, self.use_graphs = model, kv_cache, use_graphs
        self.max_rows = token_bucket(max_tokens)
        cp, m, rows = self.cp, model, self.max_rows
        self.tokens = cp.zeros(rows, np.int32)
        self.s = cp.zeros((rows, m.config.hidden_size), m.dtype)
        self.a = cp.zeros((rows, m.n_heads * m.head_dim), m.dtype)
        self.qkv = cp.zeros((rows, (m.n_heads + 2 * m.n_kv_heads) * m.head_dim), m.dtype)
        self.pool = pool if pool is not None else cp.cuda.MemoryPool()
        self.stream = stream if stream is not None else cp.cuda.Stream(non_blocking=True)
        self.graphs = {}  # bucket -> its L + 1 pieces
        self.steps_seen = {}  # bucket -> steps run at it before its capture

    def forward(self, batch, all_logits: bool = False):
        """Model.forward(batch, kv_cache, all_logits) with the pieces above (batch on the device)."""
        t = len(batch.token_ids)
        if t > self.max_rows:
            return self.model.forward(batch, self.kv_cache, all_logits)
        rows = token_bucket(t)
        self.tokens[:t] = batch.token_ids
        pieces = self.graphs.get(rows)
        if pieces is None and self.use_graphs:
            self.steps_seen[rows] = self.steps_seen.get(rows, 0) + 1
            if self.steps_seen[rows] >= CAPTURE_AT:
                pieces = self.graphs[rows] = self._capture(rows)
        attend, m = self.model.prefill_attention(batch), self.model
        for i in range(len(m.weights.layers) + 1):
            if pieces is None:
                self._piece(i, rows)
            else:
                pieces[i].launch()
            if i < len(m.weights.layers):
                q, k, v = m.split_qkv(self.qkv[:t])
                attend(i, q, k, v, *self.kv_cache.layer(i), out=self.a[:t].reshape(q.shape))
        s = self.s[:t]
        return m.logits(s if all_logits else s[batch.cu_seqlens_q[1:] - 1])

    def graph_bytes(self) -> int:
        """Device memory the pool holds (shared with the decode graphs when the engine passed theirs)."""
        return self.pool.total_bytes()

    def capture_all(self) -> int:
        """Capture every bucket (Engine.warm_up; nothing without use_graphs); returns the number of
        graphs captured."""
        missing = [r for r in token_buckets(self.max_rows) if r not in self.graphs] if self.use_graphs else []
        for rows in reversed(missing):  # largest first: the pool then serves the rest
            self.graphs[rows] = self._capture(rows)
        return len(missing) * (len(self.model.weights.layers) + 1)

    def _piece(self, i: int, rows: int):
        """Piece i at `rows` rows, on the static buffers (see the module docstring)."""
        m, s = self.model, self.s[:rows]
        if i == 0:
            x = embedding(self.tokens[:rows], m.weights.embed, out=s, scale=m.embed_scale)
        else:
            x = m.post_attention(i - 1, self.a[:rows], s)
        if i < len(m.weights.layers):
            _, x = m.pre_attention(i, x, qkv_out=self.qkv[:rows])
        else:
            x = m.resolve(x)
        if x.data.ptr != s.data.ptr:  # the stream went to a new array (a fused residual add): back to s
            s[...] = x

    def _capture(self, rows: int) -> list:
        self.cp.cuda.Device().synchronize()  # the static buffers' last writers are done
        return [capture(lambda i=i: self._piece(i, rows), self.stream, self.pool)[0]
                for i in range(len(self.model.weights.layers) + 1)]
