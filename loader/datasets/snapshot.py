"""NOTE [ Datasets that change with the epoch ]
=============================================

A dataset may define these methods to see each epoch as a whole:

    snapshot = dataset.epoch_snapshot(info)     # in main, as the epoch starts
    dataset.restore_snapshot(snapshot)          # in each worker, before it loads the epoch
    dataset.epoch_order(snapshot, indices)      # in main, as a run starts: what it loads

`info` is an EpochInfo: the epoch number, the loader's seed, this
process's rank and the world size (distributed=True), the batch size and
the number of workers.
The snapshot is any picklable value; it travels with the epoch's run (a
memfd, see SNAPSHOT in NOTE [ Runs ]), so every process of the loader sees
the same one even while the data changes under them.  epoch_snapshot() may
be called more than once for one epoch (a run started ahead is checked
again when its iter() comes): it returns an equal snapshot unless the data
changed meanwhile.  FileDataset's is the list of files its glob matches
now; ParquetDataset's is the epoch's shuffled row groups; a remote
FileDataset's is a listing on its board (NOTE [ Remote data ]).  With
num_workers=0, epoch_snapshot() alone is called (in main, where the
dataset is).

epoch_order() gets the dataset indices a run will load, in the order the
workers load them (an int64 array; a resumed run's: what is left of it),
for a dataset that fetches ahead of the workers (a remote FileDataset).  It
is not called for a sampler that streams (no len(), or a window ahead of
the workers): such a dataset fetches as it is asked.

A dataset whose epoch a new job cannot take again from the data as it is
then (a remote FileDataset with train_on="cached": its set is what the
cache held as the epoch began) defines three more, so that a state taken
mid-epoch resumes exactly in a new job:

    record = dataset.epoch_record(snapshot)     # in main, at state_dict(): a plain
                                                # picklable dict with the epoch's length
                                                # as "count", or None (nothing needed)
    n = dataset.record_len(record)              # at load_state_dict(): that length,
                                                # checked (ValueError: not its record)
    dataset.resume_epoch(epoch, record)         # then: epoch_snapshot() for that
                                                # epoch returns the recorded one

The loader keeps the record in its state ("dataset_epoch") and checks the
state's length against record_len(), not against len(dataset) now.  A
dataset that remembers the snapshots it gave (to give a run started ahead
the same one again) may define forget_epochs(): load_state_dict() calls it
once it has dropped the loader's runs, before resume_epoch(), so that no
epoch reuses a snapshot a dropped run has read part of.

With worker_mode="thread", main and every worker thread share ONE dataset
object, and two epochs' runs overlap in it: main takes the next epoch's
snapshot for a run started ahead (persistent workers) while the threads
still load this epoch's samples, and a thread that has no more of this run
to claim restores the next epoch's while the others still load this one's.
A sample index means something only in its own epoch's snapshot (a file
list that grew, a cached set that changed), so the view must not be one
attribute all of them overwrite: FileDataset, its remote form and
ParquetDataset keep it in an EpochView, whose value a worker thread sets
(restore_snapshot) and reads for itself alone.  A dataset of your own that
changes with the epoch and runs in thread workers needs the same (an
EpochView, or a threading.local)."""

from __future__ import annotations

import threading
import weakref
from typing import NamedTuple


class EpochInfo(NamedTuple):
    epoch: int
    seed: int
    rank: int
    world_size: int
    batch_size: int | None = None
    num_workers: int | None = None    # the loader's worker processes or threads (0: none)


class EpochView:
    """A dataset's attribute that holds its view of the epoch (FileDataset's
    file list, ParquetDataset's rows of the epoch): assigned in a worker
    thread (worker_mode="thread"), the value is that thread's alone, and
    that thread reads it back; in main and in a worker process it is a plain
    attribute, as before (NOTE [ Datasets that change with the epoch ])."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name
        self.threads = threading.local()   # .views: {id(dataset): (weakref, value)}

    def __get__(self, dataset, owner=None):
        if dataset is None:
            return self
        held = getattr(self.threads, "views", {}).get(id(dataset))
        if held is not None and held[0]() is dataset:
            return held[1]
        try:
            return dataset.__dict__[self.name]
        except KeyError:
            raise AttributeError(f"{type(dataset).__name__!r} object has no attribute "
                                 f"{self.name!r}") from None

    def __set__(self, dataset, value) -> None:
        if not _in_worker_thread():
            dataset.__dict__[self.name] = value
            return
        views = self.threads.__dict__.setdefault("views", {})
        for gone in [k for k, (ref, _) in views.items() if ref() is None]:
            del views[gone]   # (a dataset collected: an id may be reused)
        views[id(dataset)] = (weakref.ref(dataset), value)


def _in_worker_thread() -> bool:
    from loader.worker.seeding import get_worker_info   # (imports the native module)

    info = get_worker_info()
    return info is not None and info.worker_method == "thread"
