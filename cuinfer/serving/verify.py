"""Verify steps of speculative decoding, replayed from CUDA graphs per (batch bucket, q_len, context bucket).

    verifier = Verifier(model, kv_cache)
    logits = verifier.run(chunks)   # chunks: [(k_i + 1 tokens, position of the first, block table)]
    # float32 [sum(k_i + 1), vocab] on the model's device: the logits of every row, chunks in order

A verify step is Model.forward over each sequence's last token and its drafts (paged prefill
attention over the cached prefix, all_logits). Its shape is fixed once every chunk is padded to
q_len = the longest chunk, the number of sequences to a batch bucket (1, 2, 4, ...) and the block
tables to a context bucket (256, 512, ... tokens, as DecodeGraph's); the inputs live in one static
int32 device buffer

    [token_ids T | positions T | slot_mapping T | cu_seqlens_q b+1 | context_lens b | block_tables b x width]

(T = b * q_len), filled each step by one asynchronous copy from pinned host memory. Padding tokens
(after a short chunk, and the rows of padding sequences) have slot -1: write_kv skips them, so they
write no KV block; they attend to whatever their table rows point at, and their logits are dropped.
Capture follows DecodeGraph's rules (runner.capture: an eager warm-up, then stream capture, in a
private memory pool); every step is captured (past the GEMV's rows the linear layers take
ops.cublas, which capture allows). use_graphs=False runs the same step eagerly on the same buffers,
and the CPU runs it on NumPy buffers (so the CPU tests check the layout the graphs use).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model.decoder import Batch, slot_mapping
from ..ops import runtime
from .runner import MIN_CONTEXT_BUCKET, bucket, capture, copy_async


def batch_views(buf, b: int, q: int, width: int) -> Batch:
    """A Batch viewing one int32 buffer [b * (3 * q + 2 + width) + 1] in the layout above."""
    t = b * q
    return Batch(token_ids=buf[:t], positions=buf[t:2 * t], slot_mapping=buf[2 * t:3 * t],
                 cu_seqlens_q=buf[3 * t:3 * t + b + 1], context_lens=buf[3 * t + b + 1:3 * t + 2 * b + 1],
                 block_tables=buf[3 * t + 2 * b + 1:].reshape(b, width), max_seqlen_q=q)


def step_shape(chunks, block_size: int) -> tuple:
    """(batch bucket, q_len, block-table width) of a verify step: q_len the longest chunk, the
    width a context bucket that covers every padded chunk and every block table."""
    q = max(len(t) for t, _, _ in chunks)
    tokens = max(max(s + q, len(table) * block_size) for _, s, table in chunks)
    return bucket(len(chunks)), q, bucket(tokens, MIN_CONTEXT_BUCKET) // block_size


def pack_chunks(buf, chunks, b: int, q: int, width: int, block_size: int) -> None:
    """Write a verify step's chunks into the host buffer, padded as described above."""
    v = batch_views(buf, b, q, width)
    v.token_ids[:], v.slot_mapping[:], v.block_tables[...] = 0, -1, 0
    positions = np.tile(np.arange(q), b)  # padding sequences: positions 0..q-1
    for i, (tokens, start, table) in enumerate(chunks):
        n = len(tokens)
        v.token_ids[i * q:i * q + n] = tokens
        positions[i * q:(i + 1) * q] += start
        v.block_tables[i, :len(table)] = table
        rows = np.full(n, i)
        v.slot_mapping[i * q:i * q + n] = slot_mapping(v.block_tables, rows, positions[i * q:i * q + n], block_size)
    v.positions[:] = positions
    v.cu_seqlens_q[:] = np.arange(b + 1) * q
    v.context_lens[:] = positions.reshape(b, q)[:, -1] + 1


@dataclass(eq=False)
class _Step:
    host: np.ndarray  # int32 staging buffer (GPU: pinned; CPU: the inputs themselves)
    device: object  # the int32 inputs the step reads, same layout (CPU: host itself)
    batch: Batch  # views of `device`
    out: object = None  # static logits [T, vocab], written by the graph
    graph: object = None
    copied: object = None  # event after the last copy out of `host`


class Verifier:
    def __init__(self, model, kv_cache, use_graphs: bool = True):
        self.model, self.kv_cache = model, kv_cache
        self.use_graphs = use_graphs and model.xp is not np
        if model.xp is not np:
            self.cp = runtime.require_cupy()
            self.pool = self.cp.cuda.MemoryPool()  # the captured steps' temporaries, nothing else's
            self.stream = self.cp.cuda.Stream(non_blocking=True)
        self.steps = {}

    def run(self, chunks):
        """Logits of every row of the chunks (module docstring); the same padded step on the CPU,
        run by Model.forward's NumPy path."""
        b, q, width = step_shape(chunks, self.kv_cache.block_size)
        step = self.steps.get((b, q, width)) or self._new_step(b, q, width)
        self._load(step, chunks, b, q, width)
        if not self.use_graphs:
            out = self._forward(step)
        else:
            if step.graph is None:
                self.cp.cuda.Device().synchronize()  # the input copy and every earlier step are done
                step.graph, step.out, _ = capture(lambda: self._forward(step), self.stream, self.pool)
            step.graph.launch()
            out = step.out
        rows = np.concatenate([i * q + np.arange(len(t)) for i, (t, _, _) in enumerate(chunks)])
        return out[self.model.xp.asarray(rows)]

    def _load(self, step: _Step, chunks, b: int, q: int, width: int) -> None:
        """Pack the chunks into the step's host buffer and (GPU) copy it to the device asynchronously."""
        if step.copied is not None:
            step.copied.synchronize()  # the last copy out of step.host has run: it may be rewritten
        pack_chunks(step.host, chunks, b, q, width, self.kv_cache.block_size)
        if self.model.xp is np:
            return
        cp = self.cp
        stream = cp.cuda.get_current_stream()
        copy_async(cp, step.device, step.host, step.host.size, cp.cuda.runtime.memcpyHostToDevice, stream)
        if step.copied is None:
            step.copied = cp.cuda.Event(disable_timing=True)
        step.copied.record(stream)

    def _new_step(self, b: int, q: int, width: int) -> _Step:
        size = b * (3 * q + 2 + width) + 1
        if self.model.xp is np:
            host = device = np.zeros(size, dtype=np.int32)
        else:
            cp = self.cp
            host = np.frombuffer(cp.cuda.alloc_pinned_memory(4 * size), dtype=np.int32, count=size)
            device = cp.zeros(size, dtype=np.int32)
        step = _Step(host, device, batch_views(device, b, q, width))
        self.steps[(b, q, width)] = step
        return step

    def _forward(self, step: _Step):
        return self.model.forward(step.batch, self.kv_cache, all_logits=True)
