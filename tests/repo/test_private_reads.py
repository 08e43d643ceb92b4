"""No module in loader/ reads another object's private attributes: what one
part of the loader may ask of another is that part's public methods and
attributes (an epoch asks the loader's parts through EpochHost,
main/epochs.py; planning through EpochPlanner, main/planner.py), so a newcomer
can change a class without grepping the package for its insides (issue
17, point 1).  A read `x._name` is allowed when x is self or cls, a module
(a private module of this package, or a library's), or the object is of a
class defined in the same module; the few reads of other libraries'
insides that the integrations need are listed below with why."""

from __future__ import annotations

import ast
from pathlib import Path

LOADER = Path(__file__).resolve().parents[2] / "loader"

# Reads of other libraries' insides, each needed and each the library's
# own recipe or the only handle there is: (file, the expression).
THIRD_PARTY = {
    ("seeding.py", "torch_worker._worker_info"),  # torch's get_worker_info() reads this global
    ("seeding.py", "np.random.mtrand._rand"),     # numpy's global RandomState
    ("ray.py", "mod._WrappedDataLoader"),           # Ray Train's device-moving wrapper class
    ("accelerate.py", "keeping._keeps_loader"),     # a marker this package sets on a function
    ("accelerate.py", "watching._watches_rebuilds"),
    ("ray.py", "keeping._keeps_loader"),
    # torch's DataLoader resets its persistent iterator by this name (its iterator
    # protocol, which loader.DataLoader's iterators implement as torch's subclasses)
    ("dataloader.py", "self._iterator._reset"),
}
# namedtuple's own API starts with an underscore so as not to clash with fields
NAMEDTUPLE_API = {"_replace", "_fields", "_asdict", "_make"}


def module_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return names


def private_reads(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    modules = module_names(tree)
    own_classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    typed_own = _own_class_parameters(tree, own_classes)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and node.attr not in NAMEDTUPLE_API):
            continue
        base = node.value
        if isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in modules):
            continue
        if isinstance(base, ast.Call) and getattr(base.func, "id", None) == "super":
            continue
        # a parameter annotated with a class of this module (loader: ShmLoader in main/loader.py)
        if isinstance(base, ast.Name) and (id(base), base.id) in typed_own:
            continue
        # self._iterator._reset: an attribute of self holding a class of this module
        if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) \
                and base.value.id == "self" and _holds_own_class(tree, base.attr, own_classes):
            continue
        expr = ast.unparse(node)
        if (path.name, expr) in THIRD_PARTY or any(expr.startswith(m + ".") for m in modules
                                                   if isinstance(base, ast.Attribute)):
            continue
        found.append(f"{path.relative_to(LOADER.parent)}:{node.lineno}: {expr}")
    return found


def _own_class_parameters(tree: ast.Module, own_classes: set[str]) -> set[tuple[int, str]]:
    """(id of the Name node, name) of every use, inside its function, of a
    parameter annotated with a class this module defines."""
    uses = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        typed = {a.arg for a in fn.args.args + fn.args.kwonlyargs
                 if a.annotation is not None
                 and ast.unparse(a.annotation).strip("'\"") in own_classes}
        uses |= {(id(n), n.id) for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id in typed}
    return uses


def _holds_own_class(tree: ast.Module, attr: str, own_classes: set[str]) -> bool:
    """Is self.<attr> only ever assigned an instance of a class of this module?"""
    values = [n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Attribute) and t.attr == attr
              and isinstance(t.value, ast.Name) and t.value.id == "self"]
    return bool(values) and all(
        isinstance(v, ast.Constant) and v.value is None
        or isinstance(v, ast.Call) and getattr(v.func, "id", None) in own_classes
        for v in values)


def test_no_module_reads_another_objects_private_attributes():
    found = [line for path in sorted(LOADER.rglob("*.py")) for line in private_reads(path)]
    assert not found, ("private attributes read from outside their class (give the class a "
                       "public method, or pass what is needed in):\n" + "\n".join(found))


def test_the_check_sees_a_private_read(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f(loader):\n    return loader._session\n")
    reads = [line.split(": ", 1)[1] for line in _reads_outside(sample)]
    assert reads == ["loader._session"]


def _reads_outside(path: Path) -> list[str]:
    global LOADER
    saved, LOADER = LOADER, path.parent.parent
    try:
        return private_reads(path)
    finally:
        LOADER = saved
