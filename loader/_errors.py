"""The loader's own exceptions (an exception raised in dataset[i] reaches
the training loop as its own type: see ShmLoader._raise_failed)."""


class WorkerError(RuntimeError):
    """A worker or the batcher died, or raised an exception that cannot be
    raised again in main with its own type.  The message carries the
    traceback (or the signal or exit code), the worker id and its pid."""


class LoaderTimeout(WorkerError, TimeoutError):
    """No batch arrived within the loader's ``timeout``."""
