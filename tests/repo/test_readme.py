"""The examples of the README and of docs/ run as written (each in a fresh
interpreter, from the repository's root, warnings as errors).

A block fenced as ```python runs; one fenced as ```py is a fragment that
needs a launcher, a model or a cluster (the tests named beside it run those
lines)."""

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks() -> list[tuple[str, str]]:
    """(id, code) of every runnable block: README-block0, frameworks-block1..."""
    found = []
    for page in PAGES:
        for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S)):
            found.append((f"{page.stem}-block{i}", code))
    return found


BLOCKS = _blocks()

# what an example needs beyond the package and numpy: the extras it imports
EXTRAS = {"torch", "pytorch_lightning", "lightning", "accelerate", "ray", "datasets", "pyarrow",
          "tqdm", "jax", "obstore"}


def missing_extras(code: str) -> list[str]:
    needed = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            needed |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            needed.add(node.module.split(".")[0])
    if re.search(r"\bDataLoader\b|output=.torch.", code):
        needed.add("torch")  # loader.DataLoader is torch's; so are tensors out
    if "s3://" in code:
        needed.add("obstore")  # the object-store client (the remote extra)
    return sorted(m for m in needed & EXTRAS if importlib.util.find_spec(m) is None)


# Examples that show an open bug, with the bug: run (and reported), but not
# counted against the suite.  Each names its issue and where the bug is written.
KNOWN_BUGS: dict[str, str] = {}   # block id -> why it fails (an open issue): xfail


def test_every_page_has_its_examples_found():
    """The pages that teach by example keep runnable blocks (a fence typo
    would silently drop a page's examples from the test)."""
    pages = {block_id.split("-block")[0] for block_id, _ in BLOCKS}
    assert {"README", "data-sources", "resume", "where-the-time-goes", "object-stores",
            "frameworks", "jax"} <= pages, sorted(pages)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("code", [
    pytest.param(code, marks=pytest.mark.xfail(reason=KNOWN_BUGS[i], strict=False,
                                               raises=subprocess.TimeoutExpired))
    if i in KNOWN_BUGS else code for i, code in BLOCKS], ids=[i for i, _ in BLOCKS])
def test_example_runs(code):
    missing = missing_extras(code)
    if missing:
        pytest.skip(f"the example needs {', '.join(missing)}, not installed here")
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)  # (a loaded 2-core machine)
    assert out.returncode == 0, out.stderr
