"""What the README and the example config promise matches what the code and CI do."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from shardfs.cli.config import OPTIONS, load_file

ROOT = Path(__file__).resolve().parent.parent


def test_example_config_documents_every_key_and_loads():
    path = ROOT / "examples" / "shardfs.yaml"
    text = path.read_text()
    missing = [key for key in OPTIONS if not re.search(rf"^#? ?{key}:", text, re.MULTILINE)]
    assert not missing, f"examples/shardfs.yaml does not mention {missing}"
    for scheme in ("https://", "s3://", "ais://", "/"):
        assert f"- {scheme}" in text or f"# - {scheme}" in text
    assert load_file(path)["max_member_fetches"] == 32


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line for line in ci.splitlines() if line and not line.startswith("#")]
    assert commands[-1] == "python -m pytest"
    assert "python -m pytest      # the test suite" in readme
    assert "ruff check ." in commands and "ruff check ." in readme
    apt = re.search(r"APT_PACKAGES=\(([^)]*)\)", ci).group(1).split()
    line = next(li for li in readme.splitlines() if li.startswith("apt-get install -y "))
    assert line.split()[3:] == apt
    assert "sudo apt-get" not in readme


def test_torch_extra_takes_ranges():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["torch"]
    assert extra and not any("==" in req for req in extra), extra
    assert "download.pytorch.org/whl/cpu" in (ROOT / "README.md").read_text()
