"""Worker processes: run dataset[i] (or iterate an iterable dataset) and
send each sample to the collator.  See NOTE [ ShmLoader processes and
shutdown ] in _protocol.py."""

from __future__ import annotations

import ctypes
import faulthandler
import os
import random
import signal
import sys
import time
import traceback
from dataclasses import dataclass

import numpy as np

import shmq
from loader import _protocol as P
from loader._table import RowWriter

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


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies, and
    ignore Ctrl-C (main handles it); see the NOTE in _protocol.py."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    exit_if_orphaned(parent_pid)  # the parent may have died before prctl took effect
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def exit_if_orphaned(parent_pid: int) -> None:
    """The fallback to PR_SET_PDEATHSIG, checked between bounded waits."""
    if os.getppid() != parent_pid:
        os._exit(1)


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


def _next_task(tasks: shmq.Queue, parent_pid: int):
    while True:
        try:
            return tasks.get(timeout=P.WAIT_SLICE_S)
        except shmq.Empty:
            exit_if_orphaned(parent_pid)


def _run_task(tasks, parent_pid):
    """The next run as (run, epoch, order or None, base seed), or None to
    stop.  An order arrives in chunks so that no message outgrows the ring."""
    chunks = []
    while True:
        msg = _next_task(tasks, parent_pid)
        if msg[0] == P.STOP:
            return None
        _, run, epoch, chunk, base_seed, last = msg
        if chunk is not None:
            chunks.append(chunk)
        if last:
            order = np.concatenate(chunks) if chunks else None
            return run, epoch, order, base_seed


class _Sender:
    """How a worker hands a sample over: straight into its row when its
    batch is published with the sample's layout, else through the ring
    (NOTE [ Direct row writes ] in _table.py)."""

    def __init__(self, to_collator, ctl, run, batch_size, first_ready, writer: RowWriter | None):
        self.ring, self.ctl, self.run, self.batch_size = to_collator, ctl, run, batch_size
        self.first_ready, self.writer = first_ready, writer

    def send(self, pos, sample, arrival=None):
        """arrival: the sample's place in arrival order, if already claimed."""
        run = self.run
        if arrival is None and self.first_ready:
            arrival = P.claim(self.ctl, P.ARRIVED, run)
            if arrival < 0:
                return  # main abandoned the run
        batch, row = divmod(pos if arrival is None else arrival, self.batch_size)
        written = None if self.writer is None else self.writer.try_write(run, batch, row, sample)
        if written is None:
            self.ring.put((P.SAMPLE, run, pos, batch, row, sample))
            return
        rows, values = written
        if values:
            self.ring.put((P.VALUES, run, batch, row, values))
        if self.writer.table.count(run, batch) == rows:
            self.ring.put((P.FILLED, run, batch))


def worker_main(worker_id, num_workers, dataset, tasks, to_collator, ctl, table, arena,
                batch_size, in_order, direct, worker_init_fn, stack_file, parent_pid):
    global _worker_info
    die_with_parent(parent_pid)
    writer = RowWriter(table, arena) if direct else None
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    init_pending = worker_init_fn is not None
    while (task := _run_task(tasks, parent_pid)) is not None:
        run, epoch, order, base_seed = task
        seed = worker_seed(base_seed, epoch, worker_id)
        _worker_info = WorkerInfo(worker_id, num_workers, seed, dataset)
        seed_everything(seed)
        try:
            if init_pending:
                init_pending = False
                try:
                    worker_init_fn(worker_id)
                except Exception:
                    _report(to_collator, run, -1, -1, worker_id)
            _wait_until_laid_out(ctl, run, parent_pid)
            sender = _Sender(to_collator, ctl, run, batch_size,
                             not in_order and order is not None, writer)
            if order is None:  # main sends no order for an iterable dataset
                _run_iterable(run, worker_id, dataset, sender, ctl, parent_pid)
            else:
                _run_map(run, worker_id, dataset, order, sender, ctl, parent_pid)
        except _Failed:
            pass  # reported to the collator; main raises it
        to_collator.put((P.DONE, run, worker_id))  # after this worker's last write of the run
    tasks.close()
    to_collator.close()
    os._exit(0)


class _Failed(Exception):
    """A sample (or worker_init_fn) raised; the error is already sent."""


def _report(to_collator, run, pos, index, worker_id):
    to_collator.put((P.ERROR, run, pos, index, worker_id, os.getpid(), traceback.format_exc()))
    raise _Failed


def _wait_until_laid_out(ctl, run, parent_pid):
    """Until the collator has published the run's first batches (or the
    run ended): a row written before would have to take the ring."""
    ready = P.slot(run, P.READY)
    while ctl[ready] != run and P.live(ctl, run):
        time.sleep(0.0002)
        exit_if_orphaned(parent_pid)


def _claim_position(ctl, run, parent_pid):
    """The next position, after waiting until main allows it (prefetch);
    -1 once the run has ended."""
    pos = P.claim(ctl, P.CURSOR, run)
    limit = P.slot(run, P.LIMIT)
    while pos >= ctl[limit]:
        if not P.live(ctl, run):
            return -1
        time.sleep(0.0005)
        exit_if_orphaned(parent_pid)
    return pos


def _run_map(run, worker_id, dataset, order, sender, ctl, parent_pid):
    n = len(order)
    while 0 <= (pos := _claim_position(ctl, run, parent_pid)) < n:
        index = int(order[pos])
        try:
            sender.send(pos, dataset[index])
        except Exception:  # the dataset's, or a sample the ring cannot take (MessageTooLarge)
            _report(sender.ring, run, pos, index, worker_id)


def _run_iterable(run, worker_id, dataset, sender, ctl, parent_pid):
    """Positions are claimed once a sample is ready: they are its arrival order."""
    try:
        for sample in dataset:
            arrival = _claim_position(ctl, run, parent_pid)
            if arrival < 0:
                return
            sender.send(-1, sample, arrival)
    except Exception:
        _report(sender.ring, run, -1, -1, worker_id)
