"""The loader's errors: every class in loader/errors.py, under LoaderError
(or LoaderWarning for a warning) and exported from `loader`, each keeping
its standard base; no exception class defined anywhere else in loader/;
and real failures, caught by `except loader.LoaderError`, in both worker
modes.  The user's own exceptions stay theirs (raise_reported)."""

from __future__ import annotations

import ast
import builtins
import multiprocessing as mp
import re
from pathlib import Path

import numpy as np
import pytest

import loader
from loader import errors
from loader import (ArgumentError, ArgumentTypeError, BatchMismatch, LoaderError,
                    LoaderTimeout, LoaderWarning, ShmLoader, StateError, WorkerError)

LOADER = Path(loader.__file__).parent

# Each class and the standard bases it keeps (what it derived from before
# LoaderError existed), so `except ValueError` and the like go on working.
STANDARD_BASES = {
    "ArgumentError": (ValueError,),
    "ArgumentTypeError": (TypeError,),
    "WorkerError": (RuntimeError,),
    "LoaderTimeout": (RuntimeError, TimeoutError),
    "LoaderStartError": (RuntimeError,),
    "StateError": (ValueError,),
    "TraceWriteError": (OSError,),
    "CollateError": (ValueError,),
    "BatchMismatch": (ValueError, RuntimeError),
    "UnsupportedLeaf": (ValueError, TypeError),
    "NotARegularFile": (OSError,),
    "ParquetFileError": (ValueError,),
    "ParquetFileChanged": (RuntimeError,),
    "RemoteError": (OSError,),
    "ObjectNotFound": (OSError, FileNotFoundError),
    "ObjectChanged": (OSError,),
    "TruncatedObject": (OSError,),
    "AccessDenied": (OSError, PermissionError),
    "EndpointUnreachable": (OSError, ConnectionError),
    "Throttled": (OSError,),
    "CacheFull": (OSError,),
    "FetcherDied": (OSError,),
    "CacheError": (OSError,),
    "NoRoom": (),
    "DataStallWarning": (UserWarning,),
    "LoaderReplacedWarning": (UserWarning,),
    "KeptBatchesShared": (RuntimeWarning,),
    "InexactResumeWarning": (UserWarning,),
}
NOT_EXPORTED = {"NoRoom"}  # the object cache's answer to its fetcher: never reaches the loop


def classes_in_errors_py() -> dict[str, type]:
    """The public exception and warning classes defined in loader/errors.py."""
    tree = ast.parse((LOADER / "errors.py").read_text())
    names = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    found = {name: getattr(errors, name) for name in names if not name.startswith("_")}
    return {name: cls for name, cls in found.items() if issubclass(cls, BaseException)}


def test_every_class_in_errors_py_is_under_one_base_and_exported():
    classes = classes_in_errors_py()
    assert set(classes) == set(STANDARD_BASES) | {"LoaderError", "LoaderWarning"}
    for name, cls in classes.items():
        base = LoaderWarning if issubclass(cls, Warning) else LoaderError
        assert issubclass(cls, base), name
        if name in NOT_EXPORTED:
            assert name not in loader.__all__ and not hasattr(loader, name), name
        else:
            assert name in loader.__all__ and getattr(loader, name) is cls, name
    assert not issubclass(LoaderWarning, LoaderError) and not issubclass(LoaderError, Warning)


@pytest.mark.parametrize("name", sorted(STANDARD_BASES))
def test_each_class_keeps_its_standard_base(name):
    cls = getattr(errors, name)
    for base in STANDARD_BASES[name]:
        assert issubclass(cls, base), (name, base)


def test_no_exception_class_is_defined_outside_errors_py():
    """One module holds them all: a class whose base is an exception or a
    warning (a builtin one or one of errors.py) found anywhere else in
    loader/ (Python, .pyx and .pxi alike) fails here."""
    exception_names = {name for name, obj in vars(builtins).items()
                       if isinstance(obj, type) and issubclass(obj, BaseException)}
    exception_names |= set(classes_in_errors_py())
    class_line = re.compile(r"^\s*(?:cdef\s+)?class\s+(\w+)\s*\(([^)]*)\)", re.M)
    elsewhere = []
    for path in sorted(LOADER.rglob("*")):
        if path.suffix not in {".py", ".pyx", ".pxi"} or path.name == "errors.py":
            continue
        for name, bases in class_line.findall(path.read_text()):
            base_names = {b.strip().split(".")[-1].split("[")[0] for b in bases.split(",")}
            if base_names & exception_names:
                elsewhere.append(f"{path.relative_to(LOADER)}: {name}({bases})")
    assert not elsewhere, f"exception classes outside loader/errors.py: {elsewhere}"


def test_the_compiled_warning_is_the_one_of_errors_py():
    from loader import _native

    assert _native.KeptBatchesShared is loader.KeptBatchesShared


# --- real failures, caught by except loader.LoaderError ------------------------------


