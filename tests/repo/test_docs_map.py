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


# --- identifiers named in comments and NOTEs ----------------------------------------
# A comment of loader/ that names a function, a class, a module or an attribute
# (`name` in backquotes, module.name, name(), or a private _name) names one that
# exists: in the code of loader/ or shmq/, among Python's builtins, or in a module
# that can be imported (torch.x, warnings.filterwarnings).  What remains are names
# of other software, or examples, that the comments cite on purpose:
NOT_OUR_NAMES = {
    "Accelerator", "prepare", "skip_first_batches",       # HF accelerate's
    "DataLoaderShard", "set_sampler",
    "Dataset", "_BaseDataLoaderIter", "_MapDatasetFetcher", "_sharding_worker_init_fn",
    "filterwarnings",                                     # warnings.filterwarnings()
    "vm",                                                 # the sysctl vm.max_map_count
    "targets",                                            # a training loop's list, in an example
}
FILE_SUFFIX = re.compile(r"\.(?:py|pyx|pxi|pxd|h|c|md|json|sqlite|so|txt|toml)$")
BACKQUOTED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\(\))?`")
DOTTED = re.compile(r"(?<![\w.`/-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w/-])")
CALLED = re.compile(r"(?<![\w.`/-])([A-Za-z_]\w*)\(\)")
PRIVATE = re.compile(r"(?<![\w.`/-])(_[a-z]\w*)(?![\w(/-])")
TRIPLE_QUOTED = re.compile(r'("""|\'\'\')(.*?)\1', re.S)
C_VERBATIM = re.compile(r'cdef extern from \*:\s*\n\s*("""|\'\'\')(.*?)\1', re.S)


def _python_parts(text: str) -> tuple[set[str], list[tuple[int, str]]]:
    """(the names the code uses, [(line, comment or docstring)])."""
    import ast
    import io
    import tokenize

    names, prose = set(), []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NAME:
            names.add(tok.string)
        elif tok.type == tokenize.COMMENT:
            prose.append((tok.start[0], tok.string))
        elif tok.type == tokenize.STRING:  # getattr(obj, "name"), __all__ entries
            names.update(re.findall(r"^[rbuRBU]?['\"]([A-Za-z_]\w*)['\"]$", tok.string))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                prose.append((node.body[0].lineno, doc))
    return names, prose


def _cython_parts(text: str) -> tuple[set[str], list[tuple[int, str]]]:
    """As _python_parts, for .pyx, .pxi, .pxd and .h: the C of a `cdef
    extern from *` block is code, every other triple-quoted string prose."""
    names = set()
    for m in C_VERBATIM.finditer(text):
        names.update(re.findall(r"[A-Za-z_]\w*", m.group(2)))
    code = C_VERBATIM.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    prose = [(code.count("\n", 0, m.start()) + 1, m.group(2))
             for m in TRIPLE_QUOTED.finditer(code)]
    code = TRIPLE_QUOTED.sub(lambda m: "\n" * m.group(0).count("\n"), code)
    for number, line in enumerate(code.splitlines(), 1):
        cut = re.match(r"""^((?:[^#'"]|'[^']*'|"[^"]*")*)(#.*|//.*)?$""", line)
        body, comment = (cut.group(1), cut.group(2)) if cut else (line, None)
        names.update(re.findall(r"[A-Za-z_]\w*", body))
        if comment:
            prose.append((number, comment))
    return names, prose


def _named_in(text: str) -> set[str]:
    found = {m.group(1) for pattern in (BACKQUOTED, DOTTED, CALLED, PRIVATE)
             for m in pattern.finditer(text)}
    return {name for name in found if not FILE_SUFFIX.search(name)}


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def test_every_identifier_named_in_a_comment_of_loader_exists():
    """A comment or NOTE that names a function renamed or removed since
    misleads the next reader: the name must still exist."""
    import builtins

    names, prose = set(vars(builtins)), []
    for path in tracked_files():
        top = path.relative_to(ROOT).parts[0]
        if top not in ("loader", "shmq") or path.suffix not in {".py", ".pyx", ".pxi", ".pxd", ".h"}:
            continue
        parts = _python_parts if path.suffix == ".py" else _cython_parts
        code_names, texts = parts(read(path))
        names |= code_names
        if top == "loader":
            prose += [(path.relative_to(ROOT).as_posix(), line, text) for line, text in texts]
    missing = []
    for where, line, text in prose:
        for named in sorted(_named_in(text)):
            head, *rest = named.split(".")
            if rest and head not in names and _importable(head):
                continue  # another module's: warnings.filterwarnings, torch.Generator
            unknown = [p for p in named.split(".") if p not in names | NOT_OUR_NAMES
                       and not (p.startswith("__") and p.endswith("__"))]  # Python's
            if unknown:
                missing.append(f"{where}:{line}: {named} ({', '.join(unknown)} not found)")
    assert not missing, "comments name identifiers that do not exist:\n" + "\n".join(missing)
