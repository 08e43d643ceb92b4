"""Every exception and warning the loader raises on purpose, and how what
a worker reported is raised in main.

Each error derives from LoaderError and keeps the standard library base
it had before LoaderError existed (so ``except ValueError`` around an
argument, ``except OSError`` around a file, ``except TimeoutError``
around next() go on catching what they caught); each warning derives
from LoaderWarning and its standard category.  ``except
loader.LoaderError`` catches everything the loader raises on purpose;
tests/loader_layer/test_error_classes.py keeps every class here under one of the two
bases and exported from ``loader``.

What is not a LoaderError: an exception raised by the user's own code
(``dataset[i]``, ``__getitems__``, a collate_fn, a sampler,
worker_init_fn) in a worker is raised again in main with its own type
(raise_reported, as PyTorch does), so that ``except KeyError`` around
the loop catches the dataset's KeyError.  It is the user's exception, not
the loader's: only when main cannot rebuild its type does it become a
WorkerError.
"""

from __future__ import annotations

import os

__all__ = [
    "LoaderError", "LoaderWarning",
    "ArgumentError", "ArgumentTypeError",
    "WorkerError", "LoaderTimeout", "LoaderStartError", "StateError", "TraceWriteError",
    "CollateError", "BatchMismatch", "UnsupportedLeaf",
    "NotARegularFile", "ParquetFileError", "ParquetFileChanged",
    "RemoteError", "ObjectNotFound", "ObjectChanged", "TruncatedObject", "AccessDenied",
    "EndpointUnreachable", "Throttled", "CacheFull", "FetcherDied", "CacheError",
    "DataStallWarning", "LoaderReplacedWarning", "KeptBatchesShared", "InexactResumeWarning",
]


class LoaderError(Exception):
    """Base of every error the loader raises on purpose."""


class LoaderWarning(Warning):
    """Base of every warning the loader gives."""


# --- arguments ----------------------------------------------------------------------


class ArgumentError(LoaderError, ValueError):
    """An argument's value is refused (ShmLoader's, FileDataset's, a
    distributed=True environment); the message names the argument, what
    it got and what to pass instead.  Raised before anything is started."""


class ArgumentTypeError(LoaderError, TypeError):
    """An argument is of a type the loader cannot use (a collate_fn that is
    not callable, a trace that is not a path, ShmLoader's keyword-only
    arguments passed by position); the message says what to pass."""


# --- main: the processes, a state, the trace ----------------------------------------


class WorkerError(LoaderError, RuntimeError):
    """A worker or the batcher died, or raised an exception that cannot be
    raised again in main with its own type.  The message carries the
    traceback (or the signal or exit code), the worker id and its pid."""


class LoaderTimeout(WorkerError, TimeoutError):
    """No batch arrived within the loader's ``timeout``."""


class LoaderStartError(LoaderError, RuntimeError):
    """The loader's processes could not be started (fork failed, no file
    descriptors left...); nothing was left running."""


class StateError(LoaderError, ValueError):
    """load_state_dict() refused a state: a field (named by its path, as
    ``map.done_ranges`` or ``stream[1].extra``) is missing, of a wrong type
    or value, one the state's format does not define, or of another
    loader.  The loader is left as it was."""


class TraceWriteError(LoaderError, OSError):
    """close() could not write ``trace=PATH`` (a full disk, a directory
    gone or made read-only).  Its ``errno`` is the cause's.  The processes
    are stopped all the same; nothing was left at PATH (it holds what it
    held before), and the records are kept: close() again writes them."""

    @classmethod
    def of(cls, path: str, json_bytes: int, records: int, cause: OSError) -> "TraceWriteError":
        folder = os.path.dirname(os.path.abspath(path))
        reason = cause.strerror or str(cause)
        return cls(cause.errno, (
            f"ShmLoader: could not write the trace to {path!r} ({reason}; {json_bytes} bytes "
            f"of JSON, {records} records): nothing was left at that path. The workers are "
            f"stopped and the records are kept: make room in {folder!r} (or fix the cause) "
            f"and call close() again to write the trace"))


