"""Packaging: one version source, `txl --version`, the license file pyproject names."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

import txl
from txl.cli import main

try:
    import tomllib
except ImportError:  # Python 3.10: the cli extra installs tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_version_has_one_source():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "txl.__version__"}
    assert importlib.metadata.version("txl") == txl.__version__  # the installed metadata agrees


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"txl {txl.__version__}"


def test_license_is_mit():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "the txl authors" in text
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == {"text": "MIT"}


def test_the_readme_says_what_the_lmeval_extra_downgrades():
    """[lmeval] pulls lm-eval 0.4, whose pytablewriter needs typepy[datetime], capping python-dateutil below 3: pip
    downgrades a dateutil 4 (issue 44). txl pins nothing around it (its own dependencies name no dateutil), and the
    README says so where it installs the extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    assert any(req.startswith("lm-eval") and "<0.5" in req for req in extras["lmeval"])
    assert not any("dateutil" in req for reqs in [project["project"]["dependencies"], *extras.values()] for req in reqs)
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    section = readme[readme.index("### lm-evaluation-harness"):]
    assert section.startswith('### lm-evaluation-harness `pip install -e ".[lmeval]"` (it downgrades python-dateutil '
                              "4 to 2.9: lm-eval 0.4.13 needs pytablewriter, whose `typepy[datetime]` requires "
                              "`python-dateutil<3`")
