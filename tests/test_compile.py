"""Every registered instantiation compiles with NVRTC for sm_80 and sm_90 (and sm_90 with the
programmatic-dependent-launch build, -DCUINFER_PDL: the default on sm_90), no GPU needed."""
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from cuinfer import ops
from cuinfer.ops import runtime

pytest.importorskip("cupy")


@pytest.mark.parametrize("arch,pdl", [("sm_80", False), ("sm_90", False), ("sm_90", True)])
@pytest.mark.parametrize("family", ops.FAMILIES)
def test_family_compiles(family, arch, pdl):
    """The instantiations are split over one process per core (NVRTC compiles a program on one
    thread: paged_attention alone took ~110 s an arch on 2 cores)."""
    exprs = list(ops.family_module(family).INSTANTIATIONS)
    assert exprs, f"{family} registers no instantiations"
    n = min(len(exprs), os.cpu_count() or 1)
    chunks = [exprs[i::n] for i in range(n)]
    if n == 1:
        results = [runtime.compile_family(family, exprs, arch, pdl)]
    else:
        with ProcessPoolExecutor(n) as pool:
            results = list(pool.map(runtime.compile_family, [family] * n, chunks, [arch] * n, [pdl] * n))
    for chunk, compiled in zip(chunks, results):
        assert set(compiled.lowered) == set(chunk)
        assert len(compiled.cubin) > 0


def test_compile_error_names_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "broken.cu").write_text("template <int N> __global__ void broken_kernel() { int x = ; }\n")
    (tmp_path / "common.cuh").write_text("")
    monkeypatch.setattr(runtime, "source_dir", lambda: tmp_path)
    with pytest.raises(runtime.CompileError, match=r"broken\.cu\(1\)"):
        runtime.compile_family("broken", ["broken_kernel<1>"], "sm_90")
