"""Batched fetch: a dataset's __getitems__(indices), called once per batch
instead of dataset[i] once per sample.

NOTE [ Batched fetch ]
torch's rule (_MapDatasetFetcher in torch/utils/data/_utils/fetch.py): a
map-style dataset whose __getitems__ exists and is truthy, loaded with
automatic batching (a batch_size or a batch sampler), gets one
__getitems__(list_of_indices) call per batch; it returns a list of the
batch's samples, in the indices' order.  torch's Subset and StackDataset
and Hugging Face's datasets.Dataset define it; for an Arrow table one
slice is many times faster than a Python call per row.

Here the same rule holds with workers (ShmLoader, in order and first-ready,
and loader.DataLoader) and with num_workers=0.  With workers, a run whose
dataset fetches in batches claims whole batches (LoaderSpec.claims_batches in
shared/spec.py), and the worker writes each returned sample straight into its row (NOTE
[ Direct row writes ] in shared/table.py), tagged with its position as a
per-sample load is, so state_dict() resumes mid-epoch exactly as before.

reproducible=True seeds random, numpy's global generator and torch's once
per call, from (seed, epoch, BATCH_STREAM, the batch's first dataset
index): the first index rather than the batch's number or position, because
those are renumbered when a state_dict() resumes an epoch, while a batch's
indices are not.  A batch's draws so depend neither on the worker that
loads it nor on the worker count.
"""

from __future__ import annotations

import numpy as np

from loader.shared.trace import now

# The derived_seeds stream of batch calls: apart from stream 0 (one sample
# of a map-style dataset) and 1..W (worker w's stream of an iterable one).
BATCH_STREAM = 1 << 63

_SHOWN_INDICES = 16  # the indices an error message lists (a batch may hold thousands)


class Fetcher:
    """How a unit's samples are loaded: dataset[i] per position,
    __getitems__(indices) per batch, or next(it) per stream sample, each
    seeded first when reproducible=True.  The workers load through it and
    so does num_workers=0 (main/inline.py), as torch's workers and its main
    process share the fetchers of torch/utils/data/_utils/fetch.py."""

    def __init__(self, dataset, seeder=None, *, tracer=None, noted: bool = False):
        """seeder: a SampleSeeder (reproducible=True), else None; tracer: a
        worker's Tracer when traced (NOTE [ Trace records ]); noted: an
        error of __getitems__ gets a note naming the batch's indices (raised
        as it is; a worker names them in its report instead)."""
        self.dataset, self.seeder, self.tracer, self.noted = dataset, seeder, tracer, noted

    def positions(self, epoch: int, index_of):
        """load(pos): the sample at position pos of the epoch's order,
        dataset[index_of(pos)].  Made once per run, so a sample costs one
        call (the per-sample path of every worker)."""
        dataset, seeder = self.dataset, self.seeder
        if seeder is None:
            def load(pos):
                return dataset[index_of(pos)]
        else:
            def load(pos):
                index = index_of(pos)  # a sampler's non-int index: seeded by its position
                seeder(epoch, 0, index if type(index) is int else pos | (1 << 62))
                return dataset[index]
        return load if self.tracer is None else self.tracer.traced_load(load, epoch, index_of)

    def stream(self, it, epoch: int, stream: int):
        """load(seq): the stream's next sample, its seq-th (seeded by that
        number, in the stream's own derived_seeds stream)."""
        seeder = self.seeder
        if seeder is None:
            def load(seq):
                return next(it)
        else:
            def load(seq):
                seeder(epoch, stream, seq)
                return next(it)
        return load if self.tracer is None else self.tracer.traced_load(load, epoch)

    def batch(self, epoch: int, indices: list, start: int) -> list:
        """One __getitems__ call for a batch whose first position is start."""
        dataset = self.dataset
        if self.seeder is not None:
            seed_call(self.seeder, epoch, indices, start)
        t0 = now() if self.tracer is not None else 0
        try:
            samples = dataset.__getitems__(indices)
        except Exception as e:
            if self.noted:
                add_note(e, where(dataset, indices))
            raise
        samples = checked(dataset, indices, samples)
        if self.tracer is not None:
            self.tracer.load(t0, now(), index=None, position=start, samples=len(samples),
                             epoch=epoch)
        return samples


def batch_fetcher(dataset, batch_size, iterable: bool):
    """The dataset's __getitems__ when torch's rule says to use it (see
    NOTE [ Batched fetch ]), else None."""
    if iterable or batch_size is None:
        return None
    fetch = getattr(dataset, "__getitems__", None)
    return fetch if fetch else None


def seed_call(seeder, epoch: int, indices: list, start: int) -> None:
    """reproducible=True: seed the generators for one call, from its
    first index (a sampler's non-int index: the batch's first position)."""
    first = indices[0]
    seeder(epoch, BATCH_STREAM, first if type(first) is int else start | (1 << 62))


def indices_of(order, start: int, stop: int) -> list:
    """The dataset indices at positions [start, stop) of a run's order, as
    torch's BatchSampler hands them over: a list (of ints, or of the
    sampler's own index objects)."""
    if order is None:
        return list(range(start, stop))
    chunk = order[start:stop]  # an array (written out, computed or streamed) or a list
    return chunk.tolist() if isinstance(chunk, np.ndarray) else list(chunk)


def describe(indices: list) -> str:
    """The indices for an error message, the first few if there are many."""
    if len(indices) <= _SHOWN_INDICES:
        return repr(indices)
    head = ", ".join(repr(i) for i in indices[:_SHOWN_INDICES])
    return f"[{head}, ... ({len(indices)} indices)]"


def checked(dataset, indices: list, samples):
    """What __getitems__ returned, if it is a list of one sample per
    index (torch's contract); else a TypeError or ValueError saying what
    came back and what it should be."""
    name = type(dataset).__qualname__
    if not isinstance(samples, list):
        raise TypeError(
            f"{name}.__getitems__({describe(indices)}) returned {type(samples).__qualname__}, "
            f"not a list: it must return a list of {len(indices)} samples, one per index "
            f"(torch's contract for __getitems__); to load sample by sample, remove "
            f"__getitems__ or set it to None")
    if len(samples) != len(indices):
        raise ValueError(
            f"{name}.__getitems__({describe(indices)}) returned a list of {len(samples)} "
            f"samples for {len(indices)} indices: it must return one sample per index, "
            f"in the indices' order")
    return samples


def where(dataset, indices: list) -> str:
    """Where an error in a batch call happened, for its report."""
    return f"in {type(dataset).__qualname__}.__getitems__ on indices {describe(indices)}"


def add_note(error: BaseException, note: str) -> None:
    """error.add_note(note) where Python has it (3.11+).  Python 3.10 has no
    add_note, and calling it there raised AttributeError in place of the
    dataset's own error; PEP 678's convention for 3.10 is the same
    __notes__ list (3.10's traceback does not print it; code that reads
    notes, and backports such as exceptiongroup, do)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", ()), note]
