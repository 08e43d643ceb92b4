"""The README's examples run as written (each in a fresh interpreter)."""

import ast
import importlib.util
import os
import re
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "README.md")
with open(README) as f:
    BLOCKS = re.findall(r"```python\n(.*?)```", f.read(), re.S)


# what an example needs beyond the package and numpy: the extras it imports
EXTRAS = {"torch", "pytorch_lightning", "lightning", "accelerate", "ray", "datasets", "pyarrow",
          "tqdm", "jax"}


def missing_extras(code: str) -> list[str]:
    needed = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            needed |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            needed.add(node.module.split(".")[0])
    if re.search(r"\bDataLoader\b|output=.torch.", code):
        needed.add("torch")  # loader.DataLoader is torch's; so are tensors out
    return sorted(m for m in needed & EXTRAS if importlib.util.find_spec(m) is None)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code):
    missing = missing_extras(code)
    if missing:
        pytest.skip(f"the example needs {', '.join(missing)}, not installed here")
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                         text=True, timeout=200)  # (a loaded 2-core machine)
    assert out.returncode == 0, out.stderr