# --- a batch's layout (shared/layout.py) ---------------------------------------------


class CollateError(LoaderError, ValueError):
    """Samples of a batch cannot be stacked into one layout."""


class BatchMismatch(CollateError, RuntimeError):
    """The samples of a batch differ in structure or shape (torch's
    default_collate raises RuntimeError there, so this is one too)."""


class UnsupportedLeaf(CollateError, TypeError):
    """A leaf shared memory cannot hold as it is: an array of Python
    objects, an ndarray subclass (torch's default_collate raises
    TypeError there, so this is one too)."""


# --- datasets: files, Parquet ---------------------------------------------------------


class NotARegularFile(LoaderError, OSError):
    """A dataset path is a FIFO, a device, a socket or a directory where a
    regular file was listed (replaced after the epoch's list was made)."""


class ParquetFileError(LoaderError, ValueError):
    """A file cannot be read as Parquet (corrupt, truncated, empty); the
    message names it."""


class ParquetFileChanged(LoaderError, RuntimeError):
    """A file was rewritten after the epoch's snapshot of its row groups
    (other size or mtime, other schema, fewer row groups or rows): its rows
    cannot be delivered as planned.  The message names the file, the row
    group and both counts."""


# --- data in an object store (datasets/remote/) ------------------------------------
# They say what, where (the object's URL, the endpoint, the HTTP status) and
# what to do.  Raised by the worker that needed the object, so next() raises
# them on the batch that needed it (and at construction, for the listing).


class RemoteError(LoaderError, OSError):
    """Base of every object-store error."""

    kind = "remote"
    advice = "check the URL, the endpoint and the credentials"

    def __init__(self, what: str, *, url: str = "", endpoint: str = "", status: int | None = None):
        where = ", ".join(p for p in (f"url {url}" if url else "",
                                      f"endpoint {endpoint}" if endpoint else "",
                                      f"HTTP {status}" if status is not None else "") if p)
        super().__init__(f"{what}" + (f" ({where})" if where else "") + f": {self.advice}")
        self.url, self.endpoint, self.status = url, endpoint, status

    def __reduce__(self):
        return (_remake_remote, (type(self).__name__, self.args[0], self.url, self.endpoint,
                                 self.status))


class ObjectNotFound(RemoteError, FileNotFoundError):
    """The object is not in the store (404): removed after it was listed."""
    kind = "not_found"
    advice = ("it was listed, then removed from the store; it is dropped from the next epoch's "
              "listing")


class ObjectChanged(RemoteError):
    """The object changed after it was listed (its ETag differs; 412)."""
    kind = "changed"
    advice = ("it was replaced in the store after it was listed; the next epoch's listing has "
              "the new version")


class TruncatedObject(RemoteError):
    """The body ended before the object's length, also after retries."""
    kind = "truncated"
    advice = "the connection was cut repeatedly; check the network or the endpoint"


class AccessDenied(RemoteError, PermissionError):
    """The store refused the credentials (401, 403)."""
    kind = "denied"
    advice = ("set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), or pass "
              "storage_options, with read and list access to this bucket")


class EndpointUnreachable(RemoteError, ConnectionError):
    """No answer from the endpoint before the deadline."""
    kind = "unreachable"
    advice = ("check AWS_ENDPOINT_URL (AWS_ALLOW_HTTP=true for a plain-http endpoint), the "
              "network and the server")


class Throttled(RemoteError):
    """The store kept answering 503 (slow down) after backing off."""
    kind = "throttled"
    advice = "the store is throttling requests: use fewer fetchers or requests in flight"


class CacheFull(RemoteError):
    """The cache's disk is full (ENOSPC) and nothing in the cache can be
    evicted: every object in it is still needed by a live job."""
    kind = "cache_full"
    advice = ("free space on the cache's disk, lower cache_limit_bytes to what the disk holds, "
              "or point cache_dir at a larger disk")


