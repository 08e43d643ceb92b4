"""num_workers=0: the epoch is loaded in the main process, in the order and
with the collate rules the workers follow, as PyTorch's DataLoader does
without workers."""

from __future__ import annotations

import random
import sys

import numpy as np

from loader import _order as O
from loader._layout import Layout, LayoutCache, materialize, signature_and_leaves, stack
from loader._worker import SampleSeeder


class _SavedGenerators:
    """reproducible=True seeds the global generators before each sample;
    in the main process they are the training loop's too (dropout, its own
    shuffles), so their states are put back after each batch."""

    def __init__(self):
        torch = sys.modules.get("torch")
        self.torch = torch
        self.states = (random.getstate(), np.random.get_state(),
                       torch.get_rng_state() if torch is not None else None)

    def restore(self):
        random.setstate(self.states[0])
        np.random.set_state(self.states[1])
        if self.torch is not None:
            self.torch.set_rng_state(self.states[2])


class InlineEpoch:
    def __init__(self, loader, epoch: int, resume: dict | None):
        self.loader, self.epoch, self.resume = loader, epoch, resume
        self.cache = LayoutCache()
        self.seeder = SampleSeeder(loader.seed) if loader.reproducible else None

    def batches(self):
        ld = self.loader
        plan = ld._plan(self.epoch, self.resume)
        progress = ld._track(plan)
        if ld.iterable:
            yield from self._stream(progress)
            return
        order = plan.shipped
        if order is None:
            order = O.rank_order(plan.order_kind, plan.size, plan.order_seed, self.epoch,
                                 ld._rank, ld._world)
            order = None if order is None else order[:plan.kept]
        geometry = O.Batches(plan.kept, ld._rows, plan.offsets)
        progress.batches = geometry
        for k in range(plan.nbatches):
            start, stop = geometry.span(k)
            saved = _SavedGenerators() if self.seeder is not None else None
            try:
                samples = [self._load(pos if order is None else int(order[pos]))
                           for pos in range(start, stop)]
            finally:
                if saved is not None:
                    saved.restore()
            batch = self._collate(k, samples)
            progress.mark_batch(k)
            yield batch

    def _load(self, index: int):
        if self.seeder is not None:
            self.seeder(self.epoch, 0, index)
        return self.loader.dataset[index]

    def _stream(self, progress):
        ld = self.loader
        B = ld._rows
        pending, seq, k = [], 0, 0
        skip = progress.prefix[0]  # a resumed epoch: samples delivered already
        it = iter(ld.dataset)
        while True:
            saved = _SavedGenerators() if self.seeder is not None else None
            try:
                if self.seeder is not None:
                    self.seeder(self.epoch, 1, seq)
                try:
                    sample = next(it)
                except StopIteration:
                    break
            finally:
                if saved is not None:
                    saved.restore()
            seq += 1
            if seq <= skip:
                continue
            pending.append(sample)
            if len(pending) == B:
                batch = self._collate(k, pending)
                pending, k = [], k + 1
                progress.mark_batch(0)
                yield batch
        if pending and not ld.drop_last:
            batch = self._collate(k, pending)
            progress.mark_batch(0)
            yield batch
        progress.complete = True

    def _collate(self, k: int, samples: list):
        ld = self.loader
        if ld.collate_fn is not None:
            out = ld.collate_fn(samples)
            if ld._torch_rules:
                return out  # as PyTorch returns it
            return self._convert(out)
        if ld.batch_size is None:
            return self._convert(samples[0])
        spec, buf = stack(samples, self.cache, batch=k)
        return materialize(spec, buf, ld.output, ld._torch_rules)

    def _convert(self, obj):
        """An unbatched value (batch_size=None, or a collate_fn's output)
        with its arrays made what the loader's output asks for."""
        sig, leaves = signature_and_leaves(obj)
        layout = self.cache.get(sig, 1, batched=False)
        buf = np.empty(layout.nbytes, np.uint8)
        values = layout.write_row(buf, 0, leaves)
        return materialize(layout.spec(1, {0: values}), buf, self.loader.output,
                           self.loader._torch_rules)
