"""The wheel lists its packages explicitly (the kernel sources are mapped in from kernels/); keep it complete."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "sparse_llm").rglob("__init__.py")}
    assert on_disk <= listed, f"add {sorted(on_disk - listed)} to [tool.setuptools] packages in pyproject.toml"
    assert config["package-dir"]["sparse_llm._kernels"] == "kernels"
    assert any((ROOT / "kernels").glob("*.cu"))
