"""The README's examples run as written (each in a fresh interpreter)."""

import os
import re
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "README.md")
with open(README) as f:
    BLOCKS = re.findall(r"```python\n(.*?)```", f.read(), re.S)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code):
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, out.stderr
