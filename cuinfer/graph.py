"""Decode steps replayed from CUDA graphs: one graph per (batch bucket, context bucket, greedy).

    graphs = DecodeGraph(model, kv_cache)   # reserves one scratch KV block
    out = graphs.run(token_ids, positions, block_tables, greedy=True)
    # greedy: int32 tokens [n] on the device; else float32 logits [n, vocab] on the device

A decode step (one new token per sequence: Model.decode) has a fixed shape once the number of
sequences is rounded up to a batch bucket (1, 2, 4, 8, ...) and the longest context up to a
context bucket (256, 512, 1024, ... tokens): the bucket sets the block-table width and the
`max_context_len` bound that fixes paged_attention's split count and workspace. A bucket's
inputs live in one static int32 device buffer

    [token_ids b | positions b | slot_mapping b | context_lens b | block_tables b x width]

filled each step by one asynchronous copy from pinned host memory; its output (int32 argmax
tokens, or float32 logits) is a static array the graph writes. Rows past the batch (padding up
to the bucket) decode token 0 at position 0 into the reserved scratch block and attend to that
block only: they never write a live block.

Capture, on a bucket's first step: the inputs are copied, the device is synchronized (the side
stream must see them and every earlier step), the step runs once eagerly on a side stream
(kernels compiled and loaded, the pool primed with the step's temporaries) and once under stream
capture. Both allocate from a private memory pool that only these graphs use: the temporaries'
addresses are baked into the graphs, so nothing else may be handed that memory, and graphs
share it safely because their replays are serialized on one stream. Replays, the input copy
before them and the output read after them all run on the current stream, ordered with the
eager prefill steps around them without further synchronization. use_graphs=False runs the same
step eagerly on the same buffers (same kernels, same order: the same tokens), as do buckets past
graph_batch_limit (fp16 weights above 16 rows go through cuBLAS, which cannot be captured).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import runtime
from .model import DecodeInputs
from .ops.linear import GEMV_MAX_M, weight_bits
from .ops.paged_attention import workspace_elems
from .weights import LINEAR_FIELDS

MIN_CONTEXT_BUCKET = 256  # tokens


def bucket(n: int, smallest: int = 1) -> int:
    """The smallest power of two that is >= n and >= smallest."""
    return max(smallest, 1 << max(0, n - 1).bit_length())


def graph_batch_limit(weights, greedy: bool) -> int:
    """The largest batch whose decode step can be captured: every linear call must take the GEMV
    (above GEMV_MAX_M rows it takes cuBLAS, which CuPy refuses to call under capture); the greedy
    lm_head is linear_argmax, a GEMV at any batch. Larger buckets run the same step eagerly."""
    mats = [getattr(lw, f) for lw in weights.layers for f in LINEAR_FIELDS]
    return min(GEMV_MAX_M[weight_bits(w)] for w in mats + ([] if greedy else [weights.lm_head]))


def input_views(buf, b: int, width: int) -> DecodeInputs:
    """DecodeInputs viewing one int32 buffer [b * (4 + width)] (numpy or cupy) in the layout above."""
    return DecodeInputs(token_ids=buf[:b], positions=buf[b:2 * b], slot_mapping=buf[2 * b:3 * b],
                        context_lens=buf[3 * b:4 * b], block_tables=buf[4 * b:].reshape(b, width))


def pack_inputs(buf, token_ids, positions, block_tables, block_size: int, scratch: int, b: int, width: int):
    """Write a step's inputs into the host buffer; rows len(token_ids)..b-1 are padding rows that
    decode token 0 at position 0 into block `scratch`."""
    n = len(token_ids)
    v = input_views(buf, b, width)
    v.token_ids[:n], v.token_ids[n:] = token_ids, 0
    v.positions[:n], v.positions[n:] = positions, 0
    v.block_tables[...] = 0
    for i, table in enumerate(block_tables):
        v.block_tables[i, :len(table)] = table
    v.block_tables[n:, 0] = scratch
    pos = v.positions
    v.slot_mapping[:] = v.block_tables[np.arange(b), pos // block_size] * block_size + pos % block_size
    v.context_lens[:] = pos + 1


def capture(fn, stream, pool):
    """(graph, fn's result, bytes the capture took from the device): fn runs once eagerly on `stream`
    (warm-up), then once under stream capture; both allocate from `pool`, which must serve nothing
    but graphs replayed one at a time. The caller synchronizes whatever fn reads first."""
    cp = runtime.require_cupy()
    with cp.cuda.using_allocator(pool.malloc), stream:
        fn()
        stream.synchronize()
        before = pool.total_bytes()
        stream.begin_capture()
        try:
            out = fn()
        except BaseException:
            stream.end_capture()  # leave capture mode, then report the first error
            raise
        graph = stream.end_capture()
    stream.synchronize()
    return graph, out, pool.total_bytes() - before


@dataclass(eq=False)
class _Step:
    """The static buffers (and, once captured, the graph) of one (batch, width, greedy) bucket."""
    host: np.ndarray  # pinned int32 staging buffer
    device: object  # cupy int32 buffer, same layout
    inputs: DecodeInputs  # views of `device`
    workspace: object  # float32 paged_attention split partials, or None (no split)
    out: object = None  # static output, written by the graph
    graph: object = None
    capture_bytes: int = 0  # device memory the capture itself took from the pool (0 after a warm-up)


class DecodeGraph:
    def __init__(self, model, kv_cache, use_graphs: bool = True):
        self.cp = runtime.require_cupy()
        self.model, self.kv_cache, self.use_graphs = model, kv_cache, use_graphs
        self.scratch = kv_cache.allocator.allocate(1)[0]  # padding rows write here, never freed
        self.pool = self.cp.cuda.MemoryPool()  # the captured steps' temporaries, nothing else's
        self.stream = self.cp.cuda.Stream(non_blocking=True)  # capture cannot run on the legacy stream
        self.steps = {}
        self.graph_limit = {g: graph_batch_limit(model.weights, g) for g in (True, False)}

    def run(self, token_ids, positions, block_tables, greedy: bool):
        """One decode step for n sequences (token at `positions`, whose K/V go to the blocks in
        `block_tables`); returns the device int32 argmax tokens [n] (greedy) or float32 logits [n, vocab]."""
        n = len(token_ids)
        bs = self.kv_cache.block_size
        b, width = bucket(n), bucket(max(positions) + 1, MIN_CONTEXT_BUCKET) // bs
        step = self.steps.get((b, width, greedy)) or self._new_step(b, width, greedy)
        pack_inputs(step.host, token_ids, positions, block_tables, bs, self.scratch, b, width)
        step.device.set(step.host)  # pinned: asynchronous on the current stream
        if not self.use_graphs or b > self.graph_limit[greedy]:
            return self._decode(step, greedy)[:n]
        if step.graph is None:
            self._capture(step, greedy)
        step.graph.launch()
        return step.out[:n]

    def _new_step(self, b: int, width: int, greedy: bool) -> _Step:
        cp, m = self.cp, self.model
        size = b * (4 + width)
        host = np.frombuffer(cp.cuda.alloc_pinned_memory(4 * size), dtype=np.int32, count=size)
        device = cp.zeros(size, dtype=np.int32)
        elems = workspace_elems(b, m.n_heads, m.n_kv_heads, m.head_dim, width * self.kv_cache.block_size)
        step = _Step(host, device, input_views(device, b, width),
                     cp.empty(elems, dtype=np.float32) if elems else None)
        self.steps[(b, width, greedy)] = step
        return step

    def _decode(self, step: _Step, greedy: bool):
        max_context_len = step.inputs.block_tables.shape[1] * self.kv_cache.block_size
        return self.model.decode(step.inputs, self.kv_cache, max_context_len, step.workspace, greedy)

    def _capture(self, step: _Step, greedy: bool):
        self.cp.cuda.Device().synchronize()  # the input copy and every earlier step are done
        step.graph, step.out, step.capture_bytes = capture(lambda: self._decode(step, greedy),
                                                           self.stream, self.pool)
