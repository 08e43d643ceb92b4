"""A pause in the fetcher process, for a test that needs one interleaving
every time (tests/remote_layer/test_remote_files.py).

A test puts this folder first on the fetcher's PYTHONPATH (the fetcher is a
fresh interpreter: Python imports `sitecustomize` at its start) and names a
Unix socket in SHMQ_TEST_PAUSE_SOCKET and a board slot in
SHMQ_TEST_PAUSE_SLOT.  The first fetch of an object for that slot then stops
just before `Fetcher._get` (after `_fetch` looked its slot up and let go of
the lock: the window a newer epoch's adoption may retire the slot in),
connects to the socket, and goes on when the test sends a byte (or after
PAUSE_LIMIT_S); once that fetch's `_fetch` has returned, it writes "done".
Nothing happens without those variables."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import socket
import sys
import threading

TARGET = "loader.datasets.remote.fetcher"
PAUSE_LIMIT_S = 120.0


def _pause_before_get(module) -> None:
    path, slot = os.environ["SHMQ_TEST_PAUSE_SOCKET"], int(os.environ["SHMQ_TEST_PAUSE_SLOT"])
    real_get, real_fetch = module.Fetcher._get, module.Fetcher._fetch
    first = threading.Lock()
    held = {}   # pool thread -> its connection to the test, until its _fetch returns

    def _get(self, url, key, etag, size, s, index, *rest):
        if s == slot and first.acquire(blocking=False):
            test = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            test.settimeout(PAUSE_LIMIT_S)
            held[threading.get_ident()] = test
            test.connect(path)
            test.sendall(f"{s} {index}\n".encode())
            test.recv(1)   # the test's go (or its close, or the limit: an OSError)
        return real_get(self, url, key, etag, size, s, index, *rest)

    def _fetch(self, s, i):
        """The paused fetch, to its end (its result written, or dropped):
        then the test is told "done" (what it checks comes after it)."""
        try:
            return real_fetch(self, s, i)
        finally:
            test = held.pop(threading.get_ident(), None)
            if test is not None:
                with test:
                    try:
                        test.sendall(b"done\n")
                    except OSError:
                        pass

    module.Fetcher._get, module.Fetcher._fetch = _get, _fetch


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the pause put in."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _pause_before_get(module)

    def __getattr__(self, name):   # get_code &c. (runpy runs the module as __main__ with them)
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if os.environ.get("SHMQ_TEST_PAUSE_SOCKET"):
    sys.meta_path.insert(0, _Finder())
