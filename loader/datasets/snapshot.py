"""NOTE [ Datasets that change with the epoch ]
=============================================

A dataset may define these methods to see each epoch as a whole:

    snapshot = dataset.epoch_snapshot(info)     # in main, as the epoch starts
    dataset.restore_snapshot(snapshot)          # in each worker, before it loads the epoch
    dataset.epoch_order(snapshot, indices)      # in main, as a run starts: what it loads

`info` is an EpochInfo: the epoch number, the loader's seed, this
process's rank and the world size (distributed=True), and the batch size.
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
the workers): such a dataset fetches as it is asked."""

from __future__ import annotations

from typing import NamedTuple


class EpochInfo(NamedTuple):
    epoch: int
    seed: int
    rank: int
    world_size: int
    batch_size: int | None = None
