"""The runs main reads, and the session that runs them.

`Runs` keeps the runs of one loader (NOTE [ Runs ] in shared/control.py): the
current one and the next epoch's, started ahead; the messages of each,
filed as they come; which have not ended.  It starts a run from a plan
(order/planning.py), raises its LIMIT as the loop takes batches, feeding a
streamed sampler first and settling a run whose sampler ended (NOTE
[ Streamed samplers ] in order/feed.py), and ends it.  It holds the
loader's Session (main/session.py) from its start to its stop, and stops
it when an epoch ends without persistent workers (NOTE [ Who decides on
main's batch path ] in main/epochs.py).
"""

from __future__ import annotations

import collections
import time
from typing import Callable, NamedTuple

from loader.order import indices as _order
from loader.shared import messages as _protocol
from loader.shared.control import RunWords
from loader.shared.spec import LoaderSpec
from loader.order.planning import Plan, offsets_word, order_of, settled_plan
from loader.order.feed import BatchFeed
from loader.main.session import Session
from loader.datasets.own_state import RunDataset


class Run(NamedTuple):
    id: int
    plan: Plan
    batches: _order.Batches | None  # None for an iterable dataset


class Runs:
    """The runs of one loader, which owns them.  Plans come from the
    loader's EpochPlanner (main/planner.py); the loader's spec as it stands
    now (prefetch, timeout, ranks) is the planner's LiveSpec; which epoch
    is the loader's current one, its CurrentEpoch (main/epochs.py)."""

    def __init__(self, planner, current_epoch):
        self.planner = planner
        self.live = planner.live
        self.current_epoch = current_epoch
        self.count = 0           # runs started (ids are never reused)
        self.current = None      # the run of the latest iter()
        self.ahead = None        # the next epoch's run, started before its iter()
        self.inboxes: dict[int, collections.deque] = {}  # messages of the runs main reads
        self.unended: set[int] = set()                     # runs whose RunEnded has not come
        self.session = None      # the loader's Session while it runs (open() to stop())
        self.moved_out = (0, 0)  # kept slabs and bytes moved out by the sessions stopped
        self.own_books: dict = {}  # run -> RunStates of the latest runs (NOTE [ Datasets that
                                   # keep their own state ])

    def open(self, spec: LoaderSpec) -> Session:
        """Start the loader's processes and shared memory for its runs."""
        self.session = Session(spec)
        return self.session

    def stop(self) -> None:
        """Stop the session (NOTE [ ShmLoader processes and shutdown ] in
        shared/messages.py): no run is live any more.  Interrupted (a
        Ctrl-C while it waits for the children), it is done by the next
        call: close() again, __del__ or interpreter exit."""
        session = self.session
        if session is None:
            return
        session.stop(self.count)
        moved = session.kept_moved_out()
        self.moved_out = (self.moved_out[0] + moved[0], self.moved_out[1] + moved[1])
        self.forget()

    def forget(self) -> None:
        """The session is gone, or not this process's to stop (a forked
        copy of the loader): no run is live any more."""
        self.session = None
        self.inboxes.clear()
        self.unended.clear()
        self.current = self.ahead = None

    def kept_moved_out(self) -> tuple[int, int]:
        """Slabs (and their bytes) moved out of the pool since the loader started."""
        slabs, nbytes = self.moved_out
        if self.session is not None:  # the pool's book now
            now = self.session.kept_moved_out()
            slabs, nbytes = slabs + now[0], nbytes + now[1]
        return slabs, nbytes

    def abandon(self) -> None:
        """A state was loaded: main reads neither the current run nor the
        one started ahead any more (without a session, there is none)."""
        self.end(self.current)
        self.end(self.ahead)
        self.current = self.ahead = None

    def route(self, msg) -> None:
        """File a message under its run: the runs main still reads get it;
        a batch of a run main abandoned is released at once."""
        kind = type(msg)
        if kind is _protocol.DatasetState:
            book = self.own_books.get(msg.run)
            if book is not None:
                book.record(msg)
            return
        if kind is _protocol.MemoryWait:
            # A wake-up only: every caller receives again, and _receive
            # moves what the loop keeps out of the pool while MEMORY_WAIT is
            # set.  (If the loop keeps nothing, the pool is full of batches
            # loading ahead, a cap under prefetch's needs: stats() says so.)
            return
        if kind is _protocol.RunEnded:
            self.unended.discard(msg.run)
        inbox = self.inboxes.get(msg.run)
        if inbox is not None:
            inbox.append(msg)
        elif kind is _protocol.BatchReady:
            self.session.give_back(msg)

    def next_of(self, run: int, deadline, held: dict | None = None):
        """The run's next message; held: the batches its epoch received
        ahead of their turn (they move out of the pool if it runs short)."""
        inbox = self.inboxes[run]
        while not inbox:
            self.route(self.session.receive(deadline, lambda: self.copy_out_held(held)))
        return inbox.popleft()

    def wait_for(self, run: int, ready: Callable[[], bool]) -> None:
        """Take messages until ready() (what the workers report of a run as
        it begins or ends: NOTE [ Datasets that keep their own state ]), or
        until nothing more of the run can come (its RunEnded came, or the
        processes stopped), within the loader's timeout."""
        if self.session is None:
            return
        timeout = self.live.now.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready() and run in self.unended:
            self.route(self.session.receive(deadline, self.copy_out_held))

    def copy_out_held(self, held: dict | None = None) -> None:
        """The batcher waits for memory: every batch main holds back (filed
        for a run, or in `held`) moves out of the pool, since the batch the
        loop waits for may need its memory (NOTE [ Kept batch memory ])."""
        copy_out = self.session.copy_out
        for inbox in self.inboxes.values():
            for i, msg in enumerate(inbox):
                if type(msg) is _protocol.BatchReady:
                    inbox[i] = copy_out(msg)
        if held:
            for key, msg in held.items():
                held[key] = copy_out(msg)

    def limit(self, run: Run, yielded: int, rowless: int = 0) -> int:
        """Units workers may load once `yielded` batches were yielded: those
        of the next `prefetch` batches.  (Iterable runs: per worker.)  A run
        started ahead shares `prefetch` with the epoch still running: it is
        given a negative `yielded`, minus the batches that epoch has left.
        rowless: first-ready, the run's samples that failed before they
        took a row (its epoch counts them: MapEpoch.rowless)."""
        if run.batches is None:  # each stream's next batches (a resumed one starts further)
            ahead = self.session.spec.worker_prefetch + self.session.spec.shuffle_batches
            return [j + ahead for j in run.plan.progress.first_batches()]
        upto = max(min(yielded + self.live.now.prefetch, run.plan.nbatches), 0)
        feed = run.plan.feed
        if feed is not None and feed.failure is not None:  # (NOTE [ Int indices ])
            upto = min(upto, feed.whole_batches(run.batches))
        if run.plan.claims_batches:  # workers claim whole batches
            return upto
        if upto <= 0:
            return 0
        # First-ready, rows fill in arrival order: a position whose sample
        # failed took no row, so the positions that fill the next `prefetch`
        # batches reach one further for each (else, once as many failed as a
        # batch has rows, no batch could fill and the workers would wait).
        return run.batches.span(upto - 1)[1] + rowless

    def open_limit(self, run: Run, yielded: int, rowless: int = 0) -> int:
        """limit(), once a streamed sampler has written the indices of
        every position below it (NOTE [ Streamed samplers ]), or below its
        failure (NOTE [ Int indices ]: the epoch raises it).  A run whose
        sampler (without len()) ended there is settled first: its final
        length is stored before the LIMIT that reaches it, and the run main
        holds (current, ahead) is replaced by the settled one."""
        settled, limit = self._fed_limit(run, yielded, rowless)
        if settled is not run:
            plan = settled.plan
            self.session.shared.control.settle_run(run.id, plan.kept, plan.units, plan.nbatches)
            if self.current is run:
                self.current = settled
            if self.ahead is run:
                self.ahead = settled
        return limit

    def _fed_limit(self, run: Run, yielded: int, rowless: int = 0) -> tuple[Run, int]:
        """(the run, settled if its sampler just ended; its limit()), the
        indices below that limit written."""
        feed = run.plan.feed
        if feed is None or run.batches is None:
            return run, self.limit(run, yielded, rowless)
        # (needed=0: a failure is kept in the feed, not raised here: the epoch
        # that owns the run raises it at the batch it stopped: MapEpoch._raise_feed_failure)
        if isinstance(feed, BatchFeed):  # its batches' offsets first: limit() reads them
            feed.feed_batches(max(min(yielded + self.live.now.prefetch, run.plan.nbatches), 0),
                              needed=0)
        else:
            feed.feed(self._positions_below(run, self.limit(run, yielded, rowless)), needed=0)
        feed.release_below(run.plan.progress.run_prefix())
        plan = settled_plan(run.plan, self.live.now)
        if plan is not None:
            run = run._replace(plan=plan, batches=plan.progress.batches)
        return run, self.limit(run, yielded, rowless)

    @staticmethod
    def _positions_below(run: Run, limit: int) -> int:
        """The run positions below a LIMIT (in batches when claimed whole)."""
        if not run.plan.claims_batches:
            return limit
        return run.batches.span(limit - 1)[1] if limit > 0 else 0

    def start(self, epoch, resume: dict | None = None, snapshot=None,
                   yielded: int = 0) -> Run:
        """Start a pass over the data for `epoch` (see NOTE [ Runs ]);
        yielded: see limit()."""
        run_id = self.count + 1
        timeout = self.live.now.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while run_id - 2 in self.unended:  # its block is about to be reused
            self.route(self.session.receive(deadline, self.copy_out_held))
        plan = self.planner.plan(epoch, resume, snapshot)
        if plan.shipped is not None:
            self.session.shared.write_order(run_id, plan.shipped)
        elif plan.remaining is not None:
            self.session.shared.write_order(run_id, plan.remaining.words())
        elif plan.feed is not None:
            plan.feed.attach(self.session.shared.order_fd(run_id))
        carried = self._carried(run_id, plan)
        if carried is not None:
            self.session.shared.write_snapshot(run_id, carried)
        self.planner.tell_order(plan)
        batches = None if self.live.now.iterable else plan.progress.batches
        run, limit = self._fed_limit(Run(run_id, plan, batches), yielded)
        plan = run.plan
        self.count = run_id
        self.unended.add(run_id)
        self.inboxes[run_id] = collections.deque()
        self.session.shared.control.start_run(run_id, RunWords(
            epoch=epoch, size=plan.size, kept=plan.kept, units=plan.units,
            nbatches=plan.nbatches, order=plan.order_kind, order_seed=plan.order_seed,
            offsets=offsets_word(plan), base_seed=plan.base_seed, limit=limit,
            snapshot=int(carried is not None), resumed=int(plan.remaining is not None),
            open_ended=int(plan.feed is not None and plan.feed.open and not plan.feed.settled)))
        return run

    def _carried(self, run_id: int, plan: Plan) -> RunDataset | None:
        """What the run carries for the dataset's copies (None: nothing):
        its snapshot of the epoch, and for a dataset that keeps its own
        state, the states its workers load first; main's own copy (thread
        workers) begins the run here, before it is published."""
        own, states = plan.own, None
        if own is not None:
            own.run = run_id
            self.own_books[run_id] = own
            for old in [r for r in self.own_books if r < run_id - 2]:
                del self.own_books[old]
            if own.in_main:
                own.begin_in_main(self.live.now.dataset, plan.own_load)
            else:
                states = plan.own_load
        if plan.snapshot is None and states is None:
            return None
        return RunDataset(plan.snapshot, states)

    def end(self, run: Run | None) -> None:
        """Main will read no more of this run: its workers stop, and its
        batches are released as they come."""
        if run is None:
            return
        self.session.shared.control.end_run(run.id)
        for msg in self.inboxes.pop(run.id, ()):
            if type(msg) is _protocol.BatchReady:
                self.session.give_back(msg)

    def run_for(self, epoch, resume: dict | None) -> Run:
        """The run for `epoch`: the one started ahead if len(dataset) has not
        changed since, else a new one."""
        ahead, self.ahead = self.ahead, None
        self.end(self.current)  # an iterator this one supersedes
        self.current = None
        snapshot = self.planner.snapshot(epoch)  # the dataset as this epoch starts
        if ahead is not None and resume is None and ahead.plan.epoch == epoch and \
                ahead.plan.size == self.live.now.dataset_len() and ahead.plan.snapshot == snapshot:
            self.current = ahead
            return ahead
        self.end(ahead)
        self.current = self.start(epoch, resume, snapshot)
        return self.current

    def advance(self, run: Run, yielded: int, left: int, rowless: int = 0) -> Run:
        """`yielded` batches of run were handed out (or, first-ready,
        `rowless` samples of it failed before they took a row: limit()):
        raise its LIMIT, and that of the run started ahead, which has
        `left` (minus the batches run has still to hand out) to share.
        Returns the run, settled if its sampler (without len()) just ended
        (NOTE [ Streamed samplers ])."""
        control = self.session.shared.control
        control.set_limit(run.id, self.open_limit(run, yielded, rowless))
        current = self.current
        if current is not run and current is not None and current.id == run.id:
            run = current  # settled
        if self.ahead is not None and current is run:
            control.set_limit(self.ahead.id, self.open_limit(self.ahead, left))
        return run

    def start_ahead(self, run: Run, next_epoch: int, left: int) -> None:
        """Every unit of run is claimed: start the next epoch's run now, if
        the loader runs ahead and none is started (NOTE [ Runs ])."""
        if self.ahead is None and self.live.now.runs_ahead() and run.id - 1 not in self.unended:
            self.ahead = self.start(next_epoch, yielded=left)

    def epoch_closed(self, epoch: int, run: Run, *, finished: bool, pending) -> None:
        """The iterator of `epoch` and its run is done (ran to its end, or
        dropped early): batches received but not handed out go back, and
        the run ends unless it ran to its end (a run an iterator made since
        superseded is that one's).  Without persistent workers, the
        processes stop then, unless a newer iterator, already made, owns
        them."""
        if self.current is run:
            if not finished:
                for msg in pending:
                    self.session.give_back(msg)
                self.end(run)
                self.current = None
            else:
                self.inboxes.pop(run.id, None)
        if not self.live.now.persistent_workers and self.current_epoch.is_current(epoch):
            self.stop()

    def index_at(self, run_id: int, pos: int):
        """The dataset index at position pos of a map-style run main still
        has (the current one, or the one started ahead), else None."""
        run = next((r for r in (self.current, self.ahead) if r is not None and r.id == run_id),
                   None)
        if run is None or run.batches is None or not 0 <= pos < run.plan.kept:
            return None
        if run.plan.feed is not None:
            return run.plan.feed.index(pos)
        spec = self.live.now
        return _order.index_getter(order_of(run.plan, spec.rank, spec.world))(pos)
