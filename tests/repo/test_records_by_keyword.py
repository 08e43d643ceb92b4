"""Records in loader/ are built with keywords: a message or plan record
built from a row of positional values (`Failed(run, -1, -1, pid, ...)`)
says nothing about which value is which, and silently shifts when a field
is added.  This check finds every record class in loader/ (NamedTuples
and dataclasses) and fails on a call that passes one more than four
positional arguments (issue 17, point 2)."""

from __future__ import annotations

import ast
from pathlib import Path

LOADER = Path(__file__).resolve().parents[2] / "loader"
MAX_POSITIONAL = 4


def _is_record(node: ast.ClassDef, records: set[str]) -> bool:
    bases = {ast.unparse(b).split(".")[-1] for b in node.bases}
    decorators = {ast.unparse(d).split("(")[0].split(".")[-1] for d in node.decorator_list}
    return "NamedTuple" in bases or "dataclass" in decorators or bool(bases & records)


def record_classes(trees: dict[Path, ast.Module]) -> set[str]:
    records: set[str] = set()
    changed = True
    while changed:  # subclasses of records are records
        changed = False
        for tree in trees.values():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name not in records \
                        and _is_record(node, records):
                    records.add(node.name)
                    changed = True
    return records


def positional_record_calls(trees: dict[Path, ast.Module], records: set[str]) -> list[str]:
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in records and len(node.args) > MAX_POSITIONAL:
                found.append(f"{path.relative_to(LOADER.parent)}:{node.lineno}: {name}(...) with "
                             f"{len(node.args)} positional arguments")
    return found


def parse(paths) -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for p in paths}


def test_records_in_loader_are_built_with_keywords():
    trees = parse(sorted(LOADER.rglob("*.py")))
    records = record_classes(trees)
    assert {"Failed", "BatchReady", "LoaderSpec", "WorkerInfo"} <= records  # the check sees them
    bad = positional_record_calls(trees, records)
    assert not bad, "build these records with keywords:\n" + "\n".join(bad)


def test_the_check_finds_a_positional_record(tmp_path):
    """The check itself: a record built from five positional values is found."""
    sample = tmp_path / "sample.py"
    sample.write_text("from typing import NamedTuple\n"
                      "class Msg(NamedTuple):\n    a: int\n    b: int\n    c: int\n    d: int\n"
                      "    e: int\n"
                      "class Sub(Msg):\n    pass\n"
                      "ok = Msg(1, 2, 3, 4, e=5)\n"
                      "bad = Sub(1, 2, 3, 4, 5)\n")
    trees = parse([sample])
    records = record_classes(trees)
    assert records == {"Msg", "Sub"}
    global LOADER
    saved, LOADER = LOADER, tmp_path
    try:
        bad = positional_record_calls(trees, records)
    finally:
        LOADER = saved
    assert len(bad) == 1 and "Sub(...) with 5 positional" in bad[0]
