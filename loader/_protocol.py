"""Messages between the loader's processes, and the shutdown protocol.

NOTE [ ShmLoader processes and shutdown ]
=========================================

            ctl[CURSOR] (atomic, shmq.atomic_add): the next position of the epoch
  worker 0 ─┐   SAMPLE/VALUES/FILLED/
  worker 1 ─┼─ ERROR/DONE ─ to_collator (MPSC) ──► collator ── to_main (SPSC) ──► main: views
  worker N ─┘   (main: EPOCH, STOP)                  │          BATCH descriptors
    ▲  │                                             │          (lease, offsets)
    │  └── rows written directly into published ◄────┘ lays out slabs in the shared arena
    │      slabs (NOTE [ Direct row writes ],           and publishes them in the batch table
    │      _table.py)
    └──── to_worker[i] (SPSC, main → worker i): EPOCH (order, seed) / STOP

All shared memory is created by main before it forks: the rings are unlinked
at once (forked children inherit the mappings), and the arena, ctl and
released arrays and the batch table are anonymous (shmq.shared_array).  No name exists that a
crash could leak.

Slab leases: the collator allocates a slab per batch from the arena under
(lease id, generation).  Main wraps the slab in a _Slab array that every
batch array keeps alive; when the last one dies, a finalizer stores the
generation into released[lease] (one aligned int64 store: safe from any
thread, no lock).  The collator reuses a slab only after seeing that store.

Passes ("runs"): each pass over the data has a run id, unique for the
loader's life; the user's epoch number only picks the order and the seeds.
The next epoch's run starts as soon as every position of the current one
is claimed, so its first batches are ready before the current epoch ends
(run ahead).  When iter() asks for that epoch, main keeps the run if
len(dataset) is unchanged, else ends it and starts another.  Two runs can
be live at once, so the ctl array has one block of slots per run parity.
Positions are claimed by compare-and-swap on a cursor tagged with the run:
a worker still busy in an ended run can never take a position of a newer
one, and ending a run is one store of an untagged cursor.

Shutdown, in order of preference:
1. close() / __del__ / interpreter exit: main ends both runs' cursors
   (workers stop pulling positions at once), sends STOP to every worker and
   to the collator, and joins them for up to JOIN_TIMEOUT_S; stragglers are
   killed.  Everything then unmaps; nothing is left in /dev/shm.
2. main dies (SIGKILL, SIGTERM): every child was started with
   PR_SET_PDEATHSIG=SIGKILL, so the kernel kills it at once; a child also
   checks os.getppid() between bounded waits, as a fallback.
3. a child dies: main polls the children's exit codes between bounded waits
   (WAIT_SLICE_S) and raises WorkerError naming the process, pid and signal.
Children ignore SIGINT: Ctrl-C reaches main as KeyboardInterrupt, and main
tears down as in (1); no child prints a traceback.
"""

import shmq

# ctl array: a block of slots per run parity (see Passes above)
CURSOR = 0      # (run << 32) | next position; claimed by compare-and-swap (claim())
LIMIT = 1       # positions below this may be loaded: main keeps it `prefetch` batches
                # ahead of what it has yielded, so prefetch does not grow with workers
ARRIVED = 2     # (run << 32) | samples ready so far (first-ready): the k-th goes to
                # row k % B of batch k // B
READY = 3       # the collator stores the run id here once it has laid out the run's
                # first batches; workers wait for it, so their rows find them published
SLOTS_PER_RUN = 4
CTL_WORDS = 2 * SLOTS_PER_RUN
RUN_SHIFT = 32  # positions per run < 2**32


def slot(run: int, which: int) -> int:
    return (run % 2) * SLOTS_PER_RUN + which


def tagged(run: int) -> int:
    """A run-tagged counter at zero; 0 itself is the tag of no run."""
    return run << RUN_SHIFT


def live(ctl, run: int) -> bool:
    return int(ctl[slot(run, CURSOR)]) >> RUN_SHIFT == run


def claimed(ctl, run: int) -> int:
    """Positions of a live run claimed so far (-1 once it ended)."""
    v = int(ctl[slot(run, CURSOR)])
    return v & ((1 << RUN_SHIFT) - 1) if v >> RUN_SHIFT == run else -1


def claim(ctl, which: int, run: int) -> int:
    """The next value of the run's tagged counter `which`, or -1 once the
    run has ended: then nothing is taken."""
    i = slot(run, which)
    while True:
        v = int(ctl[i])
        if v >> RUN_SHIFT != run:
            return -1
        if shmq.atomic_cas(ctl, i, v, v + 1):
            return v & ((1 << RUN_SHIFT) - 1)


def end_run(ctl, run: int) -> None:
    """Workers stop claiming positions of the run.  A plain store is
    enough: a claim's compare-and-swap fails on any other word."""
    i = slot(run, CURSOR)
    if int(ctl[i]) >> RUN_SHIFT == run:
        ctl[i] = 0


def publish_window(prefetch: int) -> int:
    """How many batches past those sent the collator lays out for direct
    writes: workers load positions below main's limit, `prefetch` batches
    past what it has yielded (at most what was sent), plus one claim each
    that waits; one more batch of slack lets the next be ready as the
    window moves."""
    return prefetch + 2


# message kinds (first element of every message tuple; the second is the run)
SAMPLE = 0      # worker → collator: (SAMPLE, run, pos, batch, row, sample)
ERROR = 1       # worker → collator → main: (ERROR, run, pos, index, worker_id, pid, traceback)
DONE = 2        # worker → collator: (DONE, run, worker_id)
EPOCH_START = 3 # main → collator: (EPOCH_START, run, n_positions)
                # main → worker: (EPOCH_START, run, epoch, order chunk or None, seed, last chunk?)
STOP = 4        # main → collator / worker: (STOP,)
BATCH = 5       # collator → main: (BATCH, run, batch_index, lease, generation, offset, nbytes, spec)
END = 6         # collator → main: (END, run, batches, samples, samples that came by ring)
MEMORY_WAIT = 7 # collator → main: (MEMORY_WAIT, held_bytes, cap_bytes, held_batches)
VALUES = 8      # worker → collator: (VALUES, run, batch, row, non-numeric leaves) of a row
                # the worker wrote itself (NOTE [ Direct row writes ] in _table.py)
FILLED = 9      # worker → collator: (FILLED, run, batch): it counted the batch's last row

ORDER_CHUNK = 1 << 16  # positions per EPOCH_START message to a worker
WAIT_SLICE_S = 0.1   # longest blocking wait before re-checking peers and signals
JOIN_TIMEOUT_S = 5.0
