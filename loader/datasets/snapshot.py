"""NOTE [ Datasets that change with the epoch ]
=============================================

A dataset may define two methods to see each epoch as a whole:

    snapshot = dataset.epoch_snapshot(info)     # in main, as the epoch starts
    dataset.restore_snapshot(snapshot)          # in each worker, before it loads the epoch

`info` is an EpochInfo: the epoch number, the loader's seed, and this
process's rank and the world size (distributed=True).  The snapshot is
any picklable value; it travels with the epoch's run (a memfd, see
SNAPSHOT in NOTE [ Runs ]), so every process of the loader sees the same
one even while the data changes under them.  FileDataset's is the list of
files its glob matches now; ParquetDataset's is the epoch's shuffled row
groups.  With num_workers=0, epoch_snapshot() alone is called (in main,
where the dataset is)."""

from __future__ import annotations

from typing import NamedTuple


class EpochInfo(NamedTuple):
    epoch: int
    seed: int
    rank: int
    world_size: int
