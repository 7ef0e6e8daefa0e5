"""What the README and the example config promise matches what the code and CI do."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

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


def makefile_variable(name: str) -> str:
    text = (ROOT / "Makefile").read_text()
    return re.search(rf"^{name} := (.*)$", text, re.MULTILINE).group(1).strip()


def makefile_recipe(target: str) -> str:
    text = (ROOT / "Makefile").read_text()
    return re.search(rf"^{target}:.*\n((?:\t.*\n)+)", text, re.MULTILINE).group(1)


def test_ci_runs_the_readme_commands():
    """README's two commands are the Makefile's; CI runs the very same `make test`."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line for line in ci.splitlines() if line and not line.startswith("#")]
    assert commands[-2:] == ["make lint", "make test"]
    top = readme.split("## Set up, the long way")[0]
    assert "make demo  " in top and "make test  " in top
    assert "shardfs demo" in makefile_recipe("demo")
    assert "python -m pytest" in makefile_recipe("test")
    assert "ruff check ." in makefile_recipe("lint") and "ruff check ." in readme
    assert "python -m pytest      # the test suite" in readme
    # The long form names what the Makefile installs.
    line = next(li for li in readme.splitlines() if li.startswith("apt-get install -y "))
    assert line.split()[3:] == makefile_variable("APT_PACKAGES").split()
    assert "sudo apt-get" not in readme
    assert f"pip install -e '.[{makefile_variable('EXTRAS')}]'" in readme
    pins = makefile_variable("PIP_PINS").split()
    assert pins and all(pin in readme for pin in pins), pins


@pytest.mark.skipif(Path(sys.prefix).resolve() != (ROOT / ".venv").resolve()
                    or not (ROOT / ".venv" / ".shardfs-installed").exists(),
                    reason="runs where `make test` runs it: from the .venv the Makefile made "
                    "(a .venv made by hand, the README's long form, has no stamp)")
def test_make_setup_does_nothing_twice():
    """Run from `make test` (CI), the set-up is complete: `make setup` again installs
    nothing and says nothing."""
    stamp = ROOT / ".venv" / ".shardfs-installed"
    before = stamp.stat().st_mtime_ns
    result = subprocess.run(["make", "-s", "--no-print-directory", "setup"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == result.stderr == "", result.stdout + result.stderr
    assert stamp.stat().st_mtime_ns == before


def test_torch_extra_takes_ranges():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["torch"]
    assert extra and not any("==" in req for req in extra), extra
    assert "download.pytorch.org/whl/cpu" in (ROOT / "README.md").read_text()
