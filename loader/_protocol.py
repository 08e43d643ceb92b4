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

Shutdown, in order of preference:
1. close() / __del__ / interpreter exit: main sets ctl[EPOCH] = STOPPED
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

# ctl array slots
CURSOR = 0      # next position of the current epoch (workers: atomic_add)
EPOCH = 1       # current epoch; workers drop out when it changes
LIMIT = 2       # positions below this may be loaded: main keeps it `prefetch` batches
                # ahead of what it has yielded, so prefetch does not grow with workers
ARRIVED = 3     # first-ready: samples ready so far; the k-th goes to row k % B of batch k // B
CTL_WORDS = 8
STOPPED = -1

# message kinds (first element of every message tuple)
SAMPLE = 0      # worker → collator: (SAMPLE, epoch, pos, batch, row, sample)
ERROR = 1       # worker → collator → main: (ERROR, epoch, pos, index, worker_id, pid, traceback)
DONE = 2        # worker → collator: (DONE, epoch, worker_id)
EPOCH_START = 3 # main → collator: (EPOCH_START, epoch, n_positions)
                # main → worker: (EPOCH_START, epoch, order chunk or None, seed, last chunk?)
STOP = 4        # main → collator / worker: (STOP,)
BATCH = 5       # collator → main: (BATCH, epoch, batch_index, lease, generation, offset, nbytes, spec)
END = 6         # collator → main: (END, epoch, batches, samples, samples that came by ring)
MEMORY_WAIT = 7 # collator → main: (MEMORY_WAIT, held_bytes, cap_bytes, held_batches)
VALUES = 8      # worker → collator: (VALUES, epoch, batch, row, non-numeric leaves) of a row
                # the worker wrote itself (NOTE [ Direct row writes ] in _table.py)
FILLED = 9      # worker → collator: (FILLED, epoch, batch): it counted the batch's last row

ORDER_CHUNK = 1 << 16  # positions per EPOCH_START message to a worker
WAIT_SLICE_S = 0.1   # longest blocking wait before re-checking peers and signals
JOIN_TIMEOUT_S = 5.0
