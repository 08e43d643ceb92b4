"""The map cannot drift: every `NOTE [ X ]` cited anywhere is defined
exactly once, a citation that says where ("NOTE [ X ] in _f.py") names the
file that defines it, and every file of this repository named in a comment
or a doc exists.

A note is defined by a line that holds only its title (after comment
marks), the way the notes in loader/ and shmq/ begin; every other
occurrence is a citation.  Files are the ones git tracks, so generated C
and build output never count."""

from __future__ import annotations

import re
import subprocess
from collections import defaultdict
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEXT_SUFFIXES = {".py", ".pyx", ".pxi", ".pxd", ".h", ".c", ".md", ".toml", ".cfg"}

# Files of other projects that comments cite on purpose (torch's, Lightning's,
# the standard library's), and example names standing for a user's own files.
NOT_OURS = {
    "torch/utils/data/_utils/fetch.py", "_utils/worker.py", "dataloader.py",
    "test/test_dataloader.py", "pytorch_lightning/loops/fetchers.py", "random.py",
    "train.py", "readme_block.py", "torch/utils/data/dataloader.py",
    "_f.py",  # this file's docstring: a made-up example
    "sample.py",  # test_records_by_keyword.py's made-up module
}
NOT_OUR_NOTES = {"IterableDataset and __len__"}  # torch's, in torch/utils/data/dataloader.py
TITLE = re.compile(r"NOTE\s+\[\s+(.+?)\s+\]")
DEFINITION = re.compile(r'^\s*(?:#|//|/?\*+|""")?\s*NOTE \[ (.+?) \]\s*$')
WHERE = re.compile(r"NOTE\s+\[\s+(.+?)\s+\]\s+in\s+`?([\w./-]+\.(?:py|pyx|pxi|pxd|h|c|md))")
# a file name: path segments ending in one of our suffixes, not part of a longer
# word, a URL, a system header (<sys/mman.h>) or a relative path out of the repo
FILE_NAME = re.compile(r"(?<![\w./<-])((?:[\w-]+/)*[\w.-]+\.(?:py|pyx|pxi|pxd|h|c|md))\b(?!>)")


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True, timeout=30).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [ROOT / line for line in out.splitlines() if line]


def text_files() -> list[Path]:
    return [p for p in tracked_files() if p.suffix in TEXT_SUFFIXES and p.is_file()]


def read(path: Path) -> str:
    return path.read_text(errors="replace")


def note_definitions() -> dict[str, list[str]]:
    """title -> the files that define it."""
    defined = defaultdict(list)
    for path in text_files():
        for line in read(path).splitlines():
            m = DEFINITION.match(line)
            if m:
                defined[m.group(1)].append(path.name)
    return defined


def test_every_note_is_defined_once():
    twice = {t: files for t, files in note_definitions().items() if len(files) > 1}
    assert not twice, f"notes defined more than once (give each one home): {twice}"


def test_every_cited_note_exists_where_it_is_said_to_be():
    defined = note_definitions()
    unresolved, misplaced = [], []
    for path in text_files():
        text = read(path)
        flat = re.sub(r"\s*\n\s*(?:#\s*|//\s*|\*\s*)?", " ", text)  # citations wrap lines
        for m in TITLE.finditer(flat):
            if m.group(1) not in defined and m.group(1) not in NOT_OUR_NOTES | {"...", "X"}:
                unresolved.append((path.relative_to(ROOT).as_posix(), m.group(1)))
        for m in WHERE.finditer(flat):
            title, where = m.group(1), PurePosixPath(m.group(2)).name
            if title in defined and where not in defined[title]:
                misplaced.append((path.relative_to(ROOT).as_posix(), title, where,
                                  defined[title]))
    assert not unresolved, f"cited notes that no file defines: {unresolved}"
    assert not misplaced, f"notes cited in the wrong file (file, note, says, is in): {misplaced}"


def test_every_file_named_in_a_comment_or_doc_exists():
    tracked = [p.relative_to(ROOT).as_posix() for p in tracked_files()]
    names = {PurePosixPath(p).name for p in tracked}
    missing = []
    for path in text_files():
        if path.suffix == ".c":  # C sources name system headers only
            continue
        for number, line in enumerate(read(path).splitlines(), 1):
            if "extern from" in line:  # Cython's names for system headers
                continue
            for m in FILE_NAME.finditer(line):
                cited = m.group(1)
                if cited in NOT_OURS or PurePosixPath(cited).name.startswith("repro_"):
                    continue  # repros live beside the repository, in ../shared/repros
                if "/" in cited:
                    found = any(t == cited or t.endswith("/" + cited) for t in tracked)
                else:
                    found = cited in names
                if not found:
                    missing.append(f"{path.relative_to(ROOT)}:{number}: {cited}")
    assert not missing, "files named but not in the repository:\n" + "\n".join(missing)


def test_every_loader_module_is_on_the_map():
    """docs/architecture.md's table of modules names every module of
    loader/ and its folders, by its path there (a module added without a
    line there is one a newcomer cannot place)."""
    table = read(ROOT / "docs" / "architecture.md").split("## Modules", 1)[1]
    named = set(re.findall(r"`([\w/]+\.(?:py|pyx|pxi))`", table))
    modules = {str(p.relative_to(ROOT / "loader")) for p in tracked_files()
               if ROOT / "loader" in p.parents and p.suffix in {".py", ".pyx", ".pxi"}
               and p.name != "__init__.py"}
    assert not modules - named, f"loader modules missing from docs/architecture.md: " \
                                f"{sorted(modules - named)}"
