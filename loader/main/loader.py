"""ShmLoader: the main-process side.  See NOTE [ ShmLoader processes and
shutdown ] in shared/messages.py for the processes and how they stop, and NOTE
[ Runs ] in shared/control.py for how passes over the data are started."""

from __future__ import annotations

import atexit
import os
import warnings
import weakref

from loader.order import indices as _order
from loader.main.arguments import check_arguments, positive_int, torch_positions
from loader.main.autoscale import Autoscaler, workers_loading
from loader.main.epochs import CurrentEpoch, EpochHost, MapEpoch, StreamEpoch
from loader.main.lookahead import FrozenState
from loader.main.inline import InlineEpoch
from loader.main.materialize import Materializer
from loader.main.pinning import cuda_available
from loader.torch.integrations import install_imported
from loader.main.planner import EpochPlanner
from loader.order.planning import Plan
from loader.main.runs import Runs
from loader.order.progress import MapProgress
from loader.order.feed import sampler_length
from loader.shared.spec import SHM_RULES, TORCH_RULES, LiveSpec, public_fields
from loader.errors import StateError
from loader.main.state import ABSENT, Expected, LoaderState
from loader.main.stats import StatsBook
from loader.shared.trace import ROLE_MAIN, tracer_of
from loader.datasets import own_state as _own_state

__all__ = ["ShmLoader"]

_live_loaders: "weakref.WeakSet[ShmLoader]" = weakref.WeakSet()


