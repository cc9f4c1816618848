"""Kernel builds: cuda_src/<family>.cu compiled with NVRTC, the cubins kept in a disk cache. No GPU needed.

    compile_family(family, exprs, arch) -> Compiled(cubin, lowered names)

builds every template instantiation in `exprs` (strings such as "rms_norm_kernel<__half, 8>") in one
NVRTC program for `arch` ("sm_90"): it needs only NVRTC and the CUDA headers. `cached_cubin` keeps one
instantiation's cubin in the disk cache (CUINFER_CACHE, else ~/.cache/cuinfer), keyed by the source
hash, the instantiation, the arch, the NVRTC version and the options; `runtime.kernel` loads it for the
current device and `runtime.precompile` fills the cache in parallel.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import CompileError, CuinferError


def source_dir() -> Path:
    here = Path(__file__).resolve().parent.parent  # the package: cuinfer/cuda_src when installed
    for d in (here.parent / "cuda_src", here / "cuda_src"):
        if d.is_dir():
            return d
    raise CuinferError(f"cuda_src/ not found next to {here}: reinstall cuinfer")


def cuda_include_dir() -> str:
    """Directory that holds cuda_fp16.h (pip wheel, CUDA_PATH or /usr/local/cuda)."""
    candidates = []
    try:
        from cuda import pathfinder

        candidates.append(pathfinder.find_nvidia_header_directory("cudart"))
    except Exception:
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            candidates.append(os.path.join(os.environ[env], "include"))
    candidates.append("/usr/local/cuda/include")
    for c in candidates:
        if c and os.path.exists(os.path.join(c, "cuda_fp16.h")):
            return c
    raise CompileError(
        "the CUDA headers (cuda_fp16.h) were not found: pip install nvidia-cuda-runtime-cu12 "
        "(or -cu13), or set CUDA_PATH to a CUDA toolkit"
    )


@dataclass(frozen=True)
class Compiled:
    cubin: bytes
    lowered: dict  # instantiation string -> mangled name


def _nvrtc():
    from .runtime import require_cupy  # runtime imports this module

    require_cupy()
    from cupy.cuda import nvrtc

    return nvrtc


def nvrtc_version() -> tuple:
    return tuple(_nvrtc().getVersion())


def compile_options(arch: str, pdl: bool = False, defines: tuple = ()) -> list:
    """NVRTC options; pdl compiles the programmatic-dependent-launch waits and triggers in
    (CUINFER_PDL in common.cuh), for kernels that `launch` starts with the PDL attribute; defines:
    macros set to 1 (a family's measurement builds, e.g. linear_mma.cu's CUINFER_TIMELINE).
    sm_90 builds for sm_90a, Hopper's arch-specific target (wgmma; a cubin that runs on every
    compute capability 9.0 device)."""
    target = "sm_90a" if arch == "sm_90" else arch
    return ["-std=c++17", f"-arch={target}", "-lineinfo", f"-I{source_dir()}",
            f"-I{cuda_include_dir()}"] + (["-DCUINFER_PDL=1"] if pdl else []) + [f"-D{d}=1" for d in defines]


def source_hash(family: str) -> str:
    h = hashlib.sha256()
    for f in sorted(source_dir().glob("*.cuh")) + [source_dir() / f"{family}.cu"]:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def compile_family(family: str, exprs, arch: str, pdl: bool = False, defines: tuple = ()) -> Compiled:
    """Compile the instantiations `exprs` of cuda_src/<family>.cu for `arch` (e.g. "sm_90")."""
    nvrtc = _nvrtc()
    path = source_dir() / f"{family}.cu"
    if not path.exists():
        raise CompileError(f"no kernel family {family!r}: {path} does not exist")
    prog = nvrtc.createProgram(path.read_text(), str(path), [], [])
    try:
        for e in exprs:
            nvrtc.addNameExpression(prog, e)
        try:
            nvrtc.compileProgram(prog, compile_options(arch, pdl, defines))
        except nvrtc.NVRTCError as err:
            log = nvrtc.getProgramLog(prog)
            raise CompileError(f"NVRTC failed on {family} for {arch} ({err}):\n{log}") from None
        lowered = {e: nvrtc.getLoweredName(prog, e) for e in exprs}
        return Compiled(bytes(nvrtc.getCUBIN(prog)), lowered)
    finally:
        nvrtc.destroyProgram(prog)


def cache_dir() -> Path:
    base = os.environ.get("CUINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "cuinfer")
    return Path(base) / "kernels"


def cached_cubin(family: str, expr: str, arch: str, pdl: bool, defines: tuple = ()) -> tuple:
    """(cubin path, lowered name) of `expr` in the disk cache for (arch, pdl, defines), compiled and
    stored first if missing. The key: the source hash, the instantiation, the arch, the NVRTC version
    and the options. No GPU needed."""
    cubin_path, meta_path = cache_paths(family, expr, arch, pdl, defines)
    if not (cubin_path.exists() and meta_path.exists()):
        compiled = compile_family(family, [expr], arch, pdl, defines)
        cubin_path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(cubin_path, compiled.cubin)
        _atomic_write(meta_path, json.dumps(compiled.lowered).encode())
    return cubin_path, json.loads(meta_path.read_text())[expr]


def cache_paths(family: str, expr: str, arch: str, pdl: bool, defines: tuple = ()) -> tuple:
    """(cubin, lowered-name json) paths of the instantiation's entry in the disk cache."""
    key = hashlib.sha256(
        f"{source_hash(family)}|{expr}|{arch}|{nvrtc_version()}|{compile_options(arch, pdl, defines)}".encode()
    ).hexdigest()[:24]
    return cache_dir() / f"{family}-{key}.cubin", cache_dir() / f"{family}-{key}.json"


def _atomic_write(path: Path, data: bytes):
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
