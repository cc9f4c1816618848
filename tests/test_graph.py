"""Decode steps: static-buffer packing and Model.decode on numpy; CUDA-graph replay on the GPU
(tokens equal to the eager step, logits against the float32 NumPy backend, padding rows write
only the scratch block, the capture allocates nothing; pipelined decode equals the synchronous
engine; the token read-back)."""
import numpy as np
import pytest
from test_model import GPU_LOGIT_REL_L2, gpu_case, make_cache, prompts, random_tensors, tiny_config

from cuinfer.model.decoder import Model
from cuinfer.model.step_inputs import Batch, input_views, pack_inputs
from cuinfer.serving.engine import Engine
from cuinfer.serving.piecewise import token_buckets
from cuinfer.serving.runner import BATCH_BUCKETS, batch_bucket, bucket
from cuinfer.serving.sampling import SamplingParams


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 33)] == [1, 2, 4, 8, 8, 16, 64]
    assert [bucket(n, 256) for n in (1, 256, 257, 1000)] == [256, 256, 512, 1024]


def test_pack_inputs_pads_into_the_scratch_block():
    b, width, bs, scratch = 4, 3, 16, 50
    buf = np.full(b * (4 + width), -7, dtype=np.int32)
    pack_inputs(buf, [11, 12, 13], [0, 17, 40], [[4], [9, 2], [5, 6, 7]], bs, scratch, b, width)
    v = input_views(buf, b, width)
    np.testing.assert_array_equal(v.token_ids, [11, 12, 13, 0])
    np.testing.assert_array_equal(v.positions, [0, 17, 40, 0])
    np.testing.assert_array_equal(v.slot_mapping, [4 * 16, 2 * 16 + 1, 7 * 16 + 8, scratch * 16])
    np.testing.assert_array_equal(v.context_lens, [1, 18, 41, 1])
    np.testing.assert_array_equal(v.block_tables, [[4, 0, 0], [9, 2, 0], [5, 6, 7], [scratch, 0, 0]])


def test_copy_async_checks_its_arrays():
    """The read-back and the token copy refuse what a raw cudaMemcpyAsync would misread (checked
    before any CUDA call: runs without a GPU)."""
    from cuinfer.serving.runner import copy_async

    ok = np.zeros(8, np.int32)
    for bad in (np.zeros(8, np.int64), np.zeros(3, np.int32), np.zeros(16, np.int32)[::2], np.zeros((2, 4), np.int32)):
        with pytest.raises(ValueError, match="C-contiguous int32"):
            copy_async(None, ok, bad, 4, 0, None)
        with pytest.raises(ValueError, match="C-contiguous int32"):
            copy_async(None, bad, ok, 4, 0, None)


def test_batch_buckets():
    assert [batch_bucket(n) for n in (1, 3, 16, 17, 25, 33, 65, 129, 250, 256, 257, 300)] == \
        [1, 4, 16, 24, 32, 48, 96, 160, 256, 256, 320, 320]
    assert list(BATCH_BUCKETS) == sorted(set(BATCH_BUCKETS)) and all(batch_bucket(b) == b for b in BATCH_BUCKETS)


def decode_inputs(model, seqs, block_size, b, width, scratch):
    """Numpy DecodeInputs for the last token of each (block table, ids), padded to b rows."""
    buf = np.zeros(b * (4 + width), dtype=np.int32)
    pack_inputs(buf, [ids[-1] for _, ids in seqs], [len(ids) - 1 for _, ids in seqs],
                [t for t, _ in seqs], block_size, scratch, b, width)
    return input_views(buf, b, width)


