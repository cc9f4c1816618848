"""Decode steps replayed from CUDA graphs: one graph per (batch bucket, context bucket, kind).

    graphs = DecodeGraph(model, kv_cache, scratch)   # scratch: a KV block no sequence holds
    out = graphs.run(token_ids, positions, block_tables, greedy=True)
    # greedy: int32 tokens [n] on the device; else float32 logits [n, vocab] on the device
    out = graphs.run(token_ids, positions, block_tables, greedy=False, sampling=columns)
    # columns: sampling.sampling_columns(params, uniforms), host [n] each: int32 sampled tokens [n]
    nxt = graphs.run(token_ids, positions2, block_tables, greedy=True, device_tokens=out)
    pending = graphs.read_async(out)        # device -> pinned host copy + event, no wait
    tokens = pending.wait()                 # waits on that event only: list of ints

A decode step (one new token per sequence: Model.decode) has a fixed shape once the number of
sequences is rounded up to a batch bucket (BATCH_BUCKETS: fine enough that padding wastes at most
a fifth of a step past 16 rows, then multiples of 64) and the longest context up to a
context bucket (256, 512, 1024, ... tokens): the bucket sets the block-table width and the
`max_context_len` bound that fixes paged_attention's split count and workspace. A bucket's
inputs live in one static int32 device buffer

    [token_ids b | positions b | slot_mapping b | context_lens b | block_tables b x width]

filled each step by one asynchronous copy from pinned host memory; its output (int32 argmax
tokens, int32 sampled tokens, or float32 logits) is a static array the graph writes. The three kinds
of step: "greedy" ends in the argmax fused into the lm_head; "sample" computes the logits and ends
in ops.sampling (temperature, top-k, top-p, min-p and the inverse CDF at each row's uniform, one
kernel; greedy rows have temperature 0), its per-row parameters in five more int32-sized columns
after the block tables, `[temperature b | top_k b | top_p b | min_p b | uniforms b]` (float32 but
top_k), copied with the rest; "logits" returns the logits (rows with penalties or logprobs: the
engine samples them eagerly). Rows past the batch (padding up
to the bucket) decode token 0 at position 0 into the scratch block (the engine keeps it out of
the block manager) and attend to that
block only: they never write a live block.

Capture, on a bucket's first step: the inputs are copied, the device is synchronized (the side
stream must see them and every earlier step), the step runs once eagerly on a side stream
(kernels compiled and loaded, the pool primed with the step's temporaries) and once under stream
capture. Both allocate from a private memory pool that only these graphs use: the temporaries'
addresses are baked into the graphs, so nothing else may be handed that memory, and graphs
share it safely because their replays are serialized on one stream. Replays, the input copy
before them and the output read after them all run on the current stream, ordered with the
eager prefill steps around them without further synchronization.

Pipelined decode (the engine's async_decode): `device_tokens`, a device int32 array of n tokens
(the previous step's output), replaces token_ids' values on the device, so the step reads tokens the
host has not seen yet. A greedy step writes its argmax into its own bucket's token slots (the
embedding read them first), so when the previous step ran in the same bucket the tokens are already
in place: the host-to-device copy skips the token slots. Otherwise (the bucket changed) they are
copied device to device into the token slots after the host-to-device copy, on the same stream.
read_async copies a step's tokens into pinned host memory with a kernel and records an event after
it; the caller waits on that event only. Between two replays on an H100 a DMA copy to the host
takes ~10 us, the kernel's writes over PCIe ~3 us, a device-to-device copy ~3 us (`python -m
cuinfer.bench gaps`).
A bucket's pinned input buffer is rewritten only after an event recorded behind its last
host-to-device copy has completed: with a step in flight, that copy may not have run yet when the
next step is packed. use_graphs=False runs the same step eagerly on the same buffers (same kernels,
same order: the same tokens). Every bucket is captured: the linear layers past the GEMV's rows go
through ops.cublas, whose handle has its own workspace (CuPy's cuBLAS wrapper refuses capture).
graph_bytes() reports the device memory the graphs' pool holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model.step_inputs import input_views, pack_inputs
from ..ops import runtime
from ..ops.sampling import sampling as sample_tokens

MIN_CONTEXT_BUCKET = 256  # tokens
SAMPLING_COLUMNS = 5  # temperature, top_k, top_p, min_p, uniforms
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)  # then multiples of 64


def bucket(n: int, smallest: int = 1) -> int:
    """The smallest power of two that is >= n and >= smallest."""
    return max(smallest, 1 << max(0, n - 1).bit_length())


def batch_bucket(n: int) -> int:
    """The rows a decode step of n sequences runs: the smallest BATCH_BUCKETS entry >= n, past the
    last a multiple of 64."""
    return next((b for b in BATCH_BUCKETS if b >= n), -(-n // 64) * 64)


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
    """The static buffers (and, once captured, the graph) of one (batch, width, kind) bucket."""
    host: np.ndarray  # pinned int32 staging buffer
    device: object  # cupy int32 buffer, same layout
    inputs: object  # DecodeInputs: views of `device`
    workspace: object  # float32 paged_attention split partials, or None (no split)
    sampling: tuple = ()  # "sample" steps: ops.sampling's parameter columns, views of `device`
    out: object = None  # static output, written by the graph
    graph: object = None
    copied: object = None  # event after the last copy out of `host` (None before the first)
    capture_bytes: int = 0  # device memory the capture itself took from the pool (0 after a warm-up)


class DecodeGraph:
    def __init__(self, model, kv_cache, scratch: int, use_graphs: bool = True):
        self.cp = runtime.require_cupy()
        self.model, self.kv_cache, self.use_graphs = model, kv_cache, use_graphs
        self.scratch = scratch  # padding rows write here
        self.pool = self.cp.cuda.MemoryPool()  # the captured steps' temporaries, nothing else's
        self.stream = self.cp.cuda.Stream(non_blocking=True)  # capture cannot run on the legacy stream
        self.steps = {}
        self.readback = TokenReadback(self.cp)

    def run(self, token_ids, positions, block_tables, greedy: bool, device_tokens=None, sampling=None):
        """One decode step for n sequences (token at `positions`, whose K/V go to the blocks in
        `block_tables`); returns the device int32 argmax tokens [n] (greedy), the int32 tokens
        ops.sampling draws with the per-row parameters `sampling` (not greedy: the host columns of
        sampling.sampling_columns), both views of the bucket's token slots, valid until its next
        step, or else float32 logits [n, vocab].
        device_tokens: a device int32 array [n], rows in the same order, whose values replace
        token_ids' on the device (token_ids' values are then ignored)."""
        n = len(token_ids)
        bs = self.kv_cache.block_size
        b, width = batch_bucket(n), bucket(max(positions) + 1, MIN_CONTEXT_BUCKET) // bs
        kind = "greedy" if greedy else "logits" if sampling is None else "sample"
        step = self.steps.get((b, width, kind)) or self._new_step(b, width, kind)
        if step.copied is not None:
            step.copied.synchronize()  # the last copy out of step.host has run: it may be rewritten
        inputs_size = b * (4 + width)
        pack_inputs(step.host[:inputs_size], token_ids, positions, block_tables, bs, self.scratch, b, width)
        if kind == "sample":
            pack_sampling(step.host[inputs_size:], sampling, n)
        if device_tokens is not None and len(device_tokens) != n:
            raise ValueError(f"device_tokens: {len(device_tokens)} tokens for {n} rows")
        in_place = device_tokens is not None and device_tokens.data.ptr == step.inputs.token_ids.data.ptr
        first = b if in_place else 0  # in place: the token slots already hold the previous step's argmax
        stream, rt = self.cp.cuda.get_current_stream(), self.cp.cuda.runtime
        copy_async(self.cp, step.device[first:], step.host[first:], step.host.size - first, rt.memcpyHostToDevice,
                   stream)
        if step.copied is None:
            step.copied = self.cp.cuda.Event(disable_timing=True)
        step.copied.record(stream)
        if device_tokens is not None and not in_place:  # after the inputs' copy, before the step
            copy_async(self.cp, step.inputs.token_ids, device_tokens, n, rt.memcpyDeviceToDevice, stream)
        if not self.use_graphs:
            return self._decode(step, kind)[:n]
        if step.graph is None:
            self._capture(step, kind)
        step.graph.launch()
        return step.out[:n]

    def graph_bytes(self) -> int:
        """Device memory held by the captured steps' pool (their temporaries), in bytes."""
        return self.pool.total_bytes()

    def read_async(self, tokens) -> PendingTokens:
        """Start copying a step's int32 tokens (run's greedy output) to the host; see TokenReadback."""
        return self.readback.start(tokens)

    def _new_step(self, b: int, width: int, kind: str) -> _Step:
        cp, m = self.cp, self.model
        inputs_size = b * (4 + width)
        size = inputs_size + (SAMPLING_COLUMNS * b if kind == "sample" else 0)
        host = np.frombuffer(cp.cuda.alloc_pinned_memory(4 * size), dtype=np.int32, count=size)
        host[:] = 0
        device = cp.zeros(size, dtype=np.int32)
        elems = m.decode_workspace_elems(b, width * self.kv_cache.block_size)
        step = _Step(host, device, input_views(device[:inputs_size], b, width),
                     cp.zeros(elems, dtype=np.float32) if elems else None,
                     sampling_views(device[inputs_size:], b) if kind == "sample" else ())
        self.steps[(b, width, kind)] = step
        return step

    def _decode(self, step: _Step, kind: str):
        max_context_len = step.inputs.block_tables.shape[1] * self.kv_cache.block_size
        greedy = kind == "greedy"
        out = self.model.decode(step.inputs, self.kv_cache, max_context_len, step.workspace, greedy,
                                tokens_out=step.inputs.token_ids if greedy else None)
        if kind == "sample":  # into the token slots, as the argmax: the embedding has read them
            return sample_tokens(out, *step.sampling, out=step.inputs.token_ids)
        return out

    def _capture(self, step: _Step, kind: str):
        tokens = step.inputs.token_ids.copy()  # the warm-up run overwrites them with its tokens
        self.cp.cuda.Device().synchronize()  # the input copy and every earlier step are done
        step.graph, step.out, step.capture_bytes = capture(lambda: self._decode(step, kind),
                                                           self.stream, self.pool)
        step.inputs.token_ids[...] = tokens


