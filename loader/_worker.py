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
from loader._native import ENDED, RowWriter, RunCounters
from loader._table import SEQ

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
        self.counters = RunCounters(shared.control.ctl, C.RUN_BASE, C.RUN_WORDS, C.CURSOR, C.LIMIT,
                                    C.ARRIVED, C.RUN_SHIFT)
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
        c, counters = self.control, self.counters
        if counters.below_limit(run, unit):
            return True
        ready = lambda: counters.below_limit(run, unit) or not c.live(run) or c.stopped  # noqa: E731
        while not c.limit_bell.wait(ready, P.IDLE_SLICE_S):
            exit_if_orphaned(self.cfg.parent_pid)
        return counters.below_limit(run, unit) and c.live(run) and not c.stopped

    def _map_run(self, run: int, order) -> None:
        if self.cfg.per_batch:
            self._batch_run(run, order)
        else:
            self._sample_run(run, order)

    def _sample_run(self, run: int, order) -> None:
        """Default collate: claim a position, load it, place it in its row."""
        c, cfg, counters, place = self.control, self.cfg, self.counters, self.writer.place
        dataset, B, in_order = cfg.dataset, cfg.batch_size, cfg.in_order
        units, kept = c.read(run, C.UNITS), c.read(run, C.KEPT)
        while True:
            pos = counters.claim(run)
            if pos < 0 or pos >= units:  # a unit past the end is never waited for
                return
            if not counters.below_limit(run, pos) and not self._wait_to_load(run, pos):
                return
            index = pos if order is None else int(order[pos])
            try:
                sample = dataset[index]
            except Exception as e:
                self.channel.failed(run, pos // B if in_order else -1, pos, index, e)
                continue
            slot = pos if in_order else counters.claim(run, True)  # first-ready: arrival order
            if slot < 0:
                return
            batch, row = divmod(slot, B)
            try:
                if place(run, batch, row, min(B, kept - batch * B), pos, sample) == ENDED:
                    return
            except CollateError as e:
                self.channel.failed(run, batch if in_order else -1, pos, index, e,
                                    f"while placing the sample at index {index} in its batch")

    def _batch_run(self, run: int, order) -> None:
        """A collate_fn: claim a batch, load its samples, collate them here
        (as PyTorch's workers do), place the output as the batch."""
        c, cfg, counters = self.control, self.cfg, self.counters
        B, in_order = cfg.batch_size, cfg.in_order
        units, kept = c.read(run, C.UNITS), c.read(run, C.KEPT)
        while True:
            unit = counters.claim(run)
            if unit < 0 or unit >= units or not self._wait_to_load(run, unit):
                return
            batch = unit if in_order else -1
            samples = []
            for pos in range(unit * B, min(kept, unit * B + B)):
                index = pos if order is None else int(order[pos])
                try:
                    samples.append(cfg.dataset[index])
                except Exception as e:
                    self.channel.failed(run, batch, pos, index, e)
                    break
            else:
                try:
                    output = cfg.collate_fn(samples)
                except Exception as e:
                    self.channel.failed(run, batch, -1, -1, e, "in collate_fn")
                    continue
                slot = unit if in_order else counters.claim(run, True)
                if slot < 0 or not self._place_output(run, slot, output):
                    return

    def _place_output(self, run: int, slot: int, output) -> bool:
        """Place a collate_fn's output as batch `slot`; False once the run ended."""
        try:
            return self.writer.place(run, slot, 0, 1, -1, output, batched=False) != ENDED
        except CollateError as e:
            self.channel.failed(run, slot if self.cfg.in_order else -1, -1, -1, e,
                                f"while placing the collate_fn output of batch {slot}")
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
        """Place the next sample (or collated batch) of a stream in arrival
        order; False once the run ended."""
        cfg, B = self.cfg, self.cfg.batch_size
        arrival = self.counters.claim(run, True)
        if arrival < 0 or not self._wait_to_load(run, arrival):
            return False
        if cfg.per_batch:
            try:
                output = cfg.collate_fn(samples)
            except Exception as e:
                self.channel.failed(run, -1, -1, -1, e, "in collate_fn")
                return True
            return self._place_output(run, arrival, output)
        batch, row = divmod(arrival, B)
        try:
            return self.writer.place(run, batch, row, B, arrival, samples[0]) != ENDED
        except CollateError as e:
            self.channel.failed(run, -1, -1, -1, e, "while placing a sample in its batch")
            return True


def worker_main(cfg: LoaderConfig, shared: SharedState, worker_id: int) -> None:
    Worker(cfg, shared, worker_id).run()
    shared.to_collator.close()
