"""The fp8 KV cache's codec (cuinfer.ops.fp8): E4M3 against an independent decoder and torch's conversion."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from cuinfer.ops import fp8, runtime


def e4m3_by_formula(code: int) -> float:
    """The value of one code from the OCP spec: (-1)^s 2^(e - 7) (1 + m / 8), subnormal 2^-6 m / 8, 0x7f NaN."""
    s, e, m = code >> 7, (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return float("nan")
    mag = 2.0 ** -6 * m / 8 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8)
    return -mag if s else mag


def test_decode_every_code():
    want = np.array([e4m3_by_formula(c) for c in range(256)])
    got = fp8.decode_e4m3(np.arange(256, dtype=np.uint8))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(got)], want[~np.isnan(want)])
    assert np.nanmax(got) == fp8.MAX == 448.0


def test_encode_round_trips_every_finite_code():
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
    for dtype in (np.float32, np.float16, runtime.bfloat16):
        np.testing.assert_array_equal(fp8.encode_e4m3(fp8.decode_e4m3(codes).astype(dtype)), codes)


def test_encode_rounds_to_nearest_even_and_saturates():
    v = fp8.decode_e4m3(np.arange(0x7F, dtype=np.uint8)).astype(np.float64)
    mid = (v[:-1] + v[1:]) / 2  # ties between neighbours: the even code wins
    want = np.where(np.arange(1, 0x7F) % 2 == 0, np.arange(1, 0x7F), np.arange(0x7E))
    np.testing.assert_array_equal(fp8.encode_e4m3(mid), want)
    np.testing.assert_array_equal(fp8.encode_e4m3(-mid), want | 0x80)
    np.testing.assert_array_equal(fp8.encode_e4m3(np.nextafter(mid, 0)), np.arange(0x7E))
    np.testing.assert_array_equal(fp8.encode_e4m3([448.0, 460.0, 1e30, np.inf, -np.inf, np.nan, -0.0, 1e-30]),
                                  [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x80, 0x00])


@settings(max_examples=50, deadline=None)
@given(x=arrays(np.float32, st.integers(1, 64), elements=st.floats(-1000, 1000, width=32)))
def test_encode_matches_torch(x):
    """torch's float8_e4m3fn conversion (round to nearest even) on values clipped to +-448 (torch gives NaN past it,
    the kernels saturate)."""
    torch = pytest.importorskip("torch")
    want = torch.from_numpy(np.clip(x, -448, 448)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(fp8.encode_e4m3(x), want)


def test_store_rounds_to_the_model_dtype_first():
    x = np.array([1.0 + 2.0 ** -4 + 2.0 ** -12], np.float32)  # above a tie in float32, on it in float16
    assert fp8.encode_e4m3(x)[0] == 0x39  # 1.125: the nearer code
    assert fp8.store(x, fp8.FP8, np.float16)[0] == 0x38  # 1.0625 in float16: a tie, the even code 1.0
    np.testing.assert_array_equal(fp8.store(x, np.float16, np.float16), x.astype(np.float16))


def test_kv_cache_dtype_names():
    assert fp8.parse_kv_cache_dtype("auto", np.float16) == np.float16
    assert fp8.parse_kv_cache_dtype("fp8", np.float16) == fp8.FP8 == fp8.parse_kv_cache_dtype("fp8_e4m3", np.float32)
    with pytest.raises(ValueError, match="kv cache dtype: got 'fp8_e5m2'"):
        fp8.parse_kv_cache_dtype("fp8_e5m2", np.float16)
    assert fp8.cache_ctype(fp8.FP8, np.float16) == "__nv_fp8_e4m3"
    assert fp8.cache_ctype(np.float16, np.float16) == "__half"
    with pytest.raises(ValueError, match="k_cache: got dtype float32"):
        fp8.cache_ctype(np.float32, np.float16)
