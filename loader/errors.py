"""The loader's own exceptions, and how what a worker reported is raised
in main: an exception raised in dataset[i] reaches the training loop as
its own type (raise_reported)."""

import os


class WorkerError(RuntimeError):
    """A worker or the batcher died, or raised an exception that cannot be
    raised again in main with its own type.  The message carries the
    traceback (or the signal or exit code), the worker id and its pid."""


class LoaderTimeout(WorkerError, TimeoutError):
    """No batch arrived within the loader's ``timeout``."""


class TraceWriteError(OSError):
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


class StateError(ValueError):
    """load_state_dict() refused a state: a field (named by its path, as
    ``map.done_ranges`` or ``stream[1].extra``) is missing, of a wrong type
    or value, one the state's format does not define, or of another
    loader.  The loader is left as it was."""


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
    message does not (the batcher knows positions only)."""
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
