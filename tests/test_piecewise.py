"""Eager steps through piecewise CUDA graphs (cuinfer.serving.piecewise): the token buckets (CPU);
on the GPU, the logits of prefill and mixed steps against the float32 NumPy backend with every
static buffer poisoned before the step, graphs equal to the same pieces run eagerly, and the
fallback past the largest bucket."""
import numpy as np
import pytest
from test_model import GPU_LOGIT_REL_L2, gpu_case, make_cache, prompts

from cuinfer.model.decoder import Model
from cuinfer.model.step_inputs import Batch
from cuinfer.serving.piecewise import token_bucket, token_buckets


def test_token_buckets():
    assert [token_bucket(n) for n in (1, 16, 17, 33, 128, 129, 257, 1000, 1152, 2048, 2049)] == \
        [16, 16, 32, 48, 128, 160, 320, 1024, 1152, 2048, 2112]
    for n in range(1, 5000):
        b = token_bucket(n)
        assert b >= n and token_bucket(b) == b
        assert b - n <= (15 if n <= 128 else 31 if n <= 256 else 63), n
    buckets = token_buckets(2048)
    assert buckets[0] == 16 and buckets[-1] == 2048 and buckets == sorted(set(buckets))
    assert buckets == sorted({token_bucket(n) for n in range(1, 2049)})
    assert token_buckets(100) == [16, 32, 48, 64, 80, 96, 112]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,quant", [(np.float16, None), ("bfloat16", None), (np.float16, "int4"),
                                         (np.float16, "int8")])
def test_gpu_piecewise_steps_match_numpy(dtype, quant, cp):
    """Prefill chunks, mixed steps (chunks and decodes) and all-token logits: the piecewise step's
    logits against the NumPy backend's (of the same quantized weights), finite although the static
    buffers (their padding rows included) hold NaN before every step; replayed graphs equal the
    eager pieces bit for bit; a step past the largest bucket runs Model.forward. Quantized weights
    take the GEMV (16 rows) and the GEMM with its residual epilogue (32, 64 rows), whose residual
    stream is a new array each layer."""
    from cuinfer.ops import runtime
    from cuinfer.serving.piecewise import PiecewiseForward

    dtype = runtime.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    cfg, t = gpu_case("llama3-gqa")
    cpu = Model.from_tensors(cfg, t, "cpu", quant=quant)
    gpu = Model.from_tensors(cfg, t, "gpu", dtype, quant=quant)
    cpu_cache, gpu_cache = make_cache(cfg, cpu), make_cache(cfg, gpu)
    runs = {g: PiecewiseForward(gpu, gpu_cache, 64, use_graphs=g) for g in (True, False)}
    assert runs[True].capture_all() == 4 * (cfg.num_hidden_layers + 1) and runs[False].capture_all() == 0
    ids = prompts(cfg, [60, 100, 12, 40], seed=6)
    tables = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15]]

    def chunk(i, a, b):
        return ids[i][a:b], a, tables[i]

    steps = [([chunk(0, 0, 30), chunk(1, 0, 20)], False),  # 50 tokens: bucket 64
             ([chunk(2, 0, 5)], False),  # 5: bucket 16
             ([chunk(1, 20, 90)], False),  # 70: past the largest bucket
             ([chunk(3, 0, 21), chunk(0, 30, 31), chunk(1, 90, 91), chunk(2, 5, 6)], False),  # mixed, 24 -> 32
             ([chunk(3, 21, 40), chunk(0, 31, 32), chunk(2, 6, 7)], True)]  # mixed, all logits
    for chunks, all_logits in steps:
        batch = Batch.from_chunks(chunks, 16)
        ref = cpu.forward(batch, cpu_cache, all_logits=all_logits)
        got = {}
        for g, run in runs.items():
            for a in (run.s, run.a, run.qkv):
                a.fill(np.nan)
            got[g] = run.forward(batch.to(cp), all_logits=all_logits).get()
            assert np.isfinite(got[g]).all()
        np.testing.assert_array_equal(got[True], got[False])
        err = np.linalg.norm(got[True] - ref) / np.linalg.norm(ref)
        assert err <= GPU_LOGIT_REL_L2[dtype], (len(batch.token_ids), err)
    assert sorted(runs[True].graphs) == token_buckets(64) == [16, 32, 48, 64]
    assert all(len(p) == cfg.num_hidden_layers + 1 for p in runs[True].graphs.values())
    assert runs[False].graphs == {}
    # without capture_all a bucket is captured on its second step, its first run eagerly
    lazy = PiecewiseForward(gpu, gpu_cache, 64)
    batch = Batch.from_chunks(steps[1][0], 16).to(cp)
    first = lazy.forward(batch).get()
    assert lazy.graphs == {}
    np.testing.assert_array_equal(lazy.forward(batch).get(), first)
    assert list(lazy.graphs) == [16]
