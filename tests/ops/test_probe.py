"""probe: the bulk-copy stream lands every word it reads (a checksum against NumPy's), and every wgmma
of the issue-rate probe adds its products."""
import numpy as np
import pytest

from cuinfer.ops import probe, runtime


def stream_case(rng, grid, stages, shape, x_wrap):
    _, wb, xb = shape
    w = rng.integers(0, 256, grid * stages * wb + 64, dtype=np.uint8)
    x = rng.integers(0, 256, max(x_wrap, 16), dtype=np.uint8)
    return w, x


def test_stream_reference_sums_words():
    rng = np.random.default_rng(0)
    shape, grid, stages, wrap = (4, 8192, 32768), 3, 5, 65536
    w, x = stream_case(rng, grid, stages, shape, wrap)
    want = int(w[:grid * stages * 8192].view(np.uint32).sum(dtype=np.uint64))
    want += sum(grid * int(x[i * 32768 % wrap:][:32768].view(np.uint32).sum(dtype=np.uint64)) for i in range(stages))
    assert int(probe.stream_probe(w, x, grid, stages, shape, wrap)[0]) == want % (1 << 64)
    first = w[:grid * stages * 8192].reshape(-1, 8192)[:, :16].copy()
    assert int(probe.stream_probe(w, x, grid, stages, shape, wrap, checksum=False)[0]) == int(
        first.view(np.uint32).sum(dtype=np.uint64))


def test_stream_int8_layouts_reference_reads_each_blocks_rows():
    """box and tiles: the same bytes land (the same checksum), and each slot starts with the first of
    its block's 128 rows at the stage's 128 bytes, wherever the layout keeps them."""
    rng = np.random.default_rng(2)
    shape, grid, stages, wrap = probe.INT8_SHAPES[0], 3, 5, 16384
    w, x = stream_case(rng, grid, stages, shape, wrap)
    weight = w[:grid * stages * 16384]
    rows = weight.reshape(128 * grid, 128 * stages)  # box: [N, K] row-major
    tiles = weight.reshape(8 * grid, stages, 16, 128)  # tiles: tile (t, i) of 16 rows x 128 k
    firsts = {"box": lambda b, i: rows[128 * b, 128 * i:], "tiles": lambda b, i: tiles[8 * b, i, 0]}
    for layout, first_row in firsts.items():
        assert probe.stream_probe(w, x, grid, stages, shape, wrap, layout=layout) == probe.stream_probe(
            w, x, grid, stages, shape, wrap)
        first = sum(int(first_row(b, i)[:16].view(np.uint32).sum(dtype=np.uint64))
                    for b in range(grid) for i in range(stages))
        assert int(probe.stream_probe(w, x, grid, stages, shape, wrap, checksum=False, layout=layout)[0]) == first


@pytest.mark.parametrize("bad", [dict(shape=(3, 8192, 0)), dict(grid=0), dict(x_wrap=40000),
                                 dict(w=np.zeros(10, np.uint8)), dict(layout="box"), dict(layout="tile")])
def test_stream_rejects(bad):
    rng = np.random.default_rng(1)
    args = dict(grid=2, stages=2, shape=(4, 8192, 32768), x_wrap=65536)
    args["w"], args["x"] = stream_case(rng, 2, 2, args["shape"], 65536)
    args.update(bad)
    with pytest.raises(ValueError):
        probe.stream_probe(**args)


def test_wgmma_rejects_unknown_shape():
    with pytest.raises(ValueError, match="WGMMA_SHAPES"):
        probe.wgmma_probe(96, 2, True, 0, 10, 4)


def sm90():
    if runtime.device_info()["arch"] != "sm_90":
        pytest.skip("the probes need sm_90")


@pytest.mark.gpu
@pytest.mark.parametrize("checksum", [True, False])
@pytest.mark.parametrize("shape", probe.STREAM_SHAPES, ids=str)
def test_stream_lands_every_word(shape, checksum):
    import cupy as cp

    sm90()
    rng = np.random.default_rng(abs(hash(shape)) % (1 << 32))
    grid, stages, wrap = 7, 11, 2 * max(shape[2], 16)
    w, x = stream_case(rng, grid, stages, shape, wrap)
    want = probe.stream_probe_reference(w, x, grid, stages, shape, wrap, checksum)
    got = probe.stream_probe(cp.asarray(w), cp.asarray(x), grid, stages, shape, wrap, checksum=checksum)
    np.testing.assert_array_equal(cp.asnumpy(got), want)


@pytest.mark.gpu
@pytest.mark.parametrize("checksum", [True, False])
@pytest.mark.parametrize("layout", probe.LAYOUTS[1:])
@pytest.mark.parametrize("shape", probe.INT8_SHAPES, ids=str)
def test_stream_int8_layouts_land_every_word(shape, layout, checksum):
    import cupy as cp

    sm90()
    rng = np.random.default_rng(3)
    grid, stages, wrap = 7, 11, 2 * shape[2]
    w, x = stream_case(rng, grid, stages, shape, wrap)
    want = probe.stream_probe_reference(w, x, grid, stages, shape, wrap, checksum, layout)
    got = probe.stream_probe(cp.asarray(w), cp.asarray(x), grid, stages, shape, wrap, checksum=checksum, layout=layout)
    np.testing.assert_array_equal(cp.asnumpy(got), want)


@pytest.mark.gpu
@pytest.mark.parametrize("nx,wgs,regs,wait", probe.WGMMA_SHAPES, ids=str)
def test_wgmma_probe_adds_every_product(nx, wgs, regs, wait):
    import cupy as cp

    sm90()
    cycles, acc = probe.wgmma_probe(nx, wgs, regs, wait, 37, 5)
    np.testing.assert_array_equal(cp.asnumpy(acc), np.full(5, 128.0 * 37, np.float32))
    assert (cp.asnumpy(cycles) > 0).all()