def test_numpy_decode_equals_forward_and_padding_touches_only_scratch():
    cfg = tiny_config()
    model = Model.from_tensors(cfg, random_tensors(cfg), "cpu")
    ids = prompts(cfg, [9, 17, 40])
    tables = [[5, 9], [0, 3], [7, 1, 2]]
    seqs = list(zip(tables, ids))
    caches = [make_cache(cfg, model) for _ in range(2)]
    prefix = [(s[:-1], 0, t) for t, s in seqs]
    last = [(s[-1:], len(s) - 1, t) for t, s in seqs]
    for cache in caches:
        model.forward(Batch.from_chunks(prefix, 16), cache)
    ref = model.forward(Batch.from_chunks(last, 16), caches[0])
    scratch = 63
    before = caches[1].k.copy()
    inputs = decode_inputs(model, seqs, 16, b=8, width=4, scratch=scratch)
    got = model.decode(inputs, caches[1], max_context_len=64)
    np.testing.assert_allclose(got[:3], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    written = {(t[(len(s) - 1) // 16], (len(s) - 1) % 16) for t, s in seqs} | {(scratch, 0)}
    for blk, off in np.ndindex(before.shape[1:3]):
        if (blk, off) not in written:
            np.testing.assert_array_equal(caches[1].k[:, blk, off], before[:, blk, off])
    tokens = model.decode(inputs, caches[1], max_context_len=64, greedy=True)
    np.testing.assert_array_equal(tokens, np.argmax(got, axis=-1))
    in_place = model.decode(inputs, caches[1], max_context_len=64, greedy=True, tokens_out=inputs.token_ids)
    assert np.shares_memory(in_place, inputs.token_ids)  # DecodeGraph's greedy steps write their own token slots
    np.testing.assert_array_equal(in_place, tokens)


# ------------------------------------------------------------------------------ GPU

def gpu_engine(model, use_graphs, kv_tokens=8192, eos=(), async_decode=True, kv_cache_dtype="auto"):
    from cuinfer.model.kv_cache import CacheShape, KVCache, kv_cache_dtype_for

    cfg = model.config
    shape = CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 16)
    cache = KVCache.allocate(shape, kv_cache_dtype_for(kv_cache_dtype, model.dtype), model.xp, kv_tokens)
    nan = 0x7F if kv_cache_dtype == "fp8" else np.nan  # a read of a slot nothing wrote poisons the logits
    cache.k.fill(nan)
    cache.v.fill(nan)
    return Engine(model, cache, eos_token_ids=eos, use_graphs=use_graphs, async_decode=async_decode)


def run_requests(eng, ids, lengths, **params):
    """Every prompt with its own max_new_tokens, continuously batched; the output ids."""
    seqs = [eng._requests[eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True, **params))].seq
            for p, n in zip(ids, lengths)]
    while eng.has_unfinished_requests():
        eng.step()
    return [s.output_ids for s in seqs]


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_gpu_every_batch_bucket_replays_the_eager_tokens(quant):
    """256 requests finishing one a step: the batch shrinks through every bucket, past the GEMV's
    rows too (cuBLAS inside the graph); graphs give exactly the eager step's tokens."""
    cfg, t = gpu_case("llama3-gqa")
    model = Model.from_tensors(cfg, t, "gpu", np.float16, quant=quant)
    ids = prompts(cfg, [5 + i % 13 for i in range(256)], seed=3)
    runs = {}
    for use_graphs in (True, False):
        eng = gpu_engine(model, use_graphs, kv_tokens=256 * 288)
        runs[use_graphs] = run_requests(eng, ids, [1 + i for i in range(256)])
        if use_graphs:
            assert {b for b, _, _ in eng.decoder.steps} == set(BATCH_BUCKETS)
            assert all(s.graph is not None for s in eng.decoder.steps.values())
            assert eng.decoder.graph_bytes() > 0
    assert runs[True] == runs[False]


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, "int4"])
def test_gpu_warm_up_captures_every_bucket_and_changes_no_token(quant):
    """Engine.warm_up captures a greedy graph of every batch bucket to max_num_seqs and the
    piecewise graphs of every token bucket to the step budget; the requests
    after it (on a NaN-poisoned cache: the warm-up's writes must not leak into them) give the
    tokens of an engine that never warmed up."""
    cfg, t = gpu_case("llama3-gqa")
    model = Model.from_tensors(cfg, t, "gpu", np.float16, quant=quant)
    ids = prompts(cfg, [5 + 37 * i % 300 for i in range(40)], seed=4)
    lengths = [1 + 3 * i for i in range(40)]
    warm = gpu_engine(model, True, kv_tokens=40 * 512)
    report = warm.warm_up()
    assert {b for b, _, _ in warm.decoder.steps} == set(BATCH_BUCKETS)
    pieces = sum(len(p) for p in warm.piecewise.graphs.values())
    assert pieces == len(token_buckets(512)) * (cfg.num_hidden_layers + 1)  # every token bucket, every piece
    assert report["graphs"] == len(warm.decoder.steps) + pieces and report["graph_mib"] > 0
    cold = gpu_engine(model, True, kv_tokens=40 * 512)
    assert run_requests(warm, ids, lengths) == run_requests(cold, ids, lengths)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_gpu_graph_tokens_equal_eager(dtype, kv_cache_dtype):
    """Greedy and seeded sampling: replayed graphs give exactly the eager step's tokens, across
    batch buckets (sequences finish one by one: 8, 4, 2, 1) and context buckets (256 -> 512); with
    an fp8 cache too (the prefill's flash kernel, the fused decode attention, both encoding)."""
    from cuinfer.ops import runtime

    dtype = runtime.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    cfg, t = gpu_case("llama3-gqa")
    model = Model.from_tensors(cfg, t, "gpu", dtype)
    ids = prompts(cfg, [3, 17, 200, 250, 31, 5, 90], seed=11)
    runs = {}
    for use_graphs in (True, False):
        eng = gpu_engine(model, use_graphs, kv_cache_dtype=kv_cache_dtype)
        greedy = run_requests(eng, ids, [40, 300, 70, 280, 12, 64, 150])
        sampled = run_requests(eng, ids[:3], [10, 30, 20], temperature=0.8, top_p=0.9, seed=5)
        runs[use_graphs] = (greedy, sampled)
        if use_graphs:
            keys = eng.decoder.steps.keys()
            assert {b for b, _, _ in keys} >= {1, 2, 4, 8} and {w for _, w, _ in keys} >= {16, 32}
            assert all(s.capture_bytes == 0 for s in eng.decoder.steps.values())
    assert runs[True] == runs[False]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_gpu_graph_logits_match_numpy(dtype, cp):
    """Decode logits replayed from a graph (output poisoned before each replay) against the float32
    NumPy backend, with padding rows in the bucket and a short row beside a long one (empty splits)."""
    from cuinfer.ops import runtime
    from cuinfer.serving.runner import DecodeGraph

    dtype = runtime.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    cfg, t = gpu_case("llama3-gqa")
    cpu, gpu = Model.from_tensors(cfg, t, "cpu"), Model.from_tensors(cfg, t, "gpu", dtype)
    ids = prompts(cfg, [7, 450, 33], seed=2)
    tables = [[1], [2 + i for i in range(29)], [40, 41, 42]]
    cpu_cache, gpu_cache = make_cache(cfg, cpu), make_cache(cfg, gpu)
    gpu_cache.k[:, 61:] = np.nan  # blocks no row may write; 0..59 are "live", the scratch block is 60
    graphs = DecodeGraph(gpu, gpu_cache, 60)
    prefix = Batch.from_chunks([(s[:-4], 0, tb) for tb, s in zip(tables, ids)], 16)
    cpu.forward(prefix, cpu_cache)
    gpu.forward(prefix.to(cp), gpu_cache)
    for j in range(4, 0, -1):
        pos = [len(s) - j for s in ids]
        last = Batch.from_chunks([([s[p]], p, tb) for s, p, tb in zip(ids, pos, tables)], 16)
        ref = cpu.forward(last, cpu_cache)
        if graphs.steps:
            for step in graphs.steps.values():
                step.out.fill(np.nan)
        got = graphs.run([s[p] for s, p in zip(ids, pos)], pos, tables, greedy=False).get()
        assert np.isfinite(got).all()
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err <= GPU_LOGIT_REL_L2[dtype], err
    assert bool(cp.isnan(gpu_cache.k[:, 61:]).all())  # padding rows wrote only the scratch block


