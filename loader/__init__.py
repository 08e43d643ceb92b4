"""ShmLoader: a zero-copy data loader on shmq.

    from loader import ShmLoader
    for batch in ShmLoader(dataset, batch_size=128, num_workers=4, shuffle=True, seed=0):
        ...   # numpy arrays (or torch tensors) viewing shared memory; no copy, no unpickling

    from loader import DataLoader   # torch.utils.data.DataLoader, on ShmLoader (needs torch)

Linux only; workers are forked.
"""

from loader._files import FileArray, FileDataset
from loader._layout import BatchMismatch, CollateError, UnsupportedLeaf
from loader._loader import LoaderTimeout, ShmLoader, WorkerError
from loader._parquet import ParquetDataset
from loader._procs import LoaderStartError
from loader._stats import DataStallWarning
from loader._worker import WorkerInfo, get_worker_info
from loader.integrations import ray as _ray_integration

# Ray Train's prepare_data_loader rebuilds loaders as torch's class and wraps
# them: make it keep ShmLoader and DataLoader (loader/integrations/ray.py),
# whenever ray.train.torch is imported (a finder on sys.meta_path until then).
_ray_integration.install_when_imported()

__all__ = ["ShmLoader", "DataLoader", "FileDataset", "FileArray", "ParquetDataset",
           "get_worker_info", "WorkerInfo",
           "WorkerError", "LoaderTimeout", "LoaderStartError", "CollateError", "BatchMismatch",
           "UnsupportedLeaf", "DataStallWarning"]


def __getattr__(name):
    # DataLoader imports torch: only when asked for, so that numpy users of
    # ShmLoader never pay for importing it.
    if name == "DataLoader":
        try:
            import torch  # noqa: F401
        except ImportError as exc:
            raise ModuleNotFoundError(
                "loader.DataLoader is PyTorch's DataLoader running on ShmLoader, so it needs "
                "PyTorch: pip install torch (or use loader.ShmLoader, which does not)",
                name="torch") from exc
        from loader._torch import DataLoader

        return DataLoader
    raise AttributeError(f"module 'loader' has no attribute {name!r}")
