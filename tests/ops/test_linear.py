"""linear: NumPy reference against float64 loops, argument checks, GEMV / prefill kernels on the GPU."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuinfer import quant, runtime
from cuinfer.ops.linear import (
    INSTANTIATIONS,
    _gemv,
    instantiation,
    linear,
    linear_reference,
    tile_config,
)
from tests.conftest import assert_close, poison

DTYPES = [np.dtype(np.float16), runtime.bfloat16]


def make_weight(rng, n, k, fmt, group_size=128):
    """A weight of unit-scale outputs (entries ~ N(0, 1/K)) as fp16 array or quantized object (numpy)."""
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    return w if fmt == "float" else quant.quantize(w, fmt, group_size)


def reference_rounded(x, w, bias, prefill):
    """float32 reference mirroring the kernels' roundings: the GEMV uses T(q - T(zero)) with the
    scale in fp32 (exact for integer zeros); the prefill path rounds the dequantized weight to T.
    (Its bias add rounds the product first: run_case checks that step exactly.)"""
    t = x.dtype
    if isinstance(w, (quant.Int8Weight, quant.Int4Weight)):
        wf = w.dequantize(t)
        if prefill:
            wf = wf.astype(t).astype(np.float32)  # dequantize-to-scratch writes T
    else:
        wf = w.astype(np.float32)
    return linear_reference(x, wf, bias)


# ------------------------------------------------------------------------ CPU
def test_reference_matches_float64_loops():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 64)).astype(np.float16)
    bias = rng.standard_normal(5).astype(np.float16)
    for fmt in ("float", "int8", "int4"):
        w = make_weight(rng, 5, 64, fmt, 32)
        wf = w.astype(np.float64) if fmt == "float" else w.dequantize().astype(np.float64)
        want = np.zeros((3, 5))
        for m in range(3):
            for n in range(5):
                want[m, n] = sum(float(x[m, k]) * wf[n, k] for k in range(64)) + float(bias[n])
        got = linear(x, w.astype(np.float16) if fmt == "float" else w, bias)
        assert got.dtype == np.float16
        assert_close(got, want)


def test_int4_dequantize_matches_group_formula():
    rng = np.random.default_rng(3)
    w = make_weight(rng, 4, 96, "int4", 32)
    q = quant.unpack_int4(w.qweight, 96).astype(np.float64)
    want = np.empty((4, 96))
    for n in range(4):
        for k in range(96):
            g = k // 32
            want[n, k] = (q[n, k] - float(w.zeros[n, g])) * float(w.scales[n, g])
    np.testing.assert_allclose(w.dequantize(), want, rtol=1e-7)


def test_argument_checks():
    x = np.zeros((2, 64), np.float16)
    w = np.zeros((8, 64), np.float16)
    with pytest.raises(ValueError, match="x: got dtype float64"):
        linear(x.astype(np.float64), w)
    with pytest.raises(ValueError, match=r"w: got shape \(8, 32\)"):
        linear(x, w[:, :32].copy())
    with pytest.raises(ValueError, match="w: got dtype"):
        linear(x, w.astype(np.float32))
    with pytest.raises(ValueError, match="bias: got shape"):
        linear(x, w, bias=np.zeros(7, np.float16))
    with pytest.raises(ValueError, match="out: got shape"):
        linear(x, w, out=np.zeros((2, 9), np.float16))
    q4 = quant.quantize(w.astype(np.float32), "int4", 32)
    with pytest.raises(ValueError, match=r"w: got shape \(8, 64\), need \[\*, 96\]"):
        linear(np.zeros((2, 96), np.float16), q4)
    bad = quant.Int4Weight(q4.qweight, q4.scales[:, :1].copy(), q4.zeros, 32, (8, 64))
    with pytest.raises(ValueError, match="w.scales: got shape"):
        linear(x, bad)
    q8 = quant.quantize(w.astype(np.float32), "int8")
    with pytest.raises(ValueError, match="w.qweight: got dtype"):
        linear(x, quant.Int8Weight(q8.qweight.astype(np.int16), q8.scales, q8.shape))
    with pytest.raises(ValueError, match="w.scales: got dtype"):
        linear(x, quant.Int8Weight(q8.qweight, q8.scales.astype(np.float32), q8.shape))


def test_tile_config_fits_instantiations():
    for bits, gs in ((16, 0), (8, 0), (4, 32)):
        for m in range(1, 17):
            for n in (1, 17, 1024, 4096, 8448, 14336, 16896, 128256):
                nt, rt, u, warps = tile_config(bits, m, n)
                assert 8 * nt >= m and rt * u * (2 if bits == 4 else 1) <= 4
                assert instantiation(runtime.bfloat16, bits, gs, nt, rt, u, warps) in INSTANTIATIONS


# ------------------------------------------------------------------------ GPU
FORMATS = [("float", 0), ("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128)]


def k_strategy(fmt, gs):
    if fmt == "int4":  # multiples of the group, including K % 128 != 0
        return st.sampled_from([gs, 3 * gs, 5 * gs, 33 * gs]).filter(lambda k: k <= 4352)
    step = 8 if fmt == "float" else 16
    return st.sampled_from([step, 17 * step, 111 * step, 4096 + step])


def run_case(cp, rng, dtype, m, n, k, fmt, gs, use_bias, magnitude, prefill=False):
    x = (rng.standard_normal((m, k)) * magnitude).astype(dtype)
    w = make_weight(rng, n, k, fmt, gs or 128)
    if fmt == "float":
        w = w.astype(dtype)
    bias = rng.standard_normal(n).astype(dtype) if use_bias else None
    w_dev = cp.asarray(w) if fmt == "float" else w.to_device()
    out = poison(cp, (m, n), dtype)
    if prefill and use_bias:
        # the prefill path rounds x @ W.T to T, then adds the bias in T (cupy's add): compare the
        # product with the reference, and the bias step exactly. A 1-ulp flip of the rounded
        # product (accumulation order) is 1 ulp of |x @ W.T|, not of |y|: beyond the table's atol.
        product = linear(cp.asarray(x), w_dev, out=poison(cp, (m, n), dtype))
        assert_close(product, reference_rounded(x, w, None, prefill))
        got = linear(cp.asarray(x), w_dev, cp.asarray(bias), out=out)
        np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(product) + bias)
        return
    got = linear(cp.asarray(x), w_dev, None if bias is None else cp.asarray(bias), out=out)
    assert got is out
    assert_close(out, reference_rounded(x, w, bias, prefill))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemv_matches_reference(fmt, gs, dtype):
    import cupy as cp

    @settings(max_examples=25, deadline=None)
    @given(m=st.integers(1, 16), n=st.sampled_from([1, 17, 111, 989, 2048 + 48]), k=k_strategy(fmt, gs),
           use_bias=st.booleans(), magnitude=st.sampled_from([1.0, 60.0]), seed=st.integers(0, 2**32 - 1))
    def check(m, n, k, use_bias, magnitude, seed):
        run_case(cp, np.random.default_rng(seed), dtype, m, n, k, fmt, gs, use_bias, magnitude)

    check()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_matches_reference(fmt, gs, dtype):
    import cupy as cp

    @settings(max_examples=12, deadline=None)
    @given(m=st.sampled_from([17, 64, 111, 300]), n=st.sampled_from([1, 17, 989]), k=k_strategy(fmt, gs),
           use_bias=st.booleans(), seed=st.integers(0, 2**32 - 1))
    def check(m, n, k, use_bias, seed):
        run_case(cp, np.random.default_rng(seed), dtype, m, n, k, fmt, gs, use_bias, 1.0, prefill=True)

    check()


@pytest.mark.gpu
def test_gemv_llama_shape_int4_lm_head_tile():
    import cupy as cp

    # N large enough for the two-row-tile configuration (RT = 2) at M = 9..16
    for fmt, gs in FORMATS:
        run_case(cp, np.random.default_rng(5), runtime.bfloat16, 11, 17000 + 5, 160 if fmt != "int4" else 5 * gs,
                 fmt, gs, True, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [("float", 0), ("int8", 0), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("config", [(1, 1, 1, 8), (1, 1, 2, 4), (1, 1, 4, 8), (1, 2, 1, 8), (2, 1, 2, 16),
                                    (2, 2, 1, 8), (2, 2, 2, 8), (2, 1, 4, 8), (1, 1, 2, 16)])
def test_gemv_every_tile_config(fmt, gs, config):
    """Tile configurations beyond the ones tile_config picks today give the same result."""
    import cupy as cp

    nt = config[0]
    rng = np.random.default_rng(sum(config))
    m, n, k = (7 if nt == 1 else 13), 75, (4 * 128 + 64 if fmt != "int4" else 5 * 128)
    x = rng.standard_normal((m, k)).astype(np.float16)
    w = make_weight(rng, n, k, fmt, gs or 128)
    w = w.astype(np.float16) if fmt == "float" else w
    ref = reference_rounded(x, w, None, False)
    w_dev = cp.asarray(w) if fmt == "float" else w.to_device()
    out = poison(cp, (m, n), np.float16)
    _gemv(cp.asarray(x), w_dev, None, out, config)
    assert_close(out, ref)


@pytest.mark.gpu
def test_device_argument_checks():
    import cupy as cp

    x = cp.zeros((2, 72), cp.float16)
    with pytest.raises(ValueError, match="need a multiple of 16"):
        linear(x, quant.quantize(np.zeros((8, 72), np.float32), "int8").to_device())
    with pytest.raises(ValueError, match="must be numpy for numpy x and cupy for cupy x"):
        linear(cp.zeros((2, 64), cp.float16), quant.quantize(np.zeros((8, 64), np.float32), "int8"))
    with pytest.raises(ValueError, match="x: data pointer must be 16-byte aligned"):
        linear(cp.zeros(2 * 64 + 1, cp.float16)[1:].reshape(2, 64), cp.zeros((8, 64), cp.float16))
