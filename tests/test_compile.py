"""Every registered instantiation compiles with NVRTC for sm_80 and sm_90 (and sm_90 with the
programmatic-dependent-launch build, -DCUINFER_PDL: the default on sm_90), no GPU needed; the fp8-cache
decode attention instantiations, a covering set of them (`compile_set`)."""
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from cuinfer import ops
from cuinfer.ops import runtime

pytest.importorskip("cupy")

PROGRAM = 32  # instantiations an NVRTC program compiles at most


def compile_set(family) -> list:
    """The family's INSTANTIATIONS, but of paged_attention's over an fp8 cache one per (dtype, head dim,
    group, fused) only, its rows in flight and warps taken in turn from the group's list: 80 of 452,
    every value of each template argument among them. They differ from the float cache's (all compiled)
    only in KvChunk's type, and all 452 took ~6 more minutes an arch on 2 cores (~0.9 s each);
    test_paged_attention's GPU tests launch every warps and rows-in-flight pair over an fp8 cache."""
    exprs = list(ops.family_module(family).INSTANTIATIONS)
    if family != "paged_attention":
        return exprs
    groups = {}
    for e in exprs:
        if "__nv_fp8_e4m3" in e:
            t, _, d, g, _, _, fused = e.split("<")[1].rstrip(">").split(", ")
            groups.setdefault((t, d, g, fused), []).append(e)
    thinned = [group[i % len(group)] for i, group in enumerate(groups.values())]
    return [e for e in exprs if "__nv_fp8_e4m3" not in e] + thinned


@pytest.mark.parametrize("arch,pdl", [("sm_80", False), ("sm_90", False), ("sm_90", True)])
@pytest.mark.parametrize("family", ops.FAMILIES)
def test_family_compiles(family, arch, pdl):
    """The instantiations are compiled in programs of at most PROGRAM of them, spread over one
    process per core: NVRTC compiles a program on one thread, in a time that grows faster than its
    instantiations (paged_attention for sm_80, 2 cores: 60 took 36 s, 120 took 232 s)."""
    exprs = compile_set(family)
    assert exprs, f"{family} registers no instantiations"
    chunks = [exprs[i::-(-len(exprs) // PROGRAM)] for i in range(-(-len(exprs) // PROGRAM))]
    n = min(len(chunks), os.cpu_count() or 1)
    if n == 1:
        results = [runtime.compile_family(family, chunk, arch, pdl) for chunk in chunks]
    else:
        with ProcessPoolExecutor(n) as pool:
            k = len(chunks)
            results = list(pool.map(runtime.compile_family, [family] * k, chunks, [arch] * k, [pdl] * k))
    for chunk, compiled in zip(chunks, results):
        assert set(compiled.lowered) == set(chunk)
        assert len(compiled.cubin) > 0


def test_compile_error_names_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "broken.cu").write_text("template <int N> __global__ void broken_kernel() { int x = ; }\n")
    (tmp_path / "common.cuh").write_text("")
    monkeypatch.setattr(runtime, "source_dir", lambda: tmp_path)
    with pytest.raises(runtime.CompileError, match=r"broken\.cu\(1\)"):
        runtime.compile_family("broken", ["broken_kernel<1>"], "sm_90")


def test_compile_set_covers_every_argument():
    """Among the fp8 decode instantiations compiled, every value each template argument takes in the
    registered ones."""
    def arguments(exprs):
        return [set(a) for a in zip(*(e.split("<")[1].rstrip(">").split(", ") for e in exprs if "fp8" in e))]

    registered = list(ops.family_module("paged_attention").INSTANTIATIONS)
    assert arguments(compile_set("paged_attention")) == arguments(registered)
