"""pyproject.toml installs every subpackage of cuinfer (an editable install would hide a missing one)."""
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_installed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "cuinfer").rglob("__init__.py")}
    assert found - listed == set()
