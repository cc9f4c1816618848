"""runtime: compile options and the launch helpers' argument checks (no GPU needed)."""
import numpy as np
import pytest

from cuinfer.ops import runtime


def test_sm90_builds_for_the_arch_specific_target():
    assert "-arch=sm_90a" in runtime.compile_options("sm_90")  # wgmma, setmaxnreg
    assert "-arch=sm_80" in runtime.compile_options("sm_80")


@pytest.mark.parametrize("shape,dtype,box", [((8, 2, 64), np.float32, (8, 1, 64)),   # 32-bit elements
                                             ((8, 2, 128), np.float16, (8, 1, 128)),  # box row != 128 bytes
                                             ((8, 2, 64), np.float16, (8, 64))])      # box rank != array rank
def test_tensor_map_refuses_what_tma_cannot_copy(shape, dtype, box):
    with pytest.raises(ValueError, match="tensor_map"):
        runtime.tensor_map(np.zeros(shape, dtype), box)


def test_tensor_map_refuses_a_strided_view():
    with pytest.raises(ValueError, match="C-contiguous"):
        runtime.tensor_map(np.zeros((8, 2, 128), np.float16)[:, :, :64], (8, 1, 64))


@pytest.mark.parametrize("dtype,shape,strides,box", [
    (np.float32, (2, 8, 64), (128, 512, 4), (1, 8, 64)),   # 32-bit elements
    (np.float16, (2, 8, 64), (128, 256, 4), (1, 8, 64)),   # innermost stride not one element
    (np.float16, (2, 8, 64), (136, 256, 2), (1, 8, 64)),   # an outer stride not a multiple of 16
    (np.float16, (2, 8, 64), (128, 256, 2), (1, 8, 32)),   # box row != 128 bytes
    (np.float16, (2, 8, 64), (128, 256, 2), (8, 64))])     # box rank != view rank
def test_tensor_map_device_refuses_what_tma_cannot_copy(dtype, shape, strides, box):
    with pytest.raises(ValueError, match="tensor_map_device"):
        runtime.tensor_map_device(np.zeros(64, dtype), shape, strides, box)
