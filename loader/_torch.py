"""`from loader import DataLoader`: torch.utils.data.DataLoader, running on
ShmLoader.

It *is* a torch DataLoader (a subclass), so torch's own argument checks,
samplers, attributes, len() and error messages apply unchanged, and code
that checks isinstance(loader, torch.utils.data.DataLoader) accepts it.
Only loading differs: iterating runs ShmLoader's forked workers, which
write samples straight into shared-memory batch slabs, and yields tensors
viewing them.  Batches are those torch gives: the same order for the same
generator or seeds, torch's default_collate structure and dtypes, worker
seeding by torch's rules (base seed drawn from the generator per iterator;
each worker seeded with base_seed + worker id before worker_init_fn), the
original exception type re-raised in main.

What has no meaning here is accepted and documented:
- multiprocessing_context: workers are always forked (the loader's design:
  see NOTE [ ShmLoader processes and shutdown ]); "spawn" and
  "forkserver" are accepted and fork is used.
- pin_memory without an accelerator: a warning, as torch gives.
"""

from __future__ import annotations

import warnings
from typing import TypeVar

import torch
from torch.utils.data import BatchSampler, SequentialSampler
from torch.utils.data import DataLoader as _TorchDataLoader
from torch.utils.data._utils.collate import default_collate, default_convert
from torch.utils.data.dataloader import _DatasetKind

from loader._loader import ShmLoader

__all__ = ["DataLoader"]


_T_co = TypeVar("_T_co", covariant=True)


class DataLoader(_TorchDataLoader[_T_co]):
    """torch.utils.data.DataLoader's signature, defaults and batches, with
    ShmLoader's shared-memory workers underneath.  See the module docstring
    for what differs (nothing a training loop sees)."""

    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None,
                 num_workers=0, collate_fn=None, pin_memory=False, drop_last=False, timeout=0,
                 worker_init_fn=None, multiprocessing_context=None, generator=None, *,
                 prefetch_factor=None, persistent_workers=False, pin_memory_device="",
                 in_order=True):
        self._user_collate_fn = collate_fn
        self._shm = None
        super().__init__(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers,
                         collate_fn, pin_memory, drop_last, timeout, worker_init_fn,
                         multiprocessing_context, generator, prefetch_factor=prefetch_factor,
                         persistent_workers=persistent_workers,
                         pin_memory_device=pin_memory_device, in_order=in_order)

    def _shm_loader(self) -> ShmLoader:
        """The ShmLoader that loads for this DataLoader, made at the first
        iteration (torch's attributes may be read until then)."""
        if self._shm is not None:
            return self._shm
        kwargs = {}
        custom = self._user_collate_fn not in (None, default_collate, default_convert)
        if self._dataset_kind == _DatasetKind.Iterable:
            kwargs["batch_size"] = self.batch_size
            kwargs["drop_last"] = self.drop_last
        else:
            bs = self.batch_sampler
            if bs is None:  # batch_size=None: one sample at a time, not collated
                kwargs["batch_size"] = None
                kwargs["sampler"] = self._order_source(self.sampler)
            elif type(bs) is BatchSampler:  # torch's own: batches are cut from the order
                kwargs["batch_size"] = bs.batch_size
                kwargs["drop_last"] = bs.drop_last
                kwargs["sampler"] = self._order_source(bs.sampler)
            else:  # a user's batch sampler: its batches as they come
                kwargs["batch_sampler"] = bs
        workers = self.num_workers
        shm = ShmLoader(
            self.dataset, num_workers=workers,
            collate_fn=self.collate_fn if custom else None,
            in_order=self.in_order,
            prefetch=(self.prefetch_factor or 2) * max(workers, 1) if workers else None,
            persistent_workers=self.persistent_workers, worker_init_fn=self.worker_init_fn,
            generator=self.generator, reproducible=False,
            timeout=self.timeout if self.timeout > 0 else None,
            output="keep" if custom else "torch", pin_memory=self.pin_memory, **kwargs)
        shm._torch_rules = True
        self._shm = shm
        return shm

    def _order_source(self, sampler):
        """What ShmLoader takes as its sampler: None for torch's default
        sequential order over this dataset (workers compute it), else the
        sampler, iterated in main at each epoch as torch iterates it."""
        if type(sampler) is SequentialSampler and sampler.data_source is self.dataset:
            return None
        return sampler

    def __iter__(self):
        if self.num_workers > 0:
            self.check_worker_number_rationality()  # torch warns at each iterator too
        if self.pin_memory and not torch.accelerator.is_available():
            warnings.warn("'pin_memory' argument is set as true but no accelerator is found, "
                          "then device pinned memory won't be used.", stacklevel=2)
        return _Iterator(self, iter(self._shm_loader()))

    def close(self) -> None:
        """Stop the workers now (they also stop when the DataLoader is
        garbage collected, and at interpreter exit)."""
        if self._shm is not None:
            self._shm.close()

    def state_dict(self) -> dict:
        """The position of the current epoch, to resume it exactly: see
        ShmLoader.state_dict."""
        return self._shm_loader().state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._shm_loader().load_state_dict(state)

    def stats(self) -> dict | None:
        """Where the last complete epoch's time went: see ShmLoader.stats
        (None before one ended)."""
        return None if self._shm is None else self._shm.stats()


class _Iterator:
    """What iter(DataLoader) returns: torch's iterator protocol (len(),
    the warning for an IterableDataset that yields more than its len)."""

    def __init__(self, loader: DataLoader, batches):
        self._loader, self._batches = loader, batches
        self._num_yielded = 0

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._loader._index_sampler)

    def __next__(self):
        data = next(self._batches)
        self._num_yielded += 1
        ld = self._loader
        if (ld._dataset_kind == _DatasetKind.Iterable and ld._IterableDataset_len_called is not None
                and self._num_yielded > ld._IterableDataset_len_called):
            msg = (f"Length of IterableDataset {ld.dataset} was reported to be "
                   f"{ld._IterableDataset_len_called}(when accessing len(dataloader)), but "
                   f"{self._num_yielded} samples have been fetched. ")
            if ld.num_workers > 0:
                msg += ("For multiprocessing data-loading, this could be caused by not properly "
                        "configuring the IterableDataset replica at each worker. Please see "
                        "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                        "for examples.")
            warnings.warn(msg, stacklevel=2)
        return data

    def close(self) -> None:
        self._batches.close()

    def __del__(self):
        batches = getattr(self, "_batches", None)
        if batches is not None:
            batches.close()
