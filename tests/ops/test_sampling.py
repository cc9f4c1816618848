"""sampling: the reference's definition (exp, ranks, ties, integer weights), the kernel's radix select
emulated in NumPy, launcher checks; on the GPU the kernel's tokens equal the reference's, bit for bit,
and a captured launch allocates nothing."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuinfer.ops import runtime
from cuinfer.ops.sampling import W_SCALE, exp_det, probs, rank_keys, sample_row_reference, sampling

DTYPES = [np.float32, np.float16, runtime.bfloat16]


def columns(rows, rng, temperature=None):
    """Random per-row parameters: temperature (0, tiny, moderate, large), top_k 0/1/5/50, top_p
    0.1..1, min_p, uniforms (0 and just below 1 included)."""
    f32 = lambda a: np.asarray(a, dtype=np.float32)
    t = temperature if temperature is not None else rng.choice([0.0, 1e-4, 0.3, 0.7, 1.0, 2.5, 100.0], rows)
    u = rng.random(rows)
    u[rng.random(rows) < 0.15] = 0.0
    u[rng.random(rows) < 0.1] = 0.99999994  # the largest float32 below 1
    return (f32(np.broadcast_to(t, rows)), rng.choice([0, 0, 1, 5, 50], rows).astype(np.int32),
            f32(rng.choice([1.0, 1.0, 0.95, 0.9, 0.5, 0.1], rows)), f32(rng.choice([0.0, 0.0, 0.05, 0.5], rows)), f32(u))


def random_logits(rng, rows, n, scale, ties, masked, dtype):
    x = scale * rng.standard_normal((rows, n))
    if ties:  # many equal logits, at the top too
        x = np.round(x / max(scale, 1e-3) * 2) * max(scale, 1e-3) / 2
    if masked:
        x[rng.random(x.shape) < 0.3] = -np.inf
    return x.astype(dtype)


def test_exp_det_is_exp_to_a_few_ulp_and_monotone():
    s = np.linspace(-32, 0, 1_000_001, dtype=np.float32)
    e = exp_det(s).astype(np.float64)
    assert np.abs(e / np.exp(s.astype(np.float64)) - 1).max() < 2e-7
    assert exp_det(np.float32(0)) == 1 and np.all(np.diff(e) >= 0)


def test_rank_keys_order_by_logit_then_lowest_id():
    x = np.array([1.0, -0.0, 3.0, 1.0, 0.0, -np.inf, 3.0], np.float32)
    order = list(np.argsort(rank_keys(x))[::-1])
    assert order == [2, 6, 0, 3, 1, 4, 5]  # -0 ranks as +0: by id


def test_temperature_zero_is_the_first_argmax_and_ties_go_to_the_lowest_id():
    x = np.array([0.5, 2.0, 2.0, -1.0], np.float32)
    assert sample_row_reference(x, 0.0, 0, 1.0, 0.0, 0.7) == 1
    # top_k 1 among tied maxima keeps the lowest id; with both kept, u splits them in id order
    assert sample_row_reference(x, 1.0, 1, 1.0, 0.0, 0.99) == 1
    assert [sample_row_reference(x, 1e-3, 0, 1.0, 0.0, u) for u in (0.2, 0.7)] == [1, 2]


def test_reference_is_the_inverse_cdf_of_the_integer_weights():
    """Away from the ties of a permutation, relabelling the vocabulary relabels the token; the pick
    is the inverse CDF of trunc(p * 2^31) over the kept tokens in rank order."""
    rng = np.random.default_rng(4)
    for _ in range(50):
        n = int(rng.integers(2, 400))
        x = (3 * rng.standard_normal(n)).astype(np.float32)
        t, k, p, m, u = (float(rng.choice([0.5, 1.0, 2.0])), int(rng.choice([0, 3, 40])), float(rng.choice([1.0, 0.8])),
                         float(rng.choice([0.0, 0.1])), float(rng.random()))
        perm = rng.permutation(n)
        tok = sample_row_reference(x, t, k, p, m, u)
        assert perm[sample_row_reference(x[perm], t, k, p, m, u)] == tok
        order = np.argsort(-x.astype(np.float64), kind="stable")
        pr = probs(x[order], x.max(), t)
        w = (pr * W_SCALE).astype(np.int64)
        keep = np.arange(n) < (k or n)
        c = np.cumsum(np.where(keep, w, 0))
        keep &= np.arange(n) <= np.searchsorted(c, np.ceil(np.float64(np.float32(p)) * c[-1]) - 1, side="right")
        keep &= pr >= np.float32(m)
        v = np.where(keep, w, 0)
        target = min(int(np.floor(np.float64(np.float32(u)) * v.sum())), v.sum() - 1)
        assert order[np.searchsorted(np.cumsum(v), target, side="right")] == tok


def radix_select(keys, weights, target):
    """The kernel's select_key in NumPy: 8 bits of the 64-bit key a pass from the top, the weighted
    histogram of the tokens matching the prefix, stopping at a bin of one token."""
    prefix, above = 0, 0
    for shift in range(56, -1, -8):
        mask = np.uint64(0 if shift >= 56 else ((~0 << (shift + 8)) & (2 ** 64 - 1)))
        match = (keys & mask) == np.uint64(prefix)
        digit = ((keys[match] >> np.uint64(shift)) & np.uint64(255)).astype(np.int64)
        hist = [int(weights[match][digit == d].sum()) for d in range(256)]
        run = above
        for d in range(255, -1, -1):
            if target < run + hist[d]:
                break
            run += hist[d]
        prefix, above = prefix | (d << shift), run
        if (digit == d).sum() == 1:
            return int(keys[match][digit == d][0])
    return prefix


@pytest.mark.parametrize("compact", [False, True])
def test_the_kernels_radix_select_finds_the_references_token(compact):
    """The kernel's passes (top-k by count, top-p and the pick by weight) run on NumPy with ties and
    masked logits, over the whole row or (compact) over only the tokens within top-k whose
    x - max >= -33 * temperature (the kernel's list in shared memory): the reference's token."""
    rng = np.random.default_rng(5)
    for _ in range(60):
        n = int(rng.choice([1, 2, 17, 300]))
        row = random_logits(rng, 1, n, float(rng.choice([0.1, 4.0])), rng.random() < 0.4, rng.random() < 0.2,
                            np.float32)[0]
        t, k, p, m, u = [c[0] for c in columns(1, rng)]
        keys, x = rank_keys(row), row
        best = int(keys.max())
        tok = 0xFFFFFFFF - (best & 0xFFFFFFFF)
        if t != 0:
            keep_from = radix_select(keys, np.ones(n, np.uint64), k - 1) if 0 < k < n else 0
            if compact:
                with np.errstate(invalid="ignore"):
                    may = (keys >= np.uint64(keep_from)) & ((x - row[tok]) >= np.float32(-33.0) * t)
                keys, x = keys[may], x[may]
            pr = probs(x, row[tok], t)
            w = (pr * W_SCALE).astype(np.uint64)
            if p < 1:
                wk = np.where(keys >= np.uint64(keep_from), w, np.uint64(0))
                if wk.sum():
                    keep_from = radix_select(keys, wk, int(np.ceil(np.float64(p) * np.float64(int(wk.sum())))) - 1)
            v = np.where((keys >= np.uint64(keep_from)) & (pr >= m), w, np.uint64(0))
            s = int(v.sum())
            if s:
                key = radix_select(keys, v, min(int(np.floor(np.float64(u) * s)), s - 1))
                tok = 0xFFFFFFFF - (key & 0xFFFFFFFF)
        assert tok == sample_row_reference(row, t, k, p, m, u)


def test_argument_checks():
    rng = np.random.default_rng(0)
    x = np.zeros((3, 10), np.float32)
    cols = columns(3, rng)
    with pytest.raises(ValueError, match="logits: got dtype int32"):
        sampling(x.astype(np.int32), *cols)
    with pytest.raises(ValueError, match="top_k: got dtype int64"):
        sampling(x, cols[0], cols[1].astype(np.int64), *cols[2:])
    with pytest.raises(ValueError, match=r"uniforms: got shape \(2,\)"):
        sampling(x, *cols[:4], cols[4][:2])
    with pytest.raises(ValueError, match="out: got shape"):
        sampling(x, *cols, out=np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="logits: got rows of 0"):
        sampling(np.zeros((3, 0), np.float32), *cols)


# ------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.sampled_from([1, 3, 8]), n=st.sampled_from([1, 17, 1000, 49152, 128256]),
       dtype=st.sampled_from(DTYPES), scale=st.sampled_from([0.1, 1.0, 4.0, 30.0]), ties=st.booleans(),
       masked=st.booleans(), seed=st.integers(0, 2 ** 31))
def test_sampling_kernel_equals_reference(cp, rows, n, dtype, scale, ties, masked, seed):
    """Vocabularies from 1 token to 128256 (the row in shared memory up to ~56k, streamed past it),
    fp32/fp16/bf16 logits, ties, masked tokens, every filter: the kernel's token is the reference's."""
    rng = np.random.default_rng(seed)
    x = random_logits(rng, rows, n, scale, ties, masked, dtype)
    cols = columns(rows, rng)
    want = sampling(x, *cols)
    out = cp.full(rows, -1, dtype=cp.int32)
    got = sampling(cp.asarray(x), *(cp.asarray(c) for c in cols), out=out)
    assert got is out
    np.testing.assert_array_equal(got.get(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1000, 128256])
@pytest.mark.parametrize("top_k", [50, 0])
def test_sampling_kernel_many_uniforms_one_row(cp, n, top_k):
    """One row's logits repeated 512 times (128 for the long row) with uniforms across [0, 1), the nucleus and top-k at
    work (top_k 50: the kernel's compacted list; 0 at temperature 2: the whole row): every token
    equals the reference's (the whole inverse CDF, not one point of it)."""
    rng = np.random.default_rng(n)
    rows = 512 if n < 10_000 else 128
    x = np.repeat((3 * rng.standard_normal((1, n))).astype(np.float32), rows, axis=0)
    f32 = lambda v: np.full(rows, v, np.float32)
    cols = (f32(0.8 if top_k else 2.0), np.full(rows, top_k, np.int32), f32(0.9), f32(0.01 if top_k else 0.0),
            ((np.arange(rows) + 0.5) / rows).astype(np.float32))
    want = sampling(x, *cols)
    got = sampling(cp.asarray(x), *(cp.asarray(c) for c in cols)).get()
    np.testing.assert_array_equal(got, want)
    assert len(set(want.tolist())) > 5


@pytest.mark.gpu
def test_sampling_kernel_captured_allocates_nothing_and_replays_new_parameters(cp):
    """Launched into a CUDA graph with static parameter arrays: the capture takes no memory, and
    replays after copying new parameters and logits in give the reference's tokens."""
    from cuinfer.serving.runner import capture

    rng = np.random.default_rng(1)
    rows, n = 16, 49152
    logits = cp.asarray(random_logits(rng, rows, n, 4.0, False, False, np.float32))
    cols = [cp.asarray(c) for c in columns(rows, rng)]
    out = cp.zeros(rows, dtype=cp.int32)
    pool = cp.cuda.MemoryPool()
    cp.cuda.Device().synchronize()
    graph, _, taken = capture(lambda: sampling(logits, *cols, out=out), cp.cuda.Stream(non_blocking=True), pool)
    assert taken == 0 and pool.total_bytes() == 0
    for seed in range(3):
        rng = np.random.default_rng(100 + seed)
        x = random_logits(rng, rows, n, float(rng.choice([1.0, 4.0])), seed == 1, seed == 2, np.float32)
        new = columns(rows, rng)
        logits.set(x)
        for c, v in zip(cols, new):
            c.set(v)
        graph.launch()
        np.testing.assert_array_equal(out.get(), sampling(x, *new))
