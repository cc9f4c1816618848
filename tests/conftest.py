import numpy as np
import pytest

from cuinfer.ops import runtime

# ------------------------------------------------------------------ tolerances
# |out - ref| <= atol + rtol * |ref|, per output dtype. The reference is float32
# (float64 where a test says so) computed from the same (already rounded) inputs.
TOLERANCES = {
    # fp32 kernels accumulate in a different order than numpy: a few ulp per
    # reduction step over rows up to ~64k long.
    np.dtype(np.float32): dict(atol=1e-5, rtol=1e-5),
    # fp16 output is rounded once from an fp32 result: half an ulp is 2^-11 relative
    # (4.9e-4); allow one ulp plus fp32 accumulation noise.
    np.dtype(np.float16): dict(atol=1e-3, rtol=1e-3),
}
if runtime.bfloat16 is not None:
    # bf16 has 8 mantissa bits: one ulp is 2^-7 = 7.8e-3 relative.
    TOLERANCES[runtime.bfloat16] = dict(atol=1e-2, rtol=8e-3)


def assert_close(out, ref, dtype=None, slack=None, **override):
    """Compare a kernel output with its reference using the table above. slack (an array
    broadcast against ref): the error the reference's own inputs carry into this output, added per
    element (see accumulation_error, tensor_core_error), never a wider table."""
    out = runtime.cupy_or_none().asnumpy(out) if runtime.is_device_array(out) else np.asarray(out)
    tol = dict(TOLERANCES[np.dtype(dtype or out.dtype)], **override)
    out32, ref32 = out.astype(np.float32), np.asarray(ref, dtype=np.float32)
    assert out32.shape == ref32.shape, (out32.shape, ref32.shape)
    assert not np.isnan(out32).any() or np.array_equal(np.isnan(out32), np.isnan(ref32)), "NaN in output"
    if slack is None:
        np.testing.assert_allclose(out32, ref32, **tol)
        return
    bound = tol["atol"] + tol["rtol"] * np.abs(ref32) + slack
    bad = ~(np.abs(out32 - ref32) <= bound)
    if bad.any():
        i = np.unravel_index(np.argmax(np.abs(out32 - ref32) - bound), out32.shape)
        raise AssertionError(f"{bad.sum()} / {bad.size} elements out of bound; worst at {i}: "
                             f"out {out32[i]}, ref {ref32[i]}, bound {bound[i]}")


def accumulation_error(x, w):
    """The expected rounding error of a float32 dot product x @ w.T over K terms: a random walk of
    K roundings of half an ulp each, sqrt(K) * 2^-24 * ||x * w||_2 per output (float64). A product of
    two such sums (an activation of gate times up) amplifies one sum's error by the other sum, which
    an output-relative tolerance does not cover where up cancels to near zero."""
    x, w = np.asarray(x, dtype=np.float64), np.asarray(w, dtype=np.float64)
    return np.sqrt(x.shape[-1]) * 2.0**-24 * np.sqrt(x**2 @ (w**2).T)


def tensor_core_error(x, w, step=16):
    """The rounding error of a tensor-core (mma / wgmma) dot product x @ w.T, per output (float64):
    each k16 instruction adds its products to the float32 accumulator truncating toward zero, so the
    error is biased and grows with the number of steps, not with their square root as
    accumulation_error's random walk does. Each step loses under one ulp of the running sum, and
    each product under one ulp of its own: 2^-23 (sum_j |P_j| + sum_k |x_k w_k|) over the exact
    partial sums P_j after each step (one chain over all of K; a split kernel's shorter chains lose
    less). On the H200, the int4 wgmma kernel at K = 4224, x of magnitude 30: three outputs whose up
    cancelled to 0.016, 0.064 and 0.032 were 1.8e-4, 2.7e-4 and 2.0e-4 off the exact sum, 1.6-2.2x
    accumulation_error and 0.8x what an emulation truncating once per k16 step gives."""
    x, w = np.asarray(x, dtype=np.float64), np.asarray(w, dtype=np.float64)
    running, total = np.zeros((x.shape[0], w.shape[0])), np.abs(x) @ np.abs(w).T
    for k0 in range(0, x.shape[-1], step):
        running += x[:, k0:k0 + step] @ w[:, k0:k0 + step].T
        total += np.abs(running)
    return 2.0**-23 * total


def _has_gpu():
    cp = runtime.cupy_or_none()
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA device found")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cp():
    """CuPy, for GPU tests (the test is marked gpu, so a device exists)."""
    import cupy

    return cupy


def poison(cp_module, shape, dtype):
    """An output buffer filled with NaN, so an element the kernel never writes fails the check."""
    out = cp_module.empty(shape, dtype=dtype)
    floating = np.dtype(dtype).kind == "f" or np.dtype(dtype) == runtime.bfloat16  # ml_dtypes bf16: kind 'V'
    out.fill(np.nan) if floating else out.fill(-1)
    return out
