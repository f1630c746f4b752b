"""The README's Python example runs as written."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow  # a real subprocess
def test_readme_api_example_runs(tmp_path):
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    src = str(README.parent / "src")
    result = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env={"PYTHONPATH": src, "PATH": ""})
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "my-model" / "model.safetensors").exists()
    assert (tmp_path / "my-model-hf" / "config.json").exists()
