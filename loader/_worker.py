"""Worker processes: claim units of a run, load them, and place each sample
in its row (NOTE [ Direct row writes ] in _table.py).  See NOTE [ Runs ] in
_control.py for how runs are started and ended without messages."""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass

import numpy as np

import shmq
from loader import _control as C
from loader import _protocol as P
from loader._layout import CollateError
from loader._shared import LoaderConfig, SharedState
from loader._table import ENDED, SEQ, RowWriter

_worker_info = None


@dataclass(frozen=True)
class WorkerInfo:
    id: int
    num_workers: int
    seed: int
    dataset: object


def get_worker_info() -> WorkerInfo | None:
    """Inside a worker: its id, the number of workers, its seed for the
    current epoch and its copy of the dataset.  None in the main process."""
    return _worker_info


def worker_seed(base_seed: int, epoch: int, worker_id: int) -> int:
    """Distinct per worker and per epoch, the same across runs for the same
    base seed."""
    return int(np.random.SeedSequence([base_seed, epoch, worker_id]).generate_state(1, np.uint64)[0] >> 1)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)


def exit_if_orphaned(parent_pid: int) -> None:
    """The fallback to the parent-death signal, checked between bounded waits."""
    if os.getppid() != parent_pid:
        os._exit(1)


class Channel:
    """A worker's messages to the collator (each followed by a ring of the
    collator's bell) and its waits for table entries."""

    def __init__(self, shared: SharedState, worker_id: int, parent_pid: int):
        self.ring, self.control, self.table = shared.to_collator, shared.control, shared.table
        self.me, self.pid, self.parent_pid = worker_id, os.getpid(), parent_pid

    def send(self, msg) -> None:
        self.ring.put(msg)
        self.control.collator_bell.ring()

    def request_layout(self, run, batch, row, sig, version, rows, batched):
        self.send(P.LayoutRequest(run, batch, row, sig, version, rows, batched))

    def row_values(self, run, batch, row, values_key, values):
        self.send(P.RowValues(run, batch, row, values_key, values))

    def filled(self, run, batch):
        self.send(P.Filled(run, batch))

    def sample_row(self, run, batch, row, pos, sample, version):
        self.send(P.SampleRow(run, batch, row, pos, sample, version))

    def failed(self, run, batch, pos, index, exc: BaseException, note=""):
        self.send(P.Failed(run, batch, pos, index, self.me, self.pid, P.ErrorReport.of(exc, note)))

    def done(self, run):
        self.send(P.Done(run, self.me))

    def wait_for_entry(self, run, base, seq_seen) -> bool:
        """Until the table entry at `base` changes (its SEQ word), or the run
        ended.  False if it ended."""
        c, words = self.control, self.table.words

        def ready():
            return not c.live(run) or c.stopped or shmq.atomic_load(words, base + SEQ) != seq_seen

        while not c.table_bell.wait(ready, P.IDLE_SLICE_S):
            exit_if_orphaned(self.parent_pid)
        return c.live(run) and not c.stopped


