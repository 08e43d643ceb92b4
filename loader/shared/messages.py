"""Messages between the loader's processes, and the shutdown protocol.

NOTE [ ShmLoader processes and shutdown ]
=========================================

                ctl words + bells (NOTE [ Runs ], shared/control.py): runs, cursors, limits, STOP
  main ─────────────────────────────────────────────────────────────────────┐
   ▲                                                                        ▼
   │ BatchReady / StreamEnded / RunEnded / Failed         worker 0..N-1: claim a unit, load it,
   │ / MemoryWait / DatasetState (to_main: SPSC)          write its row (NOTE [ Direct row writes ]
   │                                                      in shared/table.py)
  batcher ◄── LayoutRequest / RowValues / Filled / SampleRow / Failed / Done / Joined ─┘
               / DatasetState (to_batcher: MPSC; Failed and DatasetState go on to main)
   └── lays out slabs in the shared arena and publishes them in the batch table

Main never sends anything: it starts runs, raises limits and stops the
others by storing ctl words and ringing bells, so no state of the children
can block it.  All shared memory is anonymous (shmq.sync.shared_array, memfds,
anonymous queues in memfds) and created before the fork: nothing has a
name, so no crash of any process can leave anything in /dev/shm.  The
rings carry small records only: a message larger than SPILL_BYTES travels
in its sender's region of the spill heap (NOTE [ Spilled messages ] in
shared/spill.py).

Slab leases: the batcher allocates a slab per batch from the arena under
(lease, generation).  Main views the slab through a SlabLease (native/leases.pxi)
and each array leaf through a leaf lease that keeps it alive; when the
last leaf dies, compiled code stores the generation into released[lease]
(release) and rings the batcher's bell, running no Python bytecode, so a
Ctrl-C there is not lost.  The batcher reuses a slab only after its
acquire load sees that store.  Main also releases a slab whose live leaves
it has moved out of the pool (NOTE [ Kept batch memory ] in native/leases.pxi).

The batcher never blocks its loop: it takes messages without waiting,
sleeps only on its bell, and keeps what main's ring cannot take in an
outbox (main rings the bell when it has made room).  A batch that needs
memory the user still holds waits in a queue while other messages are
handled; a batch larger than memory_cap_bytes is refused at once.

Children are forked with os.fork (not multiprocessing, whose exit hooks in
any process forked from main would terminate them), with SIGINT and SIGTERM
blocked across the fork so a Ctrl-C is delivered to main after it, never
lost in an at-fork hook.  Each child ignores SIGINT, and dies with main:

Shutdown, in order of preference:
1. close() / __del__ / interpreter exit (in main only; a process forked
   from main never touches main's loader): STOP is stored and every bell
   rung; every child leaves its loop at its next check (a worker inside
   dataset[i] finishes that sample first); main waits on the children's
   pidfds for up to JOIN_TIMEOUT_S and kills stragglers.  The rings'
   memory goes back when their last handle closes, and the arena's pages
   that no batch you hold uses go back at close.
2. main dies (SIGKILL, SIGTERM...): every child asked the kernel for a
   signal when its parent thread exits (PR_SET_PDEATHSIG), caught in C:
   if the parent *process* is gone (getppid changed) the child exits at
   once, even inside a long C call; if only the thread that forked it
   ended, it carries on.  Bounded waits re-check getppid as a fallback.
3. a child dies: main checks the children's exit status between bounded
   waits (WAIT_SLICE_S) and raises WorkerError naming the process, pid
   and signal, with what the child wrote before it died (an exception
   outside the per-sample try, say).
"""

from __future__ import annotations

import importlib
import traceback
from typing import Any, NamedTuple

WAIT_SLICE_S = 0.1    # main: longest wait before re-checking children and deadlines
IDLE_SLICE_S = 0.5    # children: longest sleep before re-checking their parent
JOIN_TIMEOUT_S = 5.0

# --- worker -> batcher ----------------------------------------------------------


NO_VERSION = -1  # LayoutRequest.version: the worker saw no published entry


class LayoutRequest(NamedTuple):
    """A sample for row `row` found no usable layout for its batch (none
    published, or a provisional one with no row counted): lay the batch out
    with this signature.  version: of the entry the worker saw, NO_VERSION
    if none."""
    run: int
    batch: int
    row: int
    signature: Any
    version: int
    rows: int
    batched: bool


class RowValues(NamedTuple):
    """The non-numeric leaves of a row the worker wrote itself."""
    run: int
    batch: int
    row: int
    values_key: int
    values: object   # a list, or a Spilled block of it (NOTE [ Spilled messages ])


