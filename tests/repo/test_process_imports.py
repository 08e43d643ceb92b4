"""The batcher process imports nothing of the workers' code: what the two
share lives in loader/shared/ (issue 27, item 2), so a change to the worker
cannot reach the batcher through an import."""

from __future__ import annotations

import ast
from pathlib import Path

LOADER = Path(__file__).resolve().parents[2] / "loader"


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_the_batcher_imports_nothing_of_the_worker():
    files = sorted((LOADER / "batcher").glob("*.py"))
    assert len(files) >= 4, files  # the folder was found and read
    found = {f.name: sorted(m for m in imported_modules(f)
                            if m == "loader.worker" or m.startswith("loader.worker."))
             for f in files}
    assert {name: mods for name, mods in found.items() if mods} == {}