def sampling_views(buf, b: int) -> tuple:
    """ops.sampling's (temperature, top_k, top_p, min_p, uniforms) [b] each, viewing an int32
    buffer [SAMPLING_COLUMNS * b] (numpy or cupy): top_k int32, the others float32."""
    cols = [buf[j * b:(j + 1) * b] for j in range(SAMPLING_COLUMNS)]
    return tuple(c if j == 1 else c.view(np.float32) for j, c in enumerate(cols))


def pack_sampling(buf, columns, n: int) -> None:
    """Write n rows of sampling columns (sampling.sampling_columns) into the host buffer of
    sampling_views; padding rows get temperature 0 (the argmax) and top_p 1."""
    b = len(buf) // SAMPLING_COLUMNS
    for j, (view, col) in enumerate(zip(sampling_views(buf, b), columns)):
        if len(col) != n:
            raise ValueError(f"sampling: column {j} has {len(col)} rows, need {n}")
        view[:n] = col
        view[n:] = 1 if j == 2 else 0


def copy_async(cp, dst, src, n: int, kind: int, stream):
    """cudaMemcpyAsync of n int32 elements src -> dst on `stream` (kind: cp.cuda.runtime.memcpy*);
    device arrays must be C-contiguous int32 with at least n elements, host ones numpy (pinned for
    the copy to be asynchronous)."""
    ptrs = []
    for a in (dst, src):
        if a.dtype != np.int32 or a.ndim != 1 or a.shape[0] < n or not a.flags.c_contiguous:
            raise ValueError(f"copy_async: need C-contiguous int32 [>= {n}], got {a.dtype} {a.shape}")
        ptrs.append(a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr)
    cp.cuda.runtime.memcpyAsync(ptrs[0], ptrs[1], 4 * n, kind, stream.ptr)


