"""Run the example notebooks without Jupyter and print the seconds each took.

    PYTHONPATH=. python examples/run_notebooks.py [NOTEBOOK ...]   (default: every examples/*.ipynb)

Each notebook's code cells run in order in one fresh namespace, from examples/ (as Jupyter
runs them), with matplotlib's non-interactive Agg backend: what a kernel does, minus rich
display. It needs only the package's own dependencies and matplotlib, so it also runs
where nbclient and ipykernel are not installed (the GPU machine); tests/test_notebooks.py
executes the notebooks through a real Jupyter kernel. Exits 1 if a cell raises.
"""
import json
import os
import sys
import time
import traceback
from pathlib import Path

import matplotlib

EXAMPLES = Path(__file__).resolve().parent


def run(path: Path) -> float:
    """Execute the code cells of one notebook; returns the seconds it took."""
    cells = json.loads(path.read_text())["cells"]
    namespace = {"__name__": "__main__"}
    t0 = time.perf_counter()
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{path.name} cell {i}", "exec"), namespace)  # noqa: S102 (the point)
    return time.perf_counter() - t0


def main(argv) -> int:
    matplotlib.use("Agg")
    paths = [Path(a).resolve() for a in argv] or sorted(EXAMPLES.glob("*.ipynb"))
    os.chdir(EXAMPLES)
    times, failed = {}, []
    for path in paths:
        print(f"=== {path.name}", flush=True)
        try:
            times[path.name] = run(path)
        except Exception:  # noqa: BLE001 (any failure of a notebook is reported, the rest still run)
            traceback.print_exc()
            failed.append(path.name)
    print("\nnotebook seconds:")
    for name, s in times.items():
        print(f"  {name:<32}{s:8.1f}")
    for name in failed:
        print(f"  {name:<32}  FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
