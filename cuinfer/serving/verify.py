"""Verify steps of speculative decoding, replayed from CUDA graphs per (batch bucket, q_len, context bucket).

    verifier = Verifier(model, kv_cache)
    logits = verifier.run(chunks)   # chunks: [(k_i + 1 tokens, position of the first, block table)]
    # float32 [sum(k_i + 1), vocab] on the model's device: the logits of every row, chunks in order
    pending = verifier.launch(chunks)   # a greedy step: the host works on while it runs
    tokens = pending.wait()              # [sum(k_i + 1)] ints: each row's argmax, chunks in order
    tokens = verifier.run(chunks, greedy=True)   # the same: launch(chunks).wait()

A verify step is the decode step over more rows (Model.decode with verify=q_len): each sequence's
last token and its drafts are rows of their own, each with its position, context length and a copy
of the sequence's block table. The split-K paged decode attention writes each row's K/V, and those of
the rows of its sequence before it, then lets the row attend over its context. So the
step runs the kernels a plain decode step runs, on k + 1 rows per sequence: the weights are read
once, and a greedy step ends in the fused lm_head argmax, whose kernel writes the tokens straight
into pinned host memory (runner.mapped_pinned): an event after the step is all the host waits on,
and no copy follows the step. Its shape
is fixed once every chunk is padded to q_len (the longest chunk, rounded up to 1, 2, 3, 5, 9 or 16
rows: q_bucket), the number of sequences to a
batch bucket (1, 2, 4, ...) and the block tables to a context bucket (256, 512, ... tokens, as
DecodeGraph's); the inputs live in one static int32 device buffer, step_inputs.input_views' layout
over T = b * q_len rows

    [token_ids T | positions T | slot_mapping T | context_lens T | block_tables T x width]

filled each step by one asynchronous copy from pinned host memory. Padding rows (after a short
chunk, and those of padding sequences) have slot -1 and context length 0: they write no KV and
attend to nothing, and their outputs are dropped. Capture follows DecodeGraph's rules
(runner.capture: an eager warm-up, then stream capture, in a private memory pool); every step is
captured. use_graphs=False runs the same step eagerly on the same buffers, and the CPU runs it on
NumPy buffers (so the CPU tests check the layout the graphs use).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model.step_inputs import input_views
from ..ops import runtime
from ..ops.linear import GEMV_ROWS
from .runner import MIN_CONTEXT_BUCKET, bucket, capture, copy_async, mapped_pinned

Q_BUCKETS = (1, 2, 3, 5, 9, GEMV_ROWS)  # rows a verify step gives each sequence (past them: its longest chunk)


def q_bucket(q: int) -> int:
    """The rows of a verify step whose longest chunk has q tokens: the first of Q_BUCKETS that holds
    them (k drafts, the last token and some padding; the last fills the GEMV's rows), else q.
    Rounding keeps the graphs of a k to a few per (batch bucket, context bucket): with q_len the
    longest chunk itself, batch-4 ngram at k = 8 still captured graphs in the bench's timed pass
    (7.3 ms a verify launch on average, 0.28x plain decoding)."""
    return next((b for b in Q_BUCKETS if b >= q), q)


def step_shape(chunks, block_size: int) -> tuple:
    """(batch bucket, q_len, block-table width) of a verify step: q_len the longest chunk's q_bucket,
    the width a context bucket that covers every padded chunk and every block table."""
    q = q_bucket(max(len(t) for t, _, _ in chunks))
    tokens = max(max(s + q, len(table) * block_size) for _, s, table in chunks)
    return bucket(len(chunks)), q, bucket(tokens, MIN_CONTEXT_BUCKET) // block_size


def pack_chunks(buf, chunks, b: int, q: int, width: int, block_size: int) -> None:
    """Write a verify step's chunks into the host buffer, one row per token, padded as described
    above: per chunk, one write of its rows' four columns (token, position, slot, context length,
    made in Python: a chunk has few rows) and one of its block tables."""
    rows = b * q
    buf[:] = 0
    columns = buf[:4 * rows].reshape(4, rows)  # token_ids, positions, slot_mapping, context_lens
    columns[2] = -1
    tables = buf[4 * rows:].reshape(rows, width)
    for i, (tokens, start, table) in enumerate(chunks):
        n, positions = len(tokens), range(start, start + len(tokens))
        slots = [table[p // block_size] * block_size + p % block_size for p in positions]  # as slot_mapping
        columns[:, i * q:i * q + n] = tokens, positions, slots, range(start + 1, start + n + 1)
        tables[i * q:i * q + n, :len(table)] = table


@dataclass(eq=False)
class _Step:
    host: np.ndarray  # int32 staging buffer (GPU: pinned; CPU: the inputs themselves)
    device: object  # the int32 inputs the step reads, same layout (CPU: host itself)
    inputs: object  # DecodeInputs: views of `device`
    workspace: object  # float32 paged_attention split partials, or None (no split)
    tokens: object  # int32 [T]: a greedy step's argmax (GPU: mapped pinned memory, see mapped_pinned)
    host_tokens: np.ndarray  # the same memory on the host
    q: int  # rows per sequence (q_len)
    out: object = None  # static output (logits [T, vocab] or `tokens`), written by the graph
    graph: object = None
    copied: object = None  # event after the last copy out of `host`
    done: object = None  # GPU: event after the step's last launch


@dataclass(eq=False)
class PendingRows:
    """A launched greedy verify step: wait() blocks until it has run, then gives each row's argmax,
    chunks in order, as ints. Wait before the next step of the same shape is launched: that step
    writes the same memory."""
    step: _Step
    rows: list  # the chunks' rows among the step's T

    def wait(self) -> list:
        if self.step.done is not None:
            self.step.done.synchronize()
        tokens = self.step.host_tokens.tolist()
        return [tokens[r] for r in self.rows]


class Verifier:
    def __init__(self, model, kv_cache, use_graphs: bool = True):
        self.model, self.kv_cache = model, kv_cache
        self.use_graphs = use_graphs and model.xp is not np
        if model.xp is not np:
            self.cp = runtime.require_cupy()
            self.pool = self.cp.cuda.MemoryPool()  # the captured steps' temporaries, nothing else's
            self.stream = self.cp.cuda.Stream(non_blocking=True)
        self.steps = {}

    def run(self, chunks, greedy: bool = False):
        """Logits of every row of the chunks (on the model's device); with greedy, each row's argmax
        as a list of ints (launch(chunks).wait())."""
        if greedy:
            return self.launch(chunks).wait()
        _, rows, out = self._run(chunks, False)
        return out[self.model.xp.asarray(rows)]

    def launch(self, chunks) -> PendingRows:
        """Start a greedy step (ending in each row's argmax); the host may work until it waits for
        the tokens. The argmax kernel writes them straight into pinned host memory, so no copy
        follows the step. On the CPU the step has run when this returns."""
        step, rows, _ = self._run(chunks, True)
        if self.model.xp is not np:
            if step.done is None:
                step.done = self.cp.cuda.Event(disable_timing=True)
            step.done.record(self.cp.cuda.get_current_stream())
        return PendingRows(step, rows)

    def _run(self, chunks, greedy: bool) -> tuple:
        """(step, the chunks' rows, its output) of one step over the chunks, launched (the same padded
        step on the CPU, run by Model.decode's NumPy path)."""
        b, q, width = step_shape(chunks, self.kv_cache.block_size)
        step = self.steps.get((b, q, width, greedy)) or self._new_step(b, q, width, greedy)
        self._load(step, chunks, b, q, width)
        if not self.use_graphs:
            out = self._forward(step, greedy)
        else:
            if step.graph is None:
                self.cp.cuda.Device().synchronize()  # the input copy and every earlier step are done
                step.graph, step.out, _ = capture(lambda: self._forward(step, greedy), self.stream, self.pool)
            step.graph.launch()
            out = step.out
        return step, [i * q + j for i, (t, _, _) in enumerate(chunks) for j in range(len(t))], out

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

    def _new_step(self, b: int, q: int, width: int, greedy: bool) -> _Step:
        xp, rows = self.model.xp, b * q
        size = rows * (4 + width)
        if xp is np:
            host = device = np.zeros(size, dtype=np.int32)
            host_tokens = tokens = np.zeros(rows, np.int32)
        else:
            host = np.frombuffer(self.cp.cuda.alloc_pinned_memory(4 * size), dtype=np.int32, count=size)
            device = self.cp.zeros(size, dtype=np.int32)
            host_tokens, tokens = mapped_pinned(self.cp, rows)
        elems = self.model.decode_workspace_elems(rows, width * self.kv_cache.block_size) if xp is not np else 0
        step = _Step(host, device, input_views(device, rows, width), xp.zeros(elems, np.float32) if elems else None,
                     tokens, host_tokens, q)
        self.steps[(b, q, width, greedy)] = step
        return step

    def _forward(self, step: _Step, greedy: bool):
        max_context_len = step.inputs.block_tables.shape[1] * self.kv_cache.block_size
        return self.model.decode(step.inputs, self.kv_cache, max_context_len, step.workspace, greedy,
                                 tokens_out=step.tokens if greedy else None, verify=step.q)
