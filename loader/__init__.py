"""ShmLoader: a zero-copy data loader on shmq.

    from loader import ShmLoader
    for batch in ShmLoader(dataset, batch_size=128, num_workers=4, shuffle=True, seed=0):
        ...   # numpy arrays (or torch tensors) viewing shared memory; no copy, no unpickling

Linux only; workers are forked.
"""

from loader._layout import CollateError
from loader._loader import LoaderTimeout, ShmLoader, WorkerError
from loader._procs import LoaderStartError
from loader._worker import WorkerInfo, get_worker_info

__all__ = ["ShmLoader", "get_worker_info", "WorkerInfo", "WorkerError", "LoaderTimeout",
           "LoaderStartError", "CollateError"]