def test_argument_mistakes_are_loader_errors_and_keep_their_standard_types():
    data = np.arange(64)
    cases = [
        (lambda: ShmLoader(data, batch_size=0), ArgumentError, ValueError,
         "batch_size must be an int >= 1, got 0"),
        (lambda: ShmLoader(data, worker_mode="fiber"), ArgumentError, ValueError,
         "worker_mode must be 'process' or 'thread', got 'fiber'"),
        (lambda: ShmLoader(data, collate_fn=3), ArgumentTypeError, TypeError,
         "collate_fn must be callable, got int"),
        (lambda: ShmLoader(data, trace=3.5), ArgumentTypeError, TypeError,
         "trace must be a path (str or os.PathLike)"),
        (lambda: loader.FileDataset(7), ArgumentTypeError, TypeError,
         "pattern must be a glob string, got int"),
    ]
    for make, cls, standard, text in cases:
        with pytest.raises(LoaderError) as info:
            make()
        assert type(info.value) is cls and isinstance(info.value, standard)
        assert text in str(info.value)


def test_a_positional_call_past_collate_fn_is_a_type_error_naming_what_to_do():
    """torch's eighth positional parameter is pin_memory, ShmLoader's
    would have been drop_last: refused, never bound."""
    data = np.arange(64)
    with pytest.raises(ArgumentTypeError) as info:
        ShmLoader(data, 8, True, None, None, 4, None, True)
    assert isinstance(info.value, TypeError) and isinstance(info.value, LoaderError)
    text = str(info.value)
    assert text.startswith("ShmLoader() takes 7 arguments by position, torch's DataLoader's "
                           "first ones in its order (dataset, batch_size, shuffle, sampler, "
                           "batch_sampler, num_workers, collate_fn), but 8 were given: pass "
                           "the others by keyword, as drop_last=...")
    assert "keyword-only: drop_last, in_order, prefetch," in text and "pin_memory" in text
    # the seven torch positions still bind as torch binds them
    with ShmLoader(data, 8, False, None, None, 0, None, drop_last=True) as ld:
        assert [b.tolist() for b in ld] == [list(range(k, k + 8)) for k in range(0, 64, 8)]


class NeedsTwo(Exception):
    """An exception main cannot rebuild from a message alone."""

    def __init__(self, a, b):
        super().__init__(a, b)


class Failing:
    """Sample i is i; sample `bad` raises `exc` (NeedsTwo or KeyError)."""

    def __init__(self, n, bad, exc):
        self.n, self.bad, self.exc = n, bad, exc

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise NeedsTwo(i, "twice") if self.exc == "needs two" else KeyError(i)
        return np.full(2, i, np.int64)


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_an_exception_main_cannot_rebuild_is_a_worker_error(mode):
    with ShmLoader(Failing(64, 21, "needs two"), batch_size=8, num_workers=2, worker_mode=mode,
                   timeout=60) as ld:
        with pytest.raises(LoaderError) as info:
            list(ld)
        assert type(info.value) is WorkerError
        assert "Caught NeedsTwo in worker " in str(info.value)
        assert "sample index 21" in str(info.value)
        # still usable: the next epoch delivers the batches before the bad one
        it = iter(ld)
        assert [next(it)[:, 0].tolist() for _ in range(2)] == [list(range(8)),
                                                               list(range(8, 16))]


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_the_users_own_exception_keeps_its_type_and_is_not_a_loader_error(mode):
    with ShmLoader(Failing(64, 5, "key"), batch_size=8, num_workers=2, worker_mode=mode,
                   timeout=60) as ld:
        with pytest.raises(KeyError) as info:
            list(ld)
    assert not isinstance(info.value, LoaderError)
    assert str(info.value).startswith("Caught KeyError in worker ")


class Dies:
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 9:
            import os

            os._exit(3)
        return np.full(2, i, np.int64)


def test_a_dead_worker_is_a_loader_error():
    with ShmLoader(Dies(), batch_size=8, num_workers=2, timeout=60) as ld:
        with pytest.raises(LoaderError) as info:
            list(ld)
    assert type(info.value) is WorkerError and "exit code 3" in str(info.value)


class Held:
    """Sample 0 waits (bounded) until the test lets it go."""

    def __init__(self, release):
        self.release = release

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 0:
            self.release.wait(60)
        return np.full(2, i, np.int64)


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_timeout_is_a_loader_error(mode):
    release = mp.get_context("fork").Event()
    try:
        with ShmLoader(Held(release), batch_size=4, num_workers=1, worker_mode=mode,
                       timeout=0.5) as ld:
            with pytest.raises(LoaderError) as info:
                next(iter(ld))
            assert type(info.value) is LoaderTimeout and isinstance(info.value, TimeoutError)
            assert "timeout=0.5" in str(info.value)
            release.set()
    finally:
        release.set()


class Ragged:
    """Samples 0-2 of shape (2,), the rest of shape (3,): batch 0 cannot be stacked."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return np.full(2 if i < 3 else 3, i, np.int64)


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_samples_that_cannot_be_batched_are_a_loader_error(mode):
    with ShmLoader(Ragged(), batch_size=8, num_workers=2, worker_mode=mode, timeout=60) as ld:
        with pytest.raises(LoaderError) as info:
            list(ld)
    assert isinstance(info.value, BatchMismatch) and isinstance(info.value, RuntimeError)
    assert "does not fit the batch" in str(info.value)


def test_a_refused_state_is_a_loader_error_and_leaves_the_loader_as_it_was():
    with ShmLoader(np.arange(64), batch_size=8, num_workers=0) as ld:
        with pytest.raises(LoaderError) as info:
            ld.load_state_dict({"format": "no such format"})
        assert type(info.value) is StateError and isinstance(info.value, ValueError)
        assert [b.tolist() for b in ld] == [list(range(k, k + 8)) for k in range(0, 64, 8)]
