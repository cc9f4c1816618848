"""Every registered instantiation compiles with NVRTC, no GPU needed, in the two builds the runtime
makes: sm_80, and sm_90 with the programmatic-dependent-launch waits and triggers (-DCUINFER_PDL, what
`runtime.kernel` compiles on sm_90). The fp8-cache decode attention instantiations: a covering set of
them (`compile_set`).

sm_90 without CUINFER_PDL (CUINFER_PDL=0) differs from the PDL build only in the bodies of
`pdl_wait` and `pdl_trigger` (common.cuh, the macro's only use), so each kernel template is compiled
that way once (`test_kernel_compiles_without_pdl`), not each instantiation: every instantiation
again took a third of this file's time for nothing the PDL build does not check.

A family's instantiations are compiled in programs of at most PROGRAM, one process per core, and a
test is one round of such programs, so that pytest shows progress through the long families."""
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from cuinfer import ops
from cuinfer.ops import build, runtime

pytest.importorskip("cupy")

PROGRAM = 32  # instantiations an NVRTC program compiles at most
CORES = os.cpu_count() or 1


def compile_set(family) -> list:
    """The family's INSTANTIATIONS, but of paged_attention's over an fp8 cache one per (dtype, head dim,
    group, fused) only, and of its tensor-core loops over a float cache one per (dtype, head dim, group,
    fused) only, the other arguments taken in turn from each list: every value of each template
    argument among them (580 of 1,216). The fp8 ones differ from the float cache's only in KvChunk's
    type, the tensor-core ones across warps only in their loop stride and launch bounds, and at ~0.9 s
    an instantiation on 2 cores all of them would add ~9 minutes an arch; test_paged_attention's GPU
    tests launch every warps and rows-in-flight pair, and the tensor-core loops at every width, over
    float and fp8 caches."""
    exprs = list(ops.family_module(family).INSTANTIATIONS)
    if family != "paged_attention":
        return exprs
    groups, kept = {}, []
    for e in exprs:
        t, c, d, g, _, _, fused, mma = e.split("<")[1].rstrip(">").split(", ")
        if c == "__nv_fp8_e4m3" or mma == "true":
            kind = "fp8" if c == "__nv_fp8_e4m3" else "mma"
            groups.setdefault((t, kind, d, g, fused), []).append(e)
        else:
            kept.append(e)
    return kept + [group[i % len(group)] for i, group in enumerate(groups.values())]


def rounds(family) -> list:
    """compile_set(family) as rounds of up to CORES programs of up to PROGRAM instantiations each.
    NVRTC compiles a program on one thread, in a time that grows faster than its instantiations
    (paged_attention for sm_80, 2 cores: 60 took 36 s, 120 took 232 s); the programs are strided
    over the set, so each mixes the family's kernels alike."""
    exprs = compile_set(family)
    n = -(-len(exprs) // PROGRAM)
    programs = [exprs[i::n] for i in range(n)]
    return [programs[i:i + CORES] for i in range(0, n, CORES)]


def kernel_templates(family) -> list:
    """One instantiation of each kernel template the family registers (the name before '<')."""
    first = {}
    for e in ops.family_module(family).INSTANTIATIONS:
        first.setdefault(e.split("<")[0], e)
    return list(first.values())


@pytest.fixture(scope="module")
def pool():
    with ProcessPoolExecutor(CORES) as p:
        yield p


CASES = [pytest.param(family, i, id=f"{family}-{i + 1}of{len(rounds(family))}")
         for family in ops.FAMILIES for i in range(len(rounds(family)))]


@pytest.mark.parametrize("arch,pdl", [("sm_80", False), ("sm_90", True)])
@pytest.mark.parametrize("family,round_", CASES)
def test_family_compiles(family, round_, arch, pdl, pool):
    programs = rounds(family)[round_]
    k = len(programs)
    results = pool.map(build.compile_family, [family] * k, programs, [arch] * k, [pdl] * k)
    for program, compiled in zip(programs, results):
        assert set(compiled.lowered) == set(program)
        assert len(compiled.cubin) > 0


@pytest.mark.parametrize("family", ops.FAMILIES)
def test_kernel_compiles_without_pdl(family):
    exprs = kernel_templates(family)
    assert exprs, f"{family} registers no instantiations"
    compiled = build.compile_family(family, exprs, "sm_90", False)
    assert set(compiled.lowered) == set(exprs) and len(compiled.cubin) > 0


def test_pdl_is_the_only_difference():
    """The claim test_kernel_compiles_without_pdl rests on: no source but common.cuh's PDL helpers
    reads CUINFER_PDL."""
    users = [p.name for p in sorted(build.source_dir().iterdir()) if "CUINFER_PDL" in p.read_text()]
    assert users == ["common.cuh"], users
    common = (build.source_dir() / "common.cuh").read_text()
    assert common.count("defined(CUINFER_PDL)") == 2, "CUINFER_PDL guards more than pdl_wait and pdl_trigger"


def test_compile_error_names_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "broken.cu").write_text("template <int N> __global__ void broken_kernel() { int x = ; }\n")
    (tmp_path / "common.cuh").write_text("")
    monkeypatch.setattr(build, "source_dir", lambda: tmp_path)
    with pytest.raises(runtime.CompileError, match=r"broken\.cu\(1\)"):
        build.compile_family("broken", ["broken_kernel<1>"], "sm_90")


def test_compile_set_covers_every_argument():
    """Among the fp8 decode instantiations compiled, every value each template argument takes in the
    registered ones."""
    def arguments(exprs):
        return [set(a) for a in zip(*(e.split("<")[1].rstrip(">").split(", ") for e in exprs if "fp8" in e))]

    registered = list(ops.family_module("paged_attention").INSTANTIATIONS)
    assert arguments(compile_set("paged_attention")) == arguments(registered)


def test_rounds_cover_the_compile_set():
    for family in ops.FAMILIES:
        compiled = [e for programs in rounds(family) for program in programs for e in program]
        assert sorted(compiled) == sorted(compile_set(family)), family
        assert all(len(p) <= PROGRAM for programs in rounds(family) for p in programs)