class ShmLoader(FrozenState):
    """Batches from arbitrary Python preprocessing, at memory speed.

    Forked workers run ``dataset[i]`` (or iterate an iterable dataset) and
    write each sample straight into its row of a batch slab in shared
    memory (a batcher process lays the slabs out); iterating yields numpy
    arrays (or torch tensors with ``output="torch"``) that view those slabs:
    no copy, no unpickling in the training loop.  A slab is reused only when
    every array of its batch is gone, so batches you keep stay intact.

    dataset: map-style (``__len__`` and ``__getitem__``; a torch Dataset, a
        FileDataset) or iterable (``__iter__`` only; a torch IterableDataset,
        a ParquetDataset), each worker iterating its own copy (split it with
        ``get_worker_info()``).
    batch_size: samples per batch (None: samples unbatched, one at a time).
    shuffle, sampler, batch_sampler, drop_last, collate_fn, timeout,
    worker_init_fn, persistent_workers, pin_memory, in_order, generator: as
        in torch's DataLoader (timeout=None waits for ever; persistent_workers
        defaults to True, so that the next epoch starts loading before this
        one ends).  in_order=False hands out batches as they are ready.
    num_workers: worker processes (default 2; 0 loads in the training
        process; "auto" grows and shrinks the pool from what it measures,
        up to max_workers).
    prefetch: batches loaded ahead of the training loop (default 3; for an
        iterable dataset, shared among the workers' streams).
    seed: the base of every random choice: the shuffle order, the workers'
        generators.  With a seed, reproducible=True by default: the global
        generators are seeded from (seed, epoch, index) before each
        dataset[i], so batches do not depend on the number of workers.
    output: "numpy" (default), "torch" (tensors viewing the same memory) or
        "keep" (each leaf as dataset or collate_fn gave it).
    memory_cap_bytes: the most batch memory in use at once (default a
        quarter of RAM): batches loaded ahead and batches you still hold.
    distributed: True (ranks from torch.distributed or torchrun's RANK and
        WORLD_SIZE) or (rank, world_size): each rank gets a disjoint share
        of every epoch.
    shuffle_buffer: iterable datasets: place each sample in a random row of
        the next this-many samples' batches (all of them in memory at once:
        a memory_cap_bytes too small for that is a MemoryError).
    worker_mode: "process" (default, forked) or "thread" (for preprocessing
        that releases the GIL, or that cannot be forked).
    trace: a path: close() writes a Chrome-trace / Perfetto JSON of the
        run there (each sample's load and write, the batches, the loop's
        waits in next(), epochs, the slab pool); open it in
        https://ui.perfetto.dev.
    start_method: "fork" (default: the processes are forked from this one)
        or "spawn": each is a fresh interpreter given the dataset, collate_fn
        and worker_init_fn by pickle and the shared memory by descriptor, so
        no thread or lock of this process's runtime is copied (JAX's: the
        way for JAX users, docs/jax.md).  Batches view the same shared memory
        either way.

    The first seven parameters are torch's DataLoader's, in its order, and
    may be passed by position; every later one is keyword-only (from the
    eighth on torch's order differs: its eighth is pin_memory).

    stats() says where the last epoch's time went; state_dict() and
    load_state_dict() resume mid-epoch; steps(n) runs n batches across
    epoch boundaries.  Close it (or use ``with``) to stop the workers at
    once; garbage collection and interpreter exit do it too.
    """

    _rules = SHM_RULES  # loader.DataLoader's own ShmLoader takes torch's (torch/dataloader.py)

    @torch_positions
    def __init__(self, dataset, batch_size=1, shuffle=False, sampler=None, batch_sampler=None,
                 num_workers=2, collate_fn=None, *, drop_last=False, in_order=True,
                 prefetch=None, persistent_workers=True, worker_init_fn=None, seed=None,
                 generator=None, reproducible=None, timeout=None, output="numpy",
                 pin_memory=False, memory_cap_bytes=None, distributed=False,
                 shuffle_buffer=None, worker_mode="process", max_workers=None, trace=None,
                 start_method="fork"):
        install_imported()  # NOTE [ Installing the integrations ]
        # every parameter by its name (locals() holds exactly them here): the
        # spec is their one record, and these attributes read it
        given = {name: value for name, value in locals().items() if name != "self"}
        spec = check_arguments(self._rules, **given)
        self._live = LiveSpec(spec)  # what changes at run time: workers, seed, ranks
        self._tracer = tracer_of(spec.trace, ROLE_MAIN)
        # builds batches for this loader's output (its leaf plans kept across batches)
        self._materializer = Materializer(spec.output, spec.torch_rules)
        self._planner = EpochPlanner(self._live)  # seeds, generators, each epoch's plan
        self._owner_pid = os.getpid()
        # which epoch is current, and the plan state_dict() describes (NOTE [ Who
        # decides on main's batch path ] in main/epochs.py)
        self._current = CurrentEpoch(self._owner_pid)
        self._runs = Runs(self._planner, self._current)  # NOTE [ Runs ]; the session's owner
        self._stats = StatsBook(spec.memory_cap_bytes, warn_stalls=not spec.torch_rules)
        self._autoscaler = None  # num_workers="auto": its decisions (main/autoscale.py)
        self._resume = None           # a state to resume at the next iter()
        self._steps_epoch = None      # (epoch, its iterator) that steps() goes on with
        _live_loaders.add(self)

    # --- sizes ----------------------------------------------------------------------

    def __len__(self):
        spec = self._live.now
        if spec.iterable:
            raise TypeError("an iterable dataset has no length; ShmLoader cannot know its "
                            "number of batches")
        if spec.batch_sampler is not None:
            return len(spec.batch_sampler)
        n = self._sampler_len() if spec.sampler is not None else spec.dataset_len()
        n = _order.shard_size(n, self._planner.ranks()[1])
        if spec.batch_size is None:
            return n
        return -(-_order.kept_of(n, spec.batch_size, spec.drop_last) // spec.batch_size)

    def _sampler_len(self) -> int:
        """len(sampler), or a TypeError that says why there is none."""
        n = sampler_length(self.sampler)
        if n is None:
            raise TypeError(f"this ShmLoader has no len(): its sampler ({self._live.now.sampler_name}) "
                            f"has no __len__, so its number of batches is known only once the "
                            f"sampler ends (as torch's DataLoader, len() needs a sized sampler); "
                            f"iterate it to its end, or count batches with steps(n)")
        return n

    def stats(self) -> dict | None:
        """How the last epoch that ran to its end was delivered, and where
        its time went; None before the end of the first epoch.

        - "summary": all of it in one line, for a log.
        - "epoch", "batches", "samples"; "seconds" from the epoch's first
          next() to its end; "bytes" of batch memory handed out (slabs, with
          their row tags, and "spilled_bytes": large bytes and str leaves,
          which come through the spill heap) and "bytes_per_second".
        - "kept_slabs_moved_out", "kept_bytes_moved_out": since the loader
          started, slabs whose parts you still held, or whose batches main
          held back (received ahead of their turn), were moved out of the
          pool when it ran short, copying that many bytes (NOTE [ Kept batch
          memory ]).
        - "loop_wait_seconds", "loop_wait_share": how long the training loop
          waited in next() for a batch (num_workers=0: loading them).  Above
          half of an epoch of 5 s or more, a DataStallWarning says why, once
          (unless other programs held the CPUs: see "cpu_wait_share").
        - "workers_busy_share", "batcher_busy_share": the share of the
          epoch the workers (on average) and the batcher were not waiting;
          None with num_workers=0.
        - "cpu_wait_share": the share of the epoch the loading spent ready
          to run with no CPU free: the training thread's, the batcher's and
          an average worker's run-queue time, added up (num_workers=0: the
          training thread's).  "other_programs_cpu_share" and
          "loader_cpu_share": the share of the "cpus" this process may use
          that other programs, and the loader's processes (this one
          included), used.  A stall that other programs holding the CPUs
          explains is no DataStallWarning (NOTE [ CPU starvation ] in
          main/stats.py).  None where /proc does not say.
        - "peak_slab_bytes" of "memory_cap_bytes": the most batch memory in
          use (batches being filled, ready, or still referenced by you).
        - "samples_written_by_workers" / "samples_written_by_batcher":
          samples whose dtypes or structure differ from the batch's layout
          are written by the batcher, slower; "relayouts": batches laid out
          again (shapes that change between batches, promotions).
        - "workers": the workers loading now (num_workers="auto": the count
          it chose, and "worker_counts": the counts it went through).

        The busy shares include the next epoch's loading once it starts
        early (persistent workers run ahead into it)."""
        if self._stats.last is None:
            return None
        out = dict(self._stats.last)
        out["workers"] = self._workers_loading()
        out["kept_slabs_moved_out"], out["kept_bytes_moved_out"] = self._runs.kept_moved_out()
        remote = getattr(self.dataset, "remote_stats", None)
        if callable(remote):  # FileDataset over an object store (NOTE [ Remote data ])
            out["remote"] = remote()
        if self._autoscaler is not None:
            out["worker_counts"] = list(self._autoscaler.history)
        return out

    # --- processes ----------------------------------------------------------------------

    @property
    def _session(self):
        """The processes and shared memory, once started (main/session.py;
        Runs owns them)."""
        return self._runs.session

    def _start(self):
        spec = self._live.update(parent_pid=0 if self._live.now.threads else os.getpid())
        session = self._runs.open(spec)
        if spec.auto:
            session.shared.control.set_active(spec.num_workers)
            set_active = weakref.WeakMethod(self._set_active_workers)  # (no cycle: see Runs)
            self._autoscaler = Autoscaler(session.shared.waited,
                                          lambda count: set_active()(count), spec.num_workers,
                                          spec.max_workers)

    @property
    def _procs(self) -> list:
        """The loader's child processes now (pid, exitcode; none once
        stopped), under the name the kept reproductions of fixed failures
        (shared/repros/fixed/) read: they must keep passing."""
        return self._session.procs if self._session is not None else []

    def _set_active_workers(self, active: int) -> None:
        """num_workers="auto": let `active` workers claim units (main/autoscale.py)."""
        runs = self._runs
        first_run = runs.current.id if runs.current is not None else max(runs.count, 1)
        self._live.update(num_workers=self._session.add_workers(active, first_run))

    def _shutdown(self):
        """Stop the session (Runs.stop)."""
        self._runs.stop()

    def close(self):
        """Stop the workers and the batcher.  Batches you hold stay valid.
        Safe to call again, e.g. after a Ctrl-C interrupted it.  With
        trace=PATH, then write the trace; if that fails (a full disk), raise
        TraceWriteError, everything stopped all the same and the records
        kept: close() again writes them."""
        self._current.closed = True
        if os.getpid() != self._owner_pid:
            self._runs.forget()  # a forked copy: its parent's processes
            return
        self._shutdown()
        trace = self._live.now.trace
        if trace is not None:  # every writer is gone now (NOTE [ Trace records ])
            trace.write()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        live = getattr(self, "_live", None)
        trace = None if live is None else live.now.trace
        unwritten = trace is not None and trace.pending  # (workers stopped after each epoch)
        if (getattr(self, "_session", None) is not None or unwritten) and \
                os.getpid() == self._owner_pid:
            self.close()

    # --- iteration ----------------------------------------------------------------------

    def __iter__(self):
        if self._current.closed:
            raise ValueError("this ShmLoader is closed; create a new one")
        self._current.check_owner()
        self.thaw_state()  # a pass of its own, or a wrapper's (which freezes it again)
        if self._session is None:  # (re)starting: the ranks are taken now
            self._planner.take_ranks()
        resume, self._resume = self._resume, None
        current = self._current
        if resume is not None:
            current.number = resume.epoch - 1  # the epoch the state is in
        current.number += 1  # every iterator made before is superseded
        spec = self._live.now
        if spec.torch_rules and resume is None:  # as torch's iterator is made
            self._planner.draw_at_iter(current.number)
        if spec.pin_memory and not spec.torch_rules and not cuda_available():
            warnings.warn("ShmLoader: pin_memory=True, but CUDA is not available: batches are not "
                          "pinned (pin_memory=False says the same without this warning)",
                          UserWarning, stacklevel=2)
        if spec.num_workers == 0:
            epoch = InlineEpoch(spec, current.number, resume, planner=self._planner,
                                tracer=self._tracer, current=current, stats=self._stats)
        else:
            if self._session is None:
                self._start()
            spec = self._live.now
            host = EpochHost(spec, current=current, runs=self._runs, session=self._session,
                             stats=self._stats, tracer=self._tracer,
                             materializer=self._materializer, autoscaler=self._autoscaler)
            epoch = (StreamEpoch if spec.iterable else MapEpoch)(host, current.number, resume)
        epoch.keep_alive = self  # NOTE [ Who decides on main's batch path ] in main/epochs.py
        return epoch

    def steps(self, n: int | None = None):
        """Yield n batches (None: for ever), going from one epoch into the
        next with no pause (the next epoch's first batches are loaded
        before the current one ends) and advancing the epoch, and so its
        shuffle and seeds, at each boundary.  steps() called again goes on
        where the last call stopped, mid-epoch included; state_dict() and
        load_state_dict() work between and within calls."""
        if n is not None:
            positive_int("n", n, 0)
        count = 0
        while n is None or count < n:
            current = self._steps_epoch
            if current is None or current[0] != self._current.number or \
                    self._resume is not None:
                it = iter(self)  # the next epoch (or the one a loaded state is in)
                current = self._steps_epoch = (self._current.number, it)
            got = False
            for batch in current[1]:
                got = True
                count += 1
                yield batch
                if n is not None and count >= n:
                    return  # the epoch's iterator stays suspended here for the next call
            self._steps_epoch = None
            if not got and current[0] == self._current.number:
                raise ValueError("ShmLoader.steps(): an epoch yielded no batch (an empty dataset, "
                                 "or drop_last with fewer samples than a batch); there is nothing "
                                 "to step through")

    def _workers_loading(self) -> int:
        return workers_loading(self._autoscaler, self._live.now.num_workers)

    # --- resuming ---------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Where the loader is: the epoch in progress and which of its
        samples the training loop has received (a few numbers: no sample
        data, cheap enough to take every step).  A new loader of the same
        dataset and arguments given it by load_state_dict() yields exactly
        the rest of that epoch, then the following epochs as this one
        would.  See NOTE [ Resuming an epoch ] in order/progress.py; behind a
        wrapper that looks ahead, freeze_state() (NOTE [ A state through a
        look-ahead wrapper ] in main/lookahead.py)."""
        frozen = self._frozen_state_copy()
        if frozen is not None:
            return frozen
        return self._state().to_dict()

    def _state(self) -> LoaderState:
        """The state state_dict() returns, of the epoch it describes now."""
        spec, plan = self._live.now, self._current.plan
        progress = plan.progress if plan is not None else None
        epoch = {"rng": {}, "base_seed": None, "map": None, "stream": None, "complete": True}
        if progress is not None:  # (else no epoch started: the next is the first)
            epoch.update(rng=dict(plan.rng), base_seed=plan.base_seed)
            if isinstance(progress, MapProgress):
                epoch.update(map=progress.state(), complete=progress.complete())
            else:
                epoch.update(stream=progress.state(), complete=progress.complete)
        record = None if epoch["complete"] else self._epoch_record(plan)
        return LoaderState(
            epoch=self._current.number, seed=spec.seed, rank=spec.rank, world=spec.world,
            workers=spec.num_workers, iterable=spec.iterable, batch_size=spec.batch_size,
            dataset_len=spec.map_len() if record is None else record["count"],
            sampler=spec.sampler_name, dataset=self._own_state_entry(epoch["complete"], plan),
            dataset_epoch=ABSENT if record is None else record, **epoch)

    def _epoch_record(self, plan: Plan | None) -> dict | None:
        """The dataset's record of the epoch in progress, if a new job could
        not take the epoch again without it (NOTE [ Datasets that change
        with the epoch ])."""
        record_of = getattr(self._live.now.dataset, "epoch_record", None)
        if plan is None or plan.snapshot is None or not callable(record_of):
            return None
        return record_of(plan.snapshot)

    def _own_state_entry(self, complete: bool, plan: Plan | None):
        """The "dataset" entry of a dataset that keeps its own state: its
        copies' states (plan.own: the run's RunStates; no plan before any
        run); ABSENT for a dataset that keeps none.  See NOTE [ Datasets
        that keep their own state ]."""
        spec = self._live.now
        dataset = spec.dataset
        if not _own_state.keeps_state(dataset):
            return ABSENT
        if spec.resumes_itself():
            progress = plan.progress if plan is not None else None
            return _own_state.pass_entry(
                dataset, plan.pass_start if progress is not None else None,
                progress, world=spec.world, in_order=spec.in_order,
                batch_size=spec.batch_size, shared_by=spec.dataset_copies()[2])
        if not spec.takes_own_state():
            return _own_state.without_state(dataset)
        book = None if plan is None else plan.own
        if book is None:  # no run yet: the copies begin the first from main's copy
            book, complete = _own_state.RunStates(*spec.dataset_copies()), True
            if not book.mains:
                return _own_state.entry(dataset, None, None)
        elif book.waits_for_workers(complete, spec.persistent_workers):
            # what the workers reported may still be on its way
            self._runs.wait_for(book.run, lambda: book.reported(complete, spec.iterable))
        return book.record_of(dataset, complete=complete, iterable=spec.iterable,
                              persistent=spec.persistent_workers)

    def load_state_dict(self, state: dict) -> None:
        """Resume from state_dict(): the next iter() yields the rest of the
        epoch the state was taken in (or the next epoch, if it was over)."""
        self._current.check_owner()
        # checked before anything changes (main/state.py)
        loaded = LoaderState.from_dict(state, self._expected_state(self._record_len(state)))
        own_load = self._own_states_to_load(loaded)
        self._freeze_loaded(state)
        if self._session is not None:
            self._runs.abandon()
        self._dataset_epochs_from(loaded)
        if loaded.seed != self.seed:
            self._shutdown()  # the workers know the old seed: new ones start at iter()
        self._steps_epoch = None
        self._planner.own_load = own_load
        self._live.update(seed=loaded.seed)
        if loaded.complete:
            self._current.number, self._resume = loaded.epoch, None
        elif self._live.now.resumes_itself():
            # the dataset drops what was delivered itself: the streams begin anew
            self._resume = loaded.with_streams_anew()
        else:
            self._resume = loaded
        self._current.plan = None

    def _dataset_epochs_from(self, loaded: LoaderState) -> None:
        """A dataset that remembers its epochs' snapshots (NOTE [ Datasets
        that change with the epoch ]) forgets them (the runs that read them
        are dropped), and takes the state's record of its epoch."""
        dataset = self._live.now.dataset
        forget = getattr(dataset, "forget_epochs", None)
        if callable(forget):
            forget()
        if loaded.dataset_epoch is not ABSENT:   # (the epoch's set, not the data's now)
            dataset.resume_epoch(loaded.epoch, loaded.dataset_epoch)

    def _own_states_to_load(self, loaded: LoaderState) -> list | None:
        """What the dataset's copies load as the next run begins (NOTE
        [ Datasets that keep their own state ]), with a warning where the
        resume cannot be exact."""
        spec = self._live.now
        dataset = spec.dataset
        if not _own_state.keeps_state(dataset):
            return None
        if spec.resumes_itself():
            states = _own_state.states_to_load(dataset, loaded.own, 1)
            if states is not None:  # (its shared memory: every copy's next pass takes it)
                dataset.load_state_dict(states[0])
            return states
        states = _own_state.states_to_load(dataset, loaded.own,
                                           spec.dataset_copies()[0])
        return states if spec.takes_own_state() else None

    def _record_len(self, state) -> int | None:
        """The length of the epoch a state's "dataset_epoch" records (None:
        it has none, or this dataset records no epochs: the checks say so)."""
        record = state.get("dataset_epoch") if isinstance(state, dict) else None
        length_of = getattr(self._live.now.dataset, "record_len", None)
        if record is None or not callable(length_of) or not isinstance(record, dict):
            return None
        try:
            return length_of(record)
        except ValueError as e:
            raise StateError(f"load_state_dict: field 'dataset_epoch' is not a record of this "
                             f"loader's dataset: {e}; load a state from state_dict() of a "
                             f"loader of the same dataset and arguments") from None

    def _epoch_positions(self, world: int, dataset_len: int | None = None) -> int | None:
        """The positions of a map-style epoch of this rank, as plan_run counts
        them (None: a batch sampler's, known only by iterating it), for a
        dataset of dataset_len (None: its length now)."""
        spec = self._live.now
        if spec.iterable or spec.batch_sampler is not None:
            return None
        if dataset_len is None:
            dataset_len = spec.map_len()
        n = sampler_length(spec.sampler) if spec.sampler is not None else dataset_len
        if n is None:
            return None
        share = n if spec.sampler is not None else _order.shard_size(n, world)
        return share if spec.batch_size is None else _order.kept_of(share, spec.batch_size,
                                                                    spec.drop_last)

    def _expected_state(self, dataset_len: int | None = None) -> Expected:
        """What a state must match; dataset_len: the length of the epoch it
        records (None: the dataset's now)."""
        rank, world = self._planner.ranks()
        spec = self._live.now
        if dataset_len is None:
            dataset_len = spec.map_len()
        record_len = getattr(spec.dataset, "record_len", None)
        return Expected(
            iterable=spec.iterable, num_workers=spec.num_workers, streams=spec.streams,
            rank=rank, world=world,
            seed=spec.seed if spec.seed_given else None, batch_size=spec.batch_size,
            positions=self._epoch_positions(world, dataset_len), dataset_len=dataset_len,
            sampler=spec.sampler_name,
            rng_bytes={k: len(v) for k, v in self._planner.rng_states().items()},
            seeded_shuffle=(spec.shuffle and spec.generator is None and spec.sampler is None
                            and spec.batch_sampler is None and not spec.iterable),
            own_state=(_own_state.name_of(spec.dataset) if _own_state.keeps_state(spec.dataset)
                       else None),
            epoch_record=type(spec.dataset).__name__ if callable(record_len) else None)


