"""Decode steps: static-buffer packing and Model.decode on numpy; CUDA-graph replay on the GPU
(tokens equal to the eager step, logits against the float32 NumPy backend, padding rows write
only the scratch block, the capture allocates nothing)."""
import numpy as np
import pytest
from test_model import GPU_LOGIT_REL_L2, gpu_case, make_cache, prompts, random_tensors, tiny_config

from cuinfer.engine import Engine
from cuinfer.graph import bucket, graph_batch_limit, input_views, pack_inputs
from cuinfer.model import Batch, Model
from cuinfer.sampling import SamplingParams


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


def test_graph_batch_limit_follows_the_gemv_limits():
    cfg = tiny_config(intermediate_size=384)
    fp = Model.from_tensors(cfg, random_tensors(cfg), "cpu").weights
    q = Model.from_tensors(cfg, random_tensors(cfg), "cpu", quant="int4").weights
    assert graph_batch_limit(fp, True) == graph_batch_limit(fp, False) == 16  # cuBLAS above 16 rows
    assert graph_batch_limit(q, True) == graph_batch_limit(q, False) == 64  # the lm_head is int8 too


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


# ------------------------------------------------------------------------------ GPU

def gpu_engine(model, use_graphs, kv_tokens=8192):
    from cuinfer.kv_cache import CacheShape, KVCache

    cfg = model.config
    shape = CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 16)
    cache = KVCache.allocate(shape, model.dtype, model.xp, kv_tokens)
    cache.k.fill(np.nan)  # a read of a slot nothing wrote poisons the logits
    cache.v.fill(np.nan)
    return Engine(model, cache, use_graphs=use_graphs)


def run_requests(eng, ids, lengths, **params):
    """Every prompt with its own max_new_tokens, continuously batched; the output ids."""
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True, **params))
            for p, n in zip(ids, lengths)]
    while eng.scheduler.has_work():
        eng.step()
    return [s.output_ids for s in seqs]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_gpu_graph_tokens_equal_eager(dtype):
    """Greedy and seeded sampling: replayed graphs give exactly the eager step's tokens, across
    batch buckets (sequences finish one by one: 8, 4, 2, 1) and context buckets (256 -> 512)."""
    from cuinfer import runtime

    dtype = runtime.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    cfg, t = gpu_case("llama3-gqa")
    model = Model.from_tensors(cfg, t, "gpu", dtype)
    ids = prompts(cfg, [3, 17, 200, 250, 31, 5, 90], seed=11)
    runs = {}
    for use_graphs in (True, False):
        eng = gpu_engine(model, use_graphs)
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
    from cuinfer import runtime
    from cuinfer.graph import DecodeGraph

    dtype = runtime.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    cfg, t = gpu_case("llama3-gqa")
    cpu, gpu = Model.from_tensors(cfg, t, "cpu"), Model.from_tensors(cfg, t, "gpu", dtype)
    ids = prompts(cfg, [7, 450, 33], seed=2)
    tables = [[1], [2 + i for i in range(29)], [40, 41, 42]]
    cpu_cache, gpu_cache = make_cache(cfg, cpu), make_cache(cfg, gpu)
    gpu_cache.allocator.allocate(60)  # blocks 0..59 are "live": the scratch block is 60
    gpu_cache.k[:, 61:] = np.nan  # blocks no row may write
    graphs = DecodeGraph(gpu, gpu_cache)
    assert graphs.scratch == 60
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