class Filled(NamedTuple):
    """The sender counted the batch's last row."""
    run: int
    batch: int


class SampleRow(NamedTuple):
    """A sample the batcher must place itself: the batch's confirmed layout
    differs from it (promote or refuse)."""
    run: int
    batch: int
    row: int
    pos: int
    sample: Any
    version: int


class Joined(NamedTuple):
    """A worker added while the loader runs (num_workers="auto") will write
    into runs from first_run on: it is one more Done to wait for."""
    worker: int
    first_run: int


class StreamEnd(NamedTuple):
    """How a worker's stream of an iterable run ended: its short last batch
    and that batch's rows (None: it ended on a full batch, or the run ended
    first), or holes_to_close: its open batches have holes for the batcher
    to close up (a shuffle buffer's last batches)."""
    last_batch: int | None = None
    last_rows: int = 0
    holes_to_close: bool = False


NO_STREAM_END = StreamEnd()  # a map-style run's, or a stream's with nothing to send


class Done(NamedTuple):
    """The worker will not write into the run any more (stream_end: how its
    stream ended, for an iterable run)."""
    run: int
    worker: int
    stream_end: StreamEnd = NO_STREAM_END


class DatasetState(NamedTuple):
    """A worker's copy of a dataset that keeps its own state (NOTE
    [ Datasets that keep their own state ] in datasets/own_state.py):
    map-style, its state as it began the run (STARTED: sent before anything
    of the run is loaded), or that it moved while the run loaded (CHANGED,
    state None); iterable, its state after `position` samples of its stream
    were read (AT: sent before those samples can be handed out); either,
    its state as it ended its part of the run (ENDED: before Done).  known
    False: the state could not be taken (its error went to main as a Failed)."""
    run: int
    worker: int
    when: str
    state: Any
    known: bool = True
    position: int | None = None


# --- batcher -> main --------------------------------------------------------------


class BatchReady(NamedTuple):
    run: int
    batch: int
    slab: Any      # Slab (batcher/slabs.py)
    spec: Any      # the batch tree (_layout.spec)
    tags: int      # offset in the slab of the rows' tags (int64 each; see _layout.Layout)
    rows: int
    values_bytes: int = 0  # main: the spill heap's bytes its rows' values came in


class RunEnded(NamedTuple):
    run: int
    batches: int
    samples: int
    rows_by_batcher: int   # rows the batcher wrote itself (SampleRow)
    relayouts: int          # batches laid out again (a wrong guess, or promotion)
    peak_slab_bytes: int    # most slab memory in use while the run went on


class StreamEnded(NamedTuple):
    """Iterable runs: the worker's stream ended; its batch numbers from
    `batches` on, and those in `dropped` (left empty in a shuffle buffer),
    will never come (main skips them; see NOTE [ Runs ])."""
    run: int
    worker: int
    batches: int
    dropped: tuple


class MemoryWait(NamedTuple):
    held_bytes: int
    cap_bytes: int
    held_batches: int
    need_bytes: int


# --- anyone -> main ----------------------------------------------------------------


class ErrorReport(NamedTuple):
    """An exception, made to cross a process boundary: where its type is
    defined (to raise the same type in main, as PyTorch does), the
    traceback, and where it happened."""
    type_module: str
    type_name: str     # qualified name in type_module
    text: str          # the formatted traceback
    where: str         # e.g. "in worker 1"

    @classmethod
    def of(cls, exc: BaseException, where: str) -> "ErrorReport":
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        t = type(exc)
        return cls(t.__module__, t.__qualname__, text, where)

    def exception_type(self) -> type | None:
        """The exception's type, if main can import it."""
        try:
            obj = importlib.import_module(self.type_module)
            for part in self.type_name.split("."):
                obj = getattr(obj, part)
        except Exception:
            return None
        return obj if isinstance(obj, type) and issubclass(obj, BaseException) else None


class Failed(NamedTuple):
    """Something raised: a sample (pos and index known), worker_init_fn, a
    collate_fn, or the batcher (worker None)."""
    run: int
    batch: int | None   # the batch it spoils, in in-order mode: main raises when it gets
                        # there; None: raise at once.  First-ready mode (raised at once):
                        # a batch given up (refused, or a sample that could not be placed),
                        # which main counts as handed out; None: no batch is lost
    pos: int | None     # position in the run's order; None when not about one sample
    index: int | None   # dataset index; None when not known
    worker: int | None  # None: the batcher
    pid: int
    error: ErrorReport
    ends_run: bool = False  # the run cannot go on: every later next() raises it again
