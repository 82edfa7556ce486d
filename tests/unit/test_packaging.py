"""The wheel ships every package: pyproject lists packages by hand (package-dir remaps defeat discovery)."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_directory_is_listed_in_pyproject():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, remaps = set(tool["packages"]), tool["package-dir"]
    on_disk = set()
    for name, folder in remaps.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            on_disk.add(".".join([name, *rel.parts]))
    missing = sorted(on_disk - listed)
    assert not missing, f"packages missing from pyproject.toml [tool.setuptools] packages: {missing}"
