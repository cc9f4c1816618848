"""runtime, build and driver: compile options, the disk cache and the launch helpers' argument checks
(no GPU needed)."""
import numpy as np
import pytest

from cuinfer.ops import build, driver, runtime


def test_sm90_builds_for_the_arch_specific_target():
    assert "-arch=sm_90a" in build.compile_options("sm_90")  # wgmma, setmaxnreg
    assert "-arch=sm_80" in build.compile_options("sm_80")


def test_a_measurement_build_is_its_own_cache_entry_and_program():
    """defines set macros to 1 and key the disk cache apart; linear_mma's CUINFER_TIMELINE build has its
    stamps array, the plain build has none."""
    import importlib

    pytest.importorskip("cupy")  # NVRTC

    lm = importlib.import_module("cuinfer.ops.linear_mma")
    assert build.compile_options("sm_90", True, ("CUINFER_TIMELINE",))[-1] == "-DCUINFER_TIMELINE=1"
    assert build.compile_options("sm_90", True, ()) == build.compile_options("sm_90", True)
    expr = lm.wgmma_instantiation(np.float16, 8, 0, lm.WgTile(32, 8, 6, 2))
    plain = build.cache_paths("linear_mma", expr, "sm_90", True)
    assert build.cache_paths("linear_mma", expr, "sm_90", True, ()) == plain
    assert build.cache_paths("linear_mma", expr, "sm_90", True, ("CUINFER_TIMELINE",))[0] != plain[0]
    for defines, has in (((), False), (("CUINFER_TIMELINE",), True)):
        cubin = build.compile_family("linear_mma", [expr], "sm_90", True, defines).cubin
        assert (b"linear_timeline" in cubin) == has


@pytest.mark.parametrize("shape,dtype,box", [((8, 2, 64), np.float32, (8, 1, 64)),   # 32-bit elements
                                             ((8, 2, 128), np.float16, (8, 1, 128)),  # box row != 128 bytes
                                             ((8, 2, 64), np.float16, (8, 64))])      # box rank != array rank
def test_tensor_map_refuses_what_tma_cannot_copy(shape, dtype, box):
    with pytest.raises(ValueError, match="tensor_map"):
        driver.tensor_map(np.zeros(shape, dtype), box)


def test_tensor_map_refuses_a_strided_view():
    with pytest.raises(ValueError, match="C-contiguous"):
        driver.tensor_map(np.zeros((8, 2, 128), np.float16)[:, :, :64], (8, 1, 64))


@pytest.mark.parametrize("dtype,shape,strides,box", [
    (np.float32, (2, 8, 64), (128, 512, 4), (1, 8, 64)),   # 32-bit elements
    (np.float16, (2, 8, 64), (128, 256, 4), (1, 8, 64)),   # innermost stride not one element
    (np.float16, (2, 8, 64), (136, 256, 2), (1, 8, 64)),   # an outer stride not a multiple of 16
    (np.float16, (2, 8, 64), (128, 256, 2), (1, 8, 32)),   # box row != 128 bytes
    (np.float16, (2, 8, 64), (128, 256, 2), (8, 64))])     # box rank != view rank
def test_tensor_map_device_refuses_what_tma_cannot_copy(dtype, shape, strides, box):
    with pytest.raises(ValueError, match="tensor_map_device"):
        driver.tensor_map_device(np.zeros(64, dtype), shape, strides, box)


def test_precompile_fills_the_cache_kernel_reads(tmp_path, monkeypatch):
    """precompile compiles what the disk cache lacks, in spawned NVRTC processes, under the keys
    kernel() looks up (cached_cubin), and nothing the second time."""
    pytest.importorskip("cupy")
    from cuinfer import ops

    monkeypatch.setenv("CUINFER_CACHE", str(tmp_path))
    exprs = list(ops.family_module("rope").INSTANTIATIONS)[:3]
    pairs = [("rope", e) for e in exprs] + [("rope", exprs[0])]  # a repeat is compiled once
    assert runtime.precompile(pairs, "sm_90", True, workers=2) == 3
    assert len(list((tmp_path / "kernels").glob("rope-*.cubin"))) == 3
    assert runtime.precompile(pairs, "sm_90", True, workers=2) == 0
    assert runtime.precompile(pairs[:1], "sm_80", False) == 1  # another build, other keys
    for e in exprs:
        path, lowered = build.cached_cubin("rope", e, "sm_90", True)
        assert path.parent == tmp_path / "kernels" and path.stat().st_size > 0
        assert lowered == build.compile_family("rope", [e], "sm_90", True).lowered[e]