def _spec_attribute(name: str) -> property:
    def fixed(self, value):
        raise AttributeError(f"{type(self).__name__}.{name} is fixed when the loader is made "
                             f"(the planner, the workers and the batcher all took it then): "
                             f"make a new {type(self).__name__} with {name}={value!r}")

    return property(lambda self: getattr(self._live.now, name), fixed,
                    doc=f"The loader's {name} (read-only: see ShmLoader's docstring).")


for _name in public_fields():  # dataset, batch_size, ..., num_workers and seed as they are now
    setattr(ShmLoader, _name, _spec_attribute(_name))
del _name


class TorchRulesLoader(ShmLoader):
    """loader.DataLoader's own ShmLoader: it loads as torch's DataLoader
    does (Rules in shared/spec.py: torch's worker seeding, base seed per
    iterator, order draws and collate structure), from the start."""
    _rules = TORCH_RULES


def continue_from(loader: ShmLoader, previous: ShmLoader) -> None:
    """A new loader.DataLoader's ShmLoader takes over from `previous`
    between two passes (its samplers changed: NOTE [ The samplers a pass
    takes ] in torch/dataloader.py): the epochs go on counting, and the base
    seed a persistent iterator drew once stays drawn."""
    loader._current.number = previous._current.number
    loader._planner.drawn_base_seed = previous._planner.drawn_base_seed


def stop_workers(loader: ShmLoader) -> None:
    """Stop the loader's processes now (an iterator's _shutdown_workers,
    as torch's, for tools that call it); its next iter() starts new ones."""
    loader._shutdown()


def worker_children(loader: ShmLoader) -> list:
    """The loader's worker processes now (none once they have stopped)."""
    session = loader._session
    return session.worker_children() if session is not None else []


def _close_all():
    for loader in list(_live_loaders):
        _close_if_owned(loader)


def _close_if_owned(loader: ShmLoader) -> None:
    if loader._owner_pid == os.getpid():  # (a forked copy leaves its parent's processes alone)
        loader.close()


atexit.register(_close_all)
