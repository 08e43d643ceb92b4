"""ShmLoader: a zero-copy data loader on shmq.

    from loader import ShmLoader
    for batch in ShmLoader(dataset, batch_size=128, num_workers=4, shuffle=True, seed=0):
        ...   # numpy arrays (or torch tensors) viewing shared memory; no copy, no unpickling

    from loader import DataLoader   # torch.utils.data.DataLoader, on ShmLoader (needs torch)

Linux only; workers are forked.  How it works: docs/architecture.md.

NOTE [ The loader's words ]
===========================

One word per thing, in code, comments, messages and docs:

- epoch: the user's count of passes (iter(loader), or a boundary in
  steps()); it picks the order and the seeds, nothing else.
- run: one pass over the data as the processes carry it out: an epoch,
  or what is left of one after load_state_dict.  Runs have ids never
  reused in a loader's life; two can be live (the next epoch's, started
  ahead).  NOTE [ Runs ] in shared/control.py; main's book of them: main/runs.py.
- plan: what main decided about a run before starting it: the order,
  how positions fall into batches, what the workers claim (order/planning.py);
  the planner draws what it needs from the generators (main/planner.py).
- feed: a user's sampler or batch sampler pulled a window ahead of the
  workers into the run's order file (NOTE [ Streamed samplers ] in
  order/feed.py); an OPEN run is one whose length a feed learns late.
- position: a place in a run's order; index: what dataset[...] gets at
  that position (order[position]).
- unit: what a worker claims at once with the run's CURSOR: a position,
  or a whole batch (a collate_fn, __getitems__, loader.DataLoader).
- LIMIT: main's word that says which units may be loaded now (prefetch
  batches past what the loop has taken).
- arena: the one shared memory region batches live in; slab: one batch's
  bytes in it; the pool: the arena's slabs, at most memory_cap_bytes.
- layout: where each array of a batch goes in its slab, decided from
  the first sample's structure and dtypes (shared/layout.py).
- batcher: the child process that lays batches out: it picks a slab for
  each batch, publishes its layout in the table so that workers write
  rows straight into it, and tells main when every row is written.  It
  writes a row itself only when a sample does not fit the layout.
- table: the shared batch table, one entry per batch in flight (slab
  offset, layout digest, row count) (shared/table.py).
- lease: main's hold on a slab while any array of its batch is alive;
  kept batch: one the loop still holds after asking for the next
  (NOTE [ Kept batch memory ] in native/leases.pxi).
- bell: a futex word a process sleeps on and another rings after a
  change (shmq_sync.h).
- spill: a worker's region for what does not fit a ring message, large
  bytes and str leaves (NOTE [ Spilled messages ] in shared/spill.py).
- session: a started loader's processes and shared memory, from its
  first iter() to its shutdown (main/session.py).
"""

from loader import errors as _errors
from loader.errors import *  # noqa: F401,F403  (every error and warning: errors.__all__)
from loader.datasets.files import FileArray, FileDataset
from loader.main.loader import ShmLoader
from loader.datasets.parquet import ParquetDataset
from loader.worker.seeding import WorkerInfo, get_worker_info
from loader.torch.integrations import ray as _ray_integration

# Ray Train's prepare_data_loader rebuilds loaders as torch's class and wraps
# them: make it keep ShmLoader and DataLoader (loader/torch/integrations/ray.py),
# whenever ray.train.torch is imported (NOTE [ Installing the integrations ]).
_ray_integration.install_when_imported()

__all__ = ["ShmLoader", "DataLoader", "FileDataset", "FileArray", "ParquetDataset",
           "get_worker_info", "WorkerInfo", *_errors.__all__]


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
        from loader.torch.dataloader import DataLoader

        return DataLoader
    raise AttributeError(f"module 'loader' has no attribute {name!r}")
