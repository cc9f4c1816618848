"""Sampling: each filter against a direct formula, seeds, and the device path against the host path."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuinfer.errors import CuinferError
from cuinfer.serving.sampling import SamplingParams, apply_repetition_penalty, draw_uniform, sample, sample_rows


def allowed_set(logits, temperature, top_k, top_p, min_p):
    """Tokens a sampler may return, by definition, applied one after another as Hugging Face's
    warpers do (temperature, top-k, top-p of the renormalised rest, min-p); float64, one row."""
    z = logits.astype(np.float64) / temperature
    order = list(np.argsort(-z, kind="stable"))
    if top_k:
        order = order[:top_k]
    p = np.exp(z[order] - z.max())
    p /= p.sum()
    nucleus = [t for t, before in zip(order, np.cumsum(p) - p) if before < top_p]
    return {int(t) for t in nucleus if np.exp(z[t] - z.max()) >= min_p}  # p / p_max >= min_p


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).standard_normal((5, 50)).astype(np.float32)
    out = sample(logits, [SamplingParams()] * 5, [()] * 5, [0.0] * 5)
    np.testing.assert_array_equal(out, logits.argmax(-1))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.sampled_from([0.3, 1.0, 2.5]), st.sampled_from([0, 1, 5, 40]),
       st.sampled_from([1.0, 0.9, 0.3]), st.sampled_from([0.0, 0.05, 0.5]), st.floats(0, 0.999))
def test_sampled_token_is_allowed_and_follows_the_cdf(seed, temp, top_k, top_p, min_p, u):
    logits = np.random.default_rng(seed).standard_normal((1, 97)).astype(np.float32) * 3
    f32 = lambda v: np.array([v], dtype=np.float32)
    tok = int(sample_rows(logits, f32(temp), np.array([top_k]), f32(top_p), f32(min_p), f32(u), np)[0])
    allowed = allowed_set(logits[0], temp, top_k, top_p, min_p)
    assert tok in allowed
    # inverse CDF over the allowed tokens in descending-probability order
    z = logits[0].astype(np.float64) / temp
    order = [t for t in np.argsort(-z, kind="stable") if t in allowed]
    p = np.exp(z[order] - z.max())
    cdf = np.cumsum(p) / p.sum()
    expect = order[min(int((cdf <= u).sum()), len(order) - 1)]
    if abs(cdf - u).min() > 1e-5:  # away from a CDF step, the pick is exact
        assert tok == expect


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = np.random.default_rng(3).standard_normal((4, 300)).astype(np.float32)
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)):
        out = sample(logits, [params] * 4, [()] * 4, [0.99, 0.5, 0.0, 0.7])
        np.testing.assert_array_equal(out, logits.argmax(-1))


def test_distribution_matches_softmax():
    logits = np.array([[2.0, 1.0, 0.0, -1.0]], dtype=np.float32)
    p = np.exp(logits[0] / 0.7) / np.exp(logits[0] / 0.7).sum()
    us = (np.arange(4000) + 0.5) / 4000
    toks = [int(sample(logits, [SamplingParams(temperature=0.7)], [()], [u])[0]) for u in us]
    np.testing.assert_allclose(np.bincount(toks, minlength=4) / 4000, p, atol=1e-3)


def test_repetition_penalty_rule():
    logits = np.array([[2.0, -2.0, 1.0, 0.5]], dtype=np.float32)
    out = apply_repetition_penalty(logits.copy(), [[0, 1, 1]], [2.0], np)
    np.testing.assert_allclose(out, [[1.0, -4.0, 1.0, 0.5]])
    # the penalty moves greedy off a repeated token
    tok = sample(np.array([[1.0, 0.9]], np.float32), [SamplingParams(repetition_penalty=1.5)], [[0]], [0.0])
    assert tok[0] == 1


def test_seeded_uniforms_are_reproducible_and_differ_by_step():
    assert draw_uniform(5, 0) == draw_uniform(5, 0)
    assert draw_uniform(5, 0) != draw_uniform(5, 1) and draw_uniform(5, 0) != draw_uniform(6, 0)
    assert 0 <= draw_uniform(123, 7) < 1


def test_draw_uniforms_is_draw_uniform_per_row_and_uniform():
    from cuinfer.serving.sampling import draw_uniforms

    seeds, steps = [0, 1, 2 ** 63 - 1, 5, 5], [0, 0, 9, 1, 2]
    assert draw_uniforms(seeds, steps).tolist() == [draw_uniform(s, t) for s, t in zip(seeds, steps)]
    u = draw_uniforms(np.arange(100_000) % 500, np.arange(100_000) // 500)  # consecutive seeds and steps
    counts = np.bincount((u * 20).astype(int), minlength=20)
    assert ((counts - 5000) ** 2 / 5000).sum() < 43.8  # chi-square, 19 degrees of freedom, p = 0.001
    assert len(np.unique(u)) == len(u)


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"min_p": 1},
                                {"top_k": -1}, {"max_new_tokens": 0}, {"repetition_penalty": 0}])
def test_bad_params(kw):
    with pytest.raises(CuinferError, match=next(iter(kw))):
        SamplingParams(**kw)


@pytest.mark.gpu
def test_device_matches_host(cp):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((16, 49152)) * 4).astype(np.float32)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, repetition_penalty=r)
              for t, k, p, m, r in zip([0, 0.7, 1.0, 1.3] * 4, [0, 50, 0, 10] * 4, [1.0, 0.9, 0.8, 1.0] * 4,
                                       [0, 0, 0.1, 0.02] * 4, [1.0, 1.2, 1.0, 1.1] * 4)]
    hist = [rng.integers(0, 49152, 30).tolist() for _ in range(16)]
    us = rng.random(16).tolist()
    host = sample(logits, params, hist, us)
    dev = sample(cp.asarray(logits), params, hist, us)
    np.testing.assert_array_equal(dev, host)


def test_a_stop_string_is_one_string():
    assert SamplingParams(stop=".,").stop == (".,",)
    assert SamplingParams(stop=[".", ","]).stop == (".", ",")


def test_presence_and_frequency_penalties_follow_openais_formula():
    from cuinfer.serving.sampling import apply_presence_frequency

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    outputs = [[4, 4, 9, 4], [], [0, 49, 49]]
    presence, frequency = [0.5, 1.0, -0.25], [0.3, 2.0, 1.5]
    got = apply_presence_frequency(logits.copy(), outputs, presence, frequency, np)
    want = logits.copy()
    for i, out in enumerate(outputs):
        for t in set(out):
            want[i, t] -= frequency[i] * out.count(t) + presence[i]
    np.testing.assert_array_equal(got, want)


def test_token_logprobs_are_the_log_softmax():
    from cuinfer.serving.sampling import token_logprobs

    rng = np.random.default_rng(1)
    logits = (4 * rng.standard_normal((4, 97))).astype(np.float32)
    tokens = np.array([3, 50, 96, 0])
    x = logits.astype(np.float64)
    ref = x - (x.max(1, keepdims=True) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)))
    got = token_logprobs(logits, tokens, [0, 2, 3], [0, 5, 2], np)
    for (chosen, top), i, k in zip(got, [0, 2, 3], [0, 5, 2]):
        assert abs(chosen - ref[i, tokens[i]]) < 1e-5
        assert [t for t, _ in top] == list(np.argsort(-ref[i])[:k])
        assert all(abs(v - ref[i, t]) < 1e-5 for t, v in top)


def test_sample_reports_logprobs_only_where_asked():
    logits = np.random.default_rng(2).standard_normal((2, 30)).astype(np.float32)
    params = [SamplingParams(logprobs=2), SamplingParams()]
    tokens, lps = sample(logits, params, [(), ()], [0.0, 0.0], with_logprobs=True)
    assert list(tokens) == list(np.argmax(logits, 1)) and lps[1] is None
    assert lps[0][1][0][0] == tokens[0]  # greedy: the chosen token is the most likely
    with pytest.raises(CuinferError, match="presence_penalty"):
        SamplingParams(presence_penalty=3)
