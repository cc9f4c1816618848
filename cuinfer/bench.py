"""Benchmarks: python -m cuinfer.bench SUITE [--json PATH] [suite options].

Suites live in cuinfer/benches/<suite>.py and define `add_arguments(parser)` and
`run(args) -> list[dict]` (and `runs_without_gpu(args)` where some runs need none: without it a
suite needs a CUDA GPU, and a machine without one gets one line); each row carries at least `name` and `ms`, and where
they apply `bytes`, `flops`, `gbs`, `tflops`, `pct_copy` and `peer_ms`. This
module holds what they share: CUDA-event timing (median after warm-up), the
device-to-device copy ceiling measured in the same run, the optional torch peer,
the printed table and the JSON file that examples/05_roofline.ipynb reads.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import json
import os
import subprocess
import sys

from .ops import runtime

SUITES = ("kernels", "attention", "linear", "decode", "mixed", "gaps", "serve", "spec", "hopper")


def time_ms(fn, warmup: int = 10, iters: int = 50) -> float:
    """Median milliseconds of fn() on the current stream, timed with CUDA events after warm-up."""
    cp = runtime.require_cupy()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    times.sort()
    return times[len(times) // 2]


@functools.cache
def copy_gbs(nbytes: int = 1 << 30, rounds: int = 5) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written: the best of
    `rounds` timings, measured once a process (one timing varied by 20 % between runs, and every
    row's % of copy and roofline divide by it)."""
    cp = runtime.require_cupy()
    src = cp.random.random(nbytes // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    ms = min(time_ms(lambda: cp.copyto(dst, src), warmup=3, iters=20) for _ in range(rounds))
    del src, dst
    return 2 * nbytes / ms / 1e6


def torch_or_none():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def finish_row(row: dict) -> dict:
    """Add GB/s, % of copy bandwidth, TFLOP/s and the peer ratio where the row has their inputs."""
    ms = row["ms"]
    if row.get("bytes"):
        row["gbs"] = row["bytes"] / ms / 1e6
        row["pct_copy"] = 100 * row["gbs"] / copy_gbs()
    if row.get("flops"):
        row["tflops"] = row["flops"] / ms / 1e9
    if row.get("peer_ms"):
        row["speedup"] = row["peer_ms"] / ms
    return row


COLUMNS = ("name", "shape", "dtype", "ms", "gbs", "pct_copy", "tflops", "peer", "peer_ms", "speedup")


def format_table(rows) -> str:
    cols = [c for c in COLUMNS if any(c in r for r in rows)]

    def cell(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def header() -> dict:
    """Date, commit, device and copy bandwidth of a run. The commit is CUINFER_COMMIT when set (a
    copy of the tree run on another machine, whose .git may be stale or absent), else git's."""
    commit = os.environ.get("CUINFER_COMMIT")
    try:
        # "-dirty" when the working tree differs from HEAD
        commit = commit or subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                                          text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    if runtime.pick_device() == "cpu":  # a suite that needs no GPU (bench serve --http)
        return {"date": datetime.date.today().isoformat(), "commit": commit, "device": "no GPU", "copy_gbs": 0.0}
    info = runtime.device_info()
    return {"date": datetime.date.today().isoformat(), "commit": commit, "device": info["name"],
            "copy_gbs": copy_gbs()}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m cuinfer.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="suite", required=True)
    modules = {}
    for name in SUITES:
        try:
            modules[name] = importlib.import_module(f"cuinfer.benches.{name}")
        except ModuleNotFoundError:
            continue
        p = sub.add_parser(name, help=modules[name].__doc__.splitlines()[0])
        p.add_argument("--json", help="also write the rows and the header to this JSON file")
        modules[name].add_arguments(p)
    args = parser.parse_args(argv)
    module = modules[args.suite]
    try:
        if not getattr(module, "runs_without_gpu", lambda _: False)(args):
            runtime.pick_device("gpu")
    except runtime.NoDeviceError:
        print(f"error: python -m cuinfer.bench {args.suite} needs a CUDA GPU, and none was found", file=sys.stderr)
        return 2
    try:
        head = header()
        rows = [finish_row(r) for r in module.run(args)]
    except runtime.CuinferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"# {args.suite} · {head['date']} · commit {head['commit']} · {head['device']} · "
          f"copy {head['copy_gbs']:.0f} GB/s")
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"suite": args.suite, **head, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    # run in the package's module, which the suites import too: one copy_gbs cache, one measurement
    from cuinfer import bench

    sys.exit(bench.main())
