"""Classes that pickle cannot find by name (a namedtuple made in a class
body or a function), between the loader's processes: they travel by
identity, since every process of a loader is forked from main after the
dataset's classes existed (forked_class_reduce, for the messages), and
signatures name them by identity too (layout digests)."""

from __future__ import annotations

import os
import pickle
import sys

def found_by_name(cls: type) -> bool:
    """Can pickle find cls by its module and qualified name?  Not a class
    defined in a function, nor one whose __qualname__ does not say where
    it lives (a namedtuple made in a class body: qualname 'Batch', stored
    as Dataset.Batch)."""
    obj = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is cls


def forked_class_reduce(obj):
    """reduce= for the messages between the loader's processes (SpillWriter):
    a class pickle cannot find by name (a namedtuple made in a class body
    or a function) goes by its identity instead.  Every process of a
    loader is forked from main after the dataset (and so its classes)
    existed, so the same class object sits at the same address in the
    receiver; _forked_class finds it there without trusting the address."""
    if isinstance(obj, type):
        found = _found_cache.get(obj)
        if found is None:  # once per class: every message pickles its own class
            if len(_found_cache) > 4096:  # classes made per sample: keep it bounded
                _found_cache.clear()
            found = _found_cache[obj] = found_by_name(obj)
        if not found:
            return _forked_class, (obj.__module__, obj.__qualname__, id(obj))
    return NotImplemented


_found_cache: dict[type, bool] = {}
_forked_classes: dict[int, type] = {}


def _forked_class(module: str, qualname: str, ident: int) -> type:
    """The class forked_class_reduce named, looked up among this process's
    objects (once per class: the scan costs tens of ms)."""
    cls = _forked_classes.get(ident)
    if cls is None:
        import gc

        def named(obj) -> bool:
            # id first, and type(obj) rather than isinstance: isinstance reads
            # obj.__class__, which some lazy objects answer with a warning
            return (id(obj) == ident and issubclass(type(obj), type)
                    and obj.__qualname__ == qualname and obj.__module__ == module)

        cls = next(filter(named, gc.get_objects()), None)
        if cls is None:  # gc.freeze() hides objects from get_objects(): walk to it instead
            cls = next(filter(named, _reachable()), None)
        if cls is None:
            raise pickle.UnpicklingError(
                f"class {module}.{qualname}, which pickle cannot find by name, was made in a "
                f"loader worker after it started (pid {os.getpid()} does not have it): define it "
                f"at module level, or before the loader starts its workers")
        _forked_classes[ident] = cls
    return cls


def _reachable(limit: int = 4_000_000):
    """Objects reachable from every thread's frames (their locals: the
    loader's config and dataset, the training loop's) and from the loaded
    modules, breadth first, at most `limit`.  gc.get_objects() does not
    list what gc.freeze() froze (a program may freeze its heap before it
    forks, to spare copy-on-write), and get_referents() sees it all."""
    import collections
    import gc

    roots = []
    for frame in sys._current_frames().values():
        while frame is not None:
            # dict(): from 3.13 f_locals is a proxy (PEP 667) whose referents
            # are not the locals
            roots += [dict(frame.f_locals), frame.f_globals]
            frame = frame.f_back
    todo, seen = collections.deque(roots + list(sys.modules.values())), set()
    while todo and len(seen) < limit:
        obj = todo.popleft()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        yield obj
        todo.extend(gc.get_referents(obj))
