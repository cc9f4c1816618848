"""Engine.warm_up: every kind of step run once before the first request, as a server does at start."""
from __future__ import annotations

import itertools
import time

import numpy as np

from ..errors import CuinferError
from ..model.step_inputs import Batch
from ..ops.paged_attention import precompile as precompile_attention
from .block_manager import blocks_for
from .request import Stats
from .runner import batch_bucket
from .sampling import SamplingParams


def warm_up_rows(budget: int) -> list:
    """The token counts Engine.warm_up runs a forward of: 1-16 one by one (the GEMV's row counts, and
    the small tiles of the GEMMs that take over from 2 or 9 rows), the GEMMs' buckets to 128, then
    steps of 1.5x to the budget (cuBLAS picks its kernel by shape)."""
    rows, n = list(range(1, 17)) + [24, 32, 48, 64, 96, 128], 192
    while n < budget:
        rows.append(n)
        n = n * 3 // 2 if n & (n - 1) == 0 else n * 4 // 3
    return [r for r in rows if r < budget] + [budget]


def warm_up(engine) -> dict:
    """Run every kind of step once before the first request, as a server does at start: a
    request must not wait on a kernel's compilation (seconds each on a fresh machine; CuPy keeps
    them on disk after), on a cuBLAS kernel's first load (lazy loading synchronizes the device)
    or on a graph capture. The piecewise graphs of every token bucket, eager forwards of every
    row count in warm_up_rows (the kernels they pick past the buckets), a mixed step (a chunk
    and decodes), the greedy decode graph of every batch bucket up to max_num_seqs at the
    smallest context bucket (a longer context captures its graph on first use, ~50 ms,
    compiling nothing), then a few requests through step(): a prompt over the step budget, a
    sampled one and one with logprobs. The prefix cache forgets their blocks. Nothing on the
    CPU. Returns {"seconds", "graphs", "graph_mib"}."""
    if engine.scheduler.has_work() or engine._requests:
        raise CuinferError("warm_up: call it before the first request")
    t0 = time.perf_counter()
    if engine.decoder is None:
        return {"seconds": 0.0, "graphs": 0, "graph_mib": 0.0}
    xp, bs = engine.model.xp, engine.kv_cache.block_size
    budget = min(engine.scheduler.max_batch_tokens, engine.max_len - 1, engine.blocks.num_free * bs - 1)
    m = engine.model
    if xp is not np:
        precompile_attention(m.dtype, m.head_dim, m.n_heads, m.n_kv_heads, cache_dtype=engine.kv_cache.dtype)
    pieces = engine.piecewise.capture_all() if engine.piecewise is not None else 0
    blocks = engine.blocks.allocate(blocks_for(budget + 1, bs))
    try:
        for rows in warm_up_rows(budget):  # one chunk: FlashAttention, the lm_head on one row
            engine._forward(Batch.from_chunks([([0] * rows, 0, blocks)], bs).to(xp))
        for seqs in warm_up_rows(min(budget // 2, engine.scheduler.max_num_seqs))[1:]:
            # a chunk and seqs - 1 decodes: the lm_head on seqs rows, the decodes' paged attention
            chunks = [([0] * (budget // 2), 0, blocks)] + [([0], budget // 2, blocks)] * (seqs - 1)
            engine._forward(Batch.from_chunks(chunks, bs).to(xp))
        b = 1
        while b <= batch_bucket(engine.scheduler.max_num_seqs):
            engine.decoder.run([0] * b, [0] * b, [blocks[:1]] * b, True).get()
            b = batch_bucket(b + 1)
    finally:
        engine.blocks.free(blocks)
    vocab = engine.model.config.vocab_size
    rng = np.random.default_rng(0)
    longest = min(engine.scheduler.max_batch_tokens + 17, engine.max_len - 5, engine.blocks.num_blocks * bs // 2)
    lengths = [max(1, min(n, longest)) for n in (5, 9, longest)]  # a step with decodes before a chunk
    params = [SamplingParams(max_new_tokens=4, temperature=0.8, top_k=40, top_p=0.9, seed=0, ignore_eos=True),
              SamplingParams(max_new_tokens=4, logprobs=2, ignore_eos=True),
              SamplingParams(max_new_tokens=4, ignore_eos=True)]
    engine.generate([rng.integers(0, vocab, n).tolist() for n in lengths], params)
    engine.stats, engine.outputs, engine._ids = Stats(), [], itertools.count()
    engine.blocks.forget_cached()
    return {"seconds": time.perf_counter() - t0, "graphs": len(engine.decoder.steps) + pieces,
            "graph_mib": engine.decoder.graph_bytes() / 2 ** 20}