class FetcherDied(RemoteError):
    """The fetcher process ended without being asked to."""
    kind = "fetcher_died"
    advice = "its last words are above; the loader must be made again"


# RemoteError's classes by their `kind`, the name a board slot carries them by
REMOTE_ERRORS_BY_KIND = {cls.kind: cls for cls in (
    RemoteError, ObjectNotFound, ObjectChanged, TruncatedObject, AccessDenied,
    EndpointUnreachable, Throttled, CacheFull, FetcherDied)}


def remote_error_of(kind: str, text: str, url: str, endpoint: str, status) -> RemoteError:
    """The RemoteError a fetcher reported by its kind (over the board or a
    message), with its text as it was made."""
    cls = REMOTE_ERRORS_BY_KIND.get(kind, RemoteError)
    err = cls.__new__(cls)
    OSError.__init__(err, text)
    err.url, err.endpoint, err.status = url, endpoint, status
    return err


def _remake_remote(name: str, text: str, url: str, endpoint: str, status):
    cls = next(c for c in REMOTE_ERRORS_BY_KIND.values() if c.__name__ == name)
    return remote_error_of(cls.kind, text, url, endpoint, status)


class CacheError(LoaderError, OSError):
    """The cache directory cannot be used (not writable, a corrupt index
    that cannot be rebuilt, no room at all)."""


class NoRoom(LoaderError):
    """Nothing more fits now: every byte of the cache is pinned by live jobs
    (or being fetched), and this job has its overflow object already.
    ObjectCache's answer to its fetcher, which waits and tries again: it
    never reaches the training loop, so it is not exported."""

    def __init__(self, needed: int, used: int, limit: int):
        super().__init__(f"{needed} bytes do not fit: {used} of {limit} bytes are in use by "
                         f"objects live jobs still need")
        self.needed, self.used, self.limit = needed, used, limit


# --- warnings ---------------------------------------------------------------------------


class DataStallWarning(LoaderWarning, UserWarning):
    """The training loop spent most of an epoch waiting for batches.  The
    message says which part of the loader was the bottleneck and what to
    change; ShmLoader.stats() has the figures.  Silence it with
    warnings.filterwarnings("ignore", category=loader.DataStallWarning)."""


class LoaderReplacedWarning(LoaderWarning, UserWarning):
    """A framework rebuilt a loader.DataLoader as another class: its batches
    do not come from ShmLoader's workers."""


class KeptBatchesShared(LoaderWarning, RuntimeWarning):
    """A fork happened while batches were held and some could not be moved
    out of the pool first: the child's views of them may change."""


class InexactResumeWarning(LoaderWarning, UserWarning):
    """load_state_dict() cannot resume a dataset's own state exactly: the
    text names the dataset and says why (NOTE [ Datasets that keep their
    own state ] in datasets/own_state.py)."""


# --- a worker's exception, raised in main ----------------------------------------------


class _KeyErrorMessage(str):
    """KeyError shows repr() of its argument; this keeps a traceback
    readable (PyTorch does the same)."""

    def __repr__(self):
        return self


def raise_reported(msg, index=None):
    """Raise what a worker (or the batcher) reported in a Failed message:
    its exception's own type when main can build one with a message, as
    PyTorch does, with the worker's traceback in the message; else
    WorkerError.  index: the dataset index, when main knows it and the
    message does not (the batcher knows positions only).  The user's own
    exceptions stay theirs: see the module's docstring."""
    err = msg.error
    if msg.index is not None:
        index = msg.index
    if index is not None:
        at = f" on sample index {index} (position {msg.pos})"
    elif msg.batch is not None:
        at = f" on batch {msg.batch}"
    else:
        at = ""
    text = f"Caught {err.type_name} {err.where} (pid {msg.pid}){at}.\nOriginal {err.text}"
    exc_type = err.exception_type()
    if exc_type is KeyError:
        text = _KeyErrorMessage(text)
    try:
        exc = exc_type(text) if exc_type is not None else None
    except Exception:
        exc = None
    if not isinstance(exc, BaseException):
        raise WorkerError(text)
    raise exc