def mapped_pinned(cp, size: int) -> tuple:
    """(numpy view, cupy view) of one pinned int32 buffer [size]: unified addressing maps pinned
    memory into the device's address space, so a kernel writing the cupy view writes host memory."""
    mem = cp.cuda.alloc_pinned_memory(4 * size)
    host = np.frombuffer(mem, dtype=np.int32, count=size)
    unowned = cp.cuda.UnownedMemory(host.ctypes.data, 4 * size, mem, cp.cuda.Device().id)
    return host, cp.ndarray((size,), np.int32, cp.cuda.MemoryPointer(unowned, 0))


class PendingTokens:
    """A step's tokens on their way to the host: wait() blocks on the copy's event only, then
    returns them as a list of ints (the same list on every call)."""

    def __init__(self, readback, slot: int, generation: int, host, event, device):
        self._readback, self._slot, self._generation = readback, slot, generation
        self._host, self._event = host, event
        self._device = device  # keeps the source alive until the copy is waited for
        self._tokens = None

    def wait(self) -> list:
        if self._tokens is None:
            if self._readback.generation[self._slot] != self._generation:
                raise RuntimeError("read_async: the tokens were not waited for before their buffer was "
                                   "reused (wait for a step's tokens before starting the second read after it)")
            self._event.synchronize()
            self._tokens, self._device = self._host.tolist(), None
        return self._tokens


class TokenReadback:
    """Asynchronous device -> host copies of int32 token arrays, on the current stream, into a
    ring of two pinned buffers, each with an event recorded after its copy. The copy is a kernel
    that writes the pinned memory over PCIe (unified addressing maps it into the device's address
    space). Two slots let one step's copy be in flight while the host reads the previous one; a
    slot is reused by the second start() after it, by which time its tokens must have been waited
    for (wait() checks)."""

    def __init__(self, cp):
        self.cp = cp
        self.host = [np.empty(0, np.int32), np.empty(0, np.int32)]
        self.device = [None, None]  # cupy views of the same pinned memory
        self.events = [cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)]
        self.generation = [0, 0]
        self.turn = 0
        self.copy = cp.ElementwiseKernel("int32 src", "int32 dst", "dst = src", "cuinfer_token_readback")

    def start(self, tokens) -> PendingTokens:
        cp, i, n = self.cp, self.turn, len(tokens)
        if tokens.dtype != np.int32 or tokens.ndim != 1:
            raise ValueError(f"read_async: need int32 [n] tokens, got {tokens.dtype} {tokens.shape}")
        self.turn ^= 1
        if len(self.host[i]) < n:
            self.host[i], self.device[i] = mapped_pinned(cp, bucket(n, 64))
        self.generation[i] += 1
        stream = cp.cuda.get_current_stream()
        self.copy(tokens, self.device[i][:n])
        self.events[i].record(stream)
        return PendingTokens(self, i, self.generation[i], self.host[i][:n], self.events[i], tokens)