class Worker:
    def __init__(self, cfg: LoaderConfig, shared: SharedState, worker_id: int):
        self.cfg, self.shared, self.id = cfg, shared, worker_id
        self.control = shared.control
        self.channel = Channel(shared, worker_id, cfg.parent_pid)
        self.writer = RowWriter(shared.table, shared.arena, shared.hazards, worker_id, self.channel)
        self.init_pending = cfg.worker_init_fn is not None

    def run(self) -> None:
        torch = sys.modules.get("torch")
        if torch is not None:
            # One intra-op thread per worker, as PyTorch's workers have: the
            # parent's thread pool does not survive the fork.
            torch.set_num_threads(1)
        seen = 0
        while (latest := self._wait_for_run(seen)) is not None:
            for run in range(seen + 1, latest + 1):
                self._one_run(run)
                self.channel.done(run)  # after this worker's last write into the run
            seen = latest

    def _wait_for_run(self, seen: int) -> int | None:
        c = self.control
        ready = lambda: c.stopped or c.latest_run() > seen  # noqa: E731
        while not c.run_bell.wait(ready, P.IDLE_SLICE_S):
            exit_if_orphaned(self.cfg.parent_pid)
        return None if c.stopped else c.latest_run()

    def _one_run(self, run: int) -> None:
        global _worker_info
        c, cfg = self.control, self.cfg
        if not c.live(run):
            return
        epoch = c.read(run, C.EPOCH)
        seed = worker_seed(cfg.seed, epoch, self.id)
        _worker_info = WorkerInfo(self.id, cfg.num_workers, seed, cfg.dataset)
        seed_everything(seed)
        if self.init_pending:
            self.init_pending = False
            try:
                cfg.worker_init_fn(self.id)
            except Exception as e:
                self.channel.failed(run, -1, -1, -1, e, "in worker_init_fn")
                return
        if cfg.iterable:
            self._iterable_run(run)
        else:
            self._map_run(run, self._order(run))

    def _order(self, run: int) -> np.ndarray | None:
        c = self.control
        kept, kind = c.read(run, C.KEPT), c.read(run, C.ORDER)
        if kind == C.ORDER_RANGE:
            return None
        if kind == C.ORDER_PERMUTATION:
            rng = np.random.default_rng([c.read(run, C.ORDER_SEED), c.read(run, C.EPOCH)])
            return rng.permutation(c.read(run, C.SIZE))[:kept]
        return self.shared.read_order(run, kept)

    def _wait_to_load(self, run: int, unit: int) -> bool:
        """Until unit is below main's limit (prefetch); False if the run ended."""
        c = self.control
        if unit < c.limit(run):
            return True
        ready = lambda: unit < c.limit(run) or not c.live(run) or c.stopped  # noqa: E731
        while not c.limit_bell.wait(ready, P.IDLE_SLICE_S):
            exit_if_orphaned(self.cfg.parent_pid)
        return unit < c.limit(run) and c.live(run) and not c.stopped

    def _claim(self, run: int, units: int) -> int:
        """The next unit to load, -1 when there is none (all claimed, or
        the run ended).  A unit past the end is never waited for."""
        unit = self.control.claim(run)
        if unit < 0 or unit >= units or not self._wait_to_load(run, unit):
            return -1
        return unit

    def _slot(self, run: int, unit: int, kept: int):
        """(batch, row, rows of that batch) of a unit, or None if the run
        ended.  In first-ready mode the k-th unit ready goes to place k."""
        B = self.cfg.batch_size
        if not self.cfg.in_order:
            unit = self.control.claim(run, C.ARRIVED)
            if unit < 0:
                return None
        if self.cfg.per_batch:
            return unit, 0, 1
        batch, row = divmod(unit, B)
        return batch, row, min(B, kept - batch * B)

    def _map_run(self, run: int, order) -> None:
        c, cfg, B = self.control, self.cfg, self.cfg.batch_size
        units, kept = c.read(run, C.UNITS), c.read(run, C.KEPT)
        index_of = (lambda p: p) if order is None else (lambda p: int(order[p]))  # noqa: E731
        while (unit := self._claim(run, units)) >= 0:
            positions = range(unit * B, min(kept, unit * B + B)) if cfg.per_batch else (unit,)
            batch = (unit if cfg.per_batch else unit // B) if cfg.in_order else -1
            samples = []
            for p in positions:
                try:
                    samples.append(cfg.dataset[index_of(p)])
                except Exception as e:
                    self.channel.failed(run, batch, p, index_of(p), e)
                    break
            else:
                if not self._place(run, unit, kept, samples, batch, index_of(positions[0])):
                    return

    def _place(self, run, unit, kept, samples, failed_batch, first_index) -> bool:
        """Collate (per batch) and place; False once the run ended."""
        cfg = self.cfg
        try:
            sample = cfg.collate_fn(samples) if cfg.per_batch else samples[0]
        except Exception as e:
            self.channel.failed(run, failed_batch, -1, -1, e, "in collate_fn")
            return True
        slot = self._slot(run, unit, kept)
        if slot is None:
            return False
        batch, row, rows = slot
        try:
            return self.writer.place(run, batch, row, rows, unit, sample,
                                     batched=not cfg.per_batch) != ENDED
        except CollateError as e:
            at = f"the sample at index {first_index}" if not cfg.per_batch else f"batch {batch}"
            self.channel.failed(run, failed_batch, -1 if cfg.per_batch else unit,
                                -1 if cfg.per_batch else first_index, e,
                                f"while placing {at} in its batch")
            return True

    def _iterable_run(self, run: int) -> None:
        cfg, B = self.cfg, self.cfg.batch_size
        pending = []
        try:
            for sample in cfg.dataset:
                if not self.control.live(run) or self.control.stopped:
                    return
                if cfg.per_batch:
                    pending.append(sample)
                    if len(pending) < B:
                        continue
                    samples, pending = pending, []
                else:
                    samples = [sample]
                if not self._iterable_place(run, samples):
                    return
            if pending and not cfg.drop_last:
                self._iterable_place(run, pending)
        except Exception as e:
            self.channel.failed(run, -1, -1, -1, e, "while iterating the dataset")

    def _iterable_place(self, run, samples) -> bool:
        cfg, B = self.cfg, self.cfg.batch_size
        arrival = self.control.claim(run, C.ARRIVED)
        if arrival < 0 or not self._wait_to_load(run, arrival):
            return False
        try:
            sample = cfg.collate_fn(samples) if cfg.per_batch else samples[0]
        except Exception as e:
            self.channel.failed(run, -1, -1, -1, e, "in collate_fn")
            return True
        batch, row, rows = (arrival, 0, 1) if cfg.per_batch else (*divmod(arrival, B), B)
        try:
            return self.writer.place(run, batch, row, rows, arrival, sample,
                                     batched=not cfg.per_batch) != ENDED
        except CollateError as e:
            self.channel.failed(run, -1, -1, -1, e, "while placing a sample in its batch")
            return True


def worker_main(cfg: LoaderConfig, shared: SharedState, worker_id: int) -> None:
    Worker(cfg, shared, worker_id).run()
    shared.to_collator.close()