# ------------------------------------------------------------ pipelined decode (GPU)

def count_rows(eng):
    """Count the rows of the greedy decode steps eng.decoder runs: a one-element list, updated."""
    rows, run = [0], eng.decoder.run

    def counting(token_ids, positions, block_tables, greedy, device_tokens=None):
        rows[0] += len(token_ids) if greedy else 0
        return run(token_ids, positions, block_tables, greedy, device_tokens=device_tokens)

    eng.decoder.run = counting
    return rows


def run_params(eng, ids, params):
    """Every prompt with its own SamplingParams, continuously batched: [(output ids, finish reason)]."""
    seqs = [eng._requests[eng.add_request(p, sp)].seq for p, sp in zip(ids, params)]
    while eng.has_unfinished_requests():
        eng.step()
    assert eng._inflight is None
    return [(s.output_ids, s.finish_reason) for s in seqs]


def mid_way_stops(outputs, lo=3):
    """(eos, {row: stop id}): the token whose first occurrence falls mid-way (index >= lo, not the
    last) in the most outputs, and for each of the first two rows it does not stop, a token of that
    row first emitted mid-way."""
    def firsts(out):
        seen = {}
        for i, t in enumerate(out):
            seen.setdefault(t, i)
        return seen

    counts = {}
    for out in outputs:
        for t, i in firsts(out).items():
            if lo <= i < len(out) - 1:
                counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=lambda t: (counts[t], -t))
    stop_ids = {}
    for r, out in enumerate(outputs):
        if len(stop_ids) < 2 and eos not in out and len(out) > 2 * lo:
            f = firsts(out)
            t = next((t for t in out[len(out) // 2:] if f[t] >= lo), None)
            if t is not None:
                stop_ids[r] = t
    return eos, stop_ids


@pytest.mark.gpu
@pytest.mark.parametrize("use_graphs", [True, False])
def test_gpu_pipelined_decode_equals_synchronous(use_graphs):
    """fp16, greedy, prompts of different lengths and max_new_tokens (contexts cross the 512-token
    bucket), some stopped mid-way by an end token or a stop id found in a first run: pipelined decode
    gives exactly the tokens and finish reasons of the synchronous engine (async_decode=False), its
    steps really were pipelined, and stopping on data wasted at least one extra row."""
    cfg, t = gpu_case("llama3-gqa")
    model = Model.from_tensors(cfg, t, "gpu", np.float16)
    ids = prompts(cfg, [3, 17, 200, 250, 31, 5, 90], seed=11)
    lengths = [40, 300, 70, 280, 12, 64, 150]
    free = run_requests(gpu_engine(model, use_graphs, async_decode=False), ids, lengths)
    eos, stop_ids = mid_way_stops(free)
    params = [SamplingParams(max_new_tokens=n, stop_token_ids=(stop_ids[r],) if r in stop_ids else ())
              for r, n in enumerate(lengths)]
    runs = {}
    for async_decode in (True, False):
        eng = gpu_engine(model, use_graphs, eos=(eos,), async_decode=async_decode)
        rows = count_rows(eng)
        runs[async_decode] = run_params(eng, ids, params)
        if async_decode:
            assert eng.stats.pipelined_steps > 10
            assert rows[0] > eng.stats.decode_tokens, "no extra row after a stop on data"
            assert eng.blocks.num_free == eng.blocks.num_blocks and eng.kv_cache_usage() == 0.0
    assert runs[True] == runs[False]
    reasons = [r for _, r in runs[True]]
    assert reasons.count("stop") >= 2 and "length" in reasons, reasons


@pytest.mark.gpu
@pytest.mark.parametrize("stop", ["length", "eos"])
def test_gpu_pipelined_batch_finishing_at_different_steps(stop):
    """Eight sequences finishing one after another (max_new_tokens 1..34, or an end token each
    reaches at its own step): the batch bucket shrinks 8 -> 4 -> 2 -> 1 under pipelining, the tokens
    equal the synchronous engine's; stopping on lengths only computes no row that is not emitted."""
    cfg, t = gpu_case("llama3-gqa")
    model = Model.from_tensors(cfg, t, "gpu", np.float16)
    ids = prompts(cfg, [5, 9, 30, 2, 61, 17, 8, 40], seed=3)
    lengths = [1, 2, 3, 5, 8, 13, 21, 34]
    eos = ()
    if stop == "eos":
        lengths = [40] * 8
        free = run_requests(gpu_engine(model, True, async_decode=False), ids, lengths)
        eos = (mid_way_stops(free, lo=1)[0],)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=not eos) for n in lengths]
    runs = {}
    for async_decode in (True, False):
        eng = gpu_engine(model, True, eos=eos, async_decode=async_decode)
        rows = count_rows(eng)
        runs[async_decode] = run_params(eng, ids, params)
        if async_decode:
            assert eng.stats.pipelined_steps > 0
            if stop == "length":
                assert rows[0] == eng.stats.decode_tokens
                assert {b for b, _, _ in eng.decoder.steps} >= {1, 2, 4, 8}
    assert runs[True] == runs[False]
    if stop == "length":
        assert [len(o) for o, _ in runs[True]] == lengths
    else:
        assert sum(r == "stop" for _, r in runs[True]) >= 2


@pytest.mark.gpu
def test_gpu_token_readback(cp):
    """read_async: the tokens, through the ring of two pinned buffers; waiting on a read whose
    buffer was reused fails instead of returning another step's tokens."""
    from cuinfer.serving.runner import TokenReadback

    rb = TokenReadback(cp)
    a, b, c = (cp.arange(k, k + 100, dtype=cp.int32) for k in (0, 1000, 2000))
    pa, pb = rb.start(a), rb.start(b)
    assert pa.wait() == list(range(100))
    pc = rb.start(c)
    assert pb.wait() == list(range(1000, 1100)) and pc.wait() == list(range(2000, 2100))
    pd = rb.start(a[:3])
    rb.start(b[:5])
    rb.start(c[:7])  # pd's buffer again
    with pytest.raises(RuntimeError, match="reused"):
        pd.wait()
    with pytest.raises(ValueError, match="int32"):
        rb.start(cp.zeros(4, dtype=cp.int64))


@pytest.mark.gpu
def test_gpu_pdl_attribute_only_on_captured_launches(cp, monkeypatch):
    """On sm_90 launches under stream capture go through cuLaunchKernelEx (programmatic dependent
    launch), eager ones through CuPy's launch; the captured and the eager rms_norm agree exactly."""
    from cuinfer.ops import runtime
    from cuinfer.ops.rms_norm import rms_norm
    from cuinfer.serving.runner import capture

    if runtime._pdl_driver() is None:
        pytest.skip("programmatic dependent launch needs sm_90 and CUINFER_PDL not 0")
    calls = []
    real = runtime._launch_ex
    monkeypatch.setattr(runtime, "_launch_ex",
                        lambda *a: (calls.append(a[0].name) if a[-1] is not None else None, real(*a)))
    x = cp.random.standard_normal((3, 256), dtype=cp.float32).astype(cp.float16)
    w = cp.random.standard_normal(256, dtype=cp.float32).astype(cp.float16)
    eager = rms_norm(x, w, 1e-5)
    assert calls == []
    out = cp.full_like(x, cp.nan)
    cp.cuda.Device().synchronize()
    graph, _, _ = capture(lambda: rms_norm(x, w, 1e-5, out=out), cp.cuda.Stream(non_blocking=True),
                          cp.cuda.MemoryPool())
    assert len(calls) == 1  # the capture (its warm-up run is eager)
    out.fill(cp.nan)
    graph.launch()
    cp.testing.assert_array_equal(out, eager)


# ------------------------------------------------------------- sampled steps (GPU)

SAMPLED = [SamplingParams(max_new_tokens=40, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
           SamplingParams(max_new_tokens=70, temperature=1.0, top_k=50, min_p=0.05, seed=6, ignore_eos=True),
           SamplingParams(max_new_tokens=25, ignore_eos=True),
           SamplingParams(max_new_tokens=55, temperature=2.5, top_k=5, top_p=0.5, seed=7, ignore_eos=True),
           SamplingParams(max_new_tokens=30, temperature=1e-3, seed=8, ignore_eos=True),
           SamplingParams(max_new_tokens=60, temperature=0.7, seed=9, ignore_eos=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("penalised", [False, True])
def test_gpu_sampled_steps_captured_equal_eager(penalised):
    """Seeded sampled requests (every filter; a greedy row beside them; with `penalised` a row with a
    repetition penalty for a while, whose steps take the logits and the eager sampler): replayed
    "sample" graphs give exactly the eager steps' tokens (use_graphs=False runs the same kernels on
    the same buffers), pipelined or not; those steps were captured and the capture took no memory."""
    cfg, t = gpu_case("llama3-gqa")
    model = Model.from_tensors(cfg, t, "gpu", np.float16)
    ids = prompts(cfg, [3, 17, 200, 31, 5, 90], seed=11)
    params = list(SAMPLED)
    if penalised:
        params[2] = SamplingParams(max_new_tokens=25, temperature=0.9, repetition_penalty=1.3, seed=3, ignore_eos=True)
    runs = {}
    for use_graphs in (True, False):
        for async_decode in (True, False):
            eng = gpu_engine(model, use_graphs, async_decode=async_decode)
            runs[use_graphs, async_decode] = run_params(eng, ids, params)
            kinds = {k for _, _, k in eng.decoder.steps}
            assert "sample" in kinds and ("logits" in kinds) == penalised
            if use_graphs:
                assert all(s.graph is not None and s.capture_bytes == 0 for s in eng.decoder.steps.values())
            if async_decode:
                assert eng.stats.pipelined_steps > 10
    assert len(set(map(str, runs.values()))) == 1, runs
    assert [len(o) for o, _ in runs[True, True]] == [p.max_new_tokens for p in params]


@pytest.mark.gpu
def test_gpu_sample_step_equals_the_reference_on_its_logits(cp):
    """A "sample" graph's tokens equal ops.sampling's NumPy reference on the logits the "logits"
    graph of the same inputs gives (padding rows in the bucket, seeded uniforms of several steps)."""
    from cuinfer.ops.sampling import sampling_reference
    from cuinfer.serving.runner import DecodeGraph
    from cuinfer.serving.sampling import draw_uniform, sampling_columns

    cfg, t = gpu_case("llama3-gqa")
    gpu = Model.from_tensors(cfg, t, "gpu", np.float16)
    ids = prompts(cfg, [7, 450, 33], seed=2)
    tables = [[1], [2 + i for i in range(29)], [40, 41, 42]]
    cache = make_cache(cfg, gpu)
    graphs = DecodeGraph(gpu, cache, 60)
    gpu.forward(Batch.from_chunks([(s[:-4], 0, tb) for tb, s in zip(tables, ids)], 16).to(cp), cache)
    params = SAMPLED[:3]
    for j in range(4, 0, -1):
        pos = [len(s) - j for s in ids]
        tokens = [s[p] for s, p in zip(ids, pos)]
        logits = graphs.run(tokens, pos, tables, greedy=False).get()
        cols = sampling_columns(params, [0.0 if p.greedy else draw_uniform(p.seed, 4 - j) for p in params])
        got = graphs.run(tokens, pos, tables, greedy=False, sampling=cols).get()
        np.testing.assert_array_equal(got, sampling_reference(logits, *cols))
    assert {k for _, _, k in graphs.steps} == {"logits", "sample"}
