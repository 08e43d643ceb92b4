"""The habits of real training code, with `from loader import DataLoader`
judged against torch.utils.data.DataLoader run the same way (issue 14):
epochs left early (break, a next(iter(loader)) peek, an exception), several
live iterators.  Every scenario runs on both loaders from the same seeds;
the batches, and the generators' states afterwards, must be equal.  The
resume habit (a state taken in the first epoch) is in test_resume.py."""

import gc
import json
import os
import signal
import sys
import threading
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.utils.data as tud  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from conftest import descendants  # noqa: E402
from loader import DataLoader, StateError  # noqa: E402
from torch_conformance_datasets import NamedTupleDataset  # noqa: E402

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

N = 100


# The same tolerance of torch's feeder threads as the parity tests (autouse).
from test_dataloader_parity import torch_feeder_threads_may_lose_their_pipes  # noqa: E402,F401


class FailsAt(tud.Dataset):
    """Sample i is i, except that the indices in `bad` raise ValueError."""

    def __init__(self, n=N, bad=()):
        self.n, self.bad = n, set(bad)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.bad:
            raise ValueError(f"bad sample {i}")
        return i


def ids(batch) -> list:
    x = batch[0] if isinstance(batch, (list, tuple)) else batch
    return x.reshape(-1).tolist()


def both(scenario, **kwargs):
    """scenario(loader) run on torch's DataLoader and on ours, each from
    the same global seed and a fresh generator: what it returned and the
    generators' states after it must be equal."""
    results = []
    for cls in (tud.DataLoader, DataLoader):
        torch.manual_seed(11)
        gen = torch.Generator().manual_seed(5)
        kw = {k: (v(gen) if callable(v) else v) for k, v in kwargs.items()}
        loader = cls(kw.pop("dataset", TensorDataset(torch.arange(N))), generator=gen, **kw)
        out = scenario(loader)
        results.append((out, gen.get_state(), torch.get_rng_state()))
        if cls is DataLoader:
            loader.close()
        del loader
        gc.collect()
    (theirs, their_gen, their_global), (ours, our_gen, our_global) = results
    assert ours == theirs
    assert torch.equal(our_gen, their_gen), "the loader's generator is not where torch left it"
    assert torch.equal(our_global, their_global), "torch's global generator is not where torch left it"
    return ours


def full_epochs(loader, n=2):
    return [[ids(b) for b in loader] for _ in range(n)]


def left_by_break(loader):
    for b in loader:
        first = ids(b)
        break
    return [first] + full_epochs(loader)


def left_by_peek(loader):
    return [ids(next(iter(loader)))] + full_epochs(loader)


def left_by_exception(loader):
    seen = []
    with pytest.raises(KeyError):
        for i, b in enumerate(loader):
            seen.append(ids(b))
            if i == 1:
                raise KeyError("the training step failed")
    return seen + full_epochs(loader)


SAMPLERS = {
    "shuffle": dict(batch_size=10, shuffle=True),
    "shuffle, odd sizes": dict(batch_size=7, shuffle=True, drop_last=True),
    "unbatched": dict(batch_size=None, shuffle=True),
    # draws 32 indices at a time as it is pulled
    "replacement": dict(batch_size=6, sampler=lambda g: tud.RandomSampler(
        range(N), replacement=True, num_samples=150, generator=g)),
    "user batch sampler": dict(batch_sampler=lambda g: tud.BatchSampler(
        tud.RandomSampler(range(N), generator=g), 9, False)),
}


@pytest.mark.pairwise  # the default run: a pairwise-covering subset (conftest.py); all with -m stress
@pytest.mark.parametrize("how", [left_by_break, left_by_peek, left_by_exception],
                         ids=["break", "peek", "exception"])
@pytest.mark.parametrize("case", list(SAMPLERS))
@pytest.mark.parametrize("workers", [0, 2], ids=["nw0", "nw2"])
def test_epochs_after_one_left_early_have_torchs_order(how, case, workers):
    """Issue 14 item 2 (repro_dl_break_epoch_order.py): torch's samplers draw
    from the generator as they are pulled (a trailing randperm only once
    exhausted, 32 indices at a time with replacement); after an epoch left
    early, every later epoch and the generator must be where torch's are."""
    out = both(how, num_workers=workers, **SAMPLERS[case])
    whole = {"shuffle, odd sizes": N // 7 * 7, "replacement": 150}.get(case, N)
    for epoch in out[-2:]:
        flat = [x for b in epoch for x in b]
        assert len(flat) == whole
        if whole == N:  # a permutation: every sample exactly once
            assert sorted(flat) == list(range(N))


class GlobalDraws(tud.Sampler):
    """Draws each index from torch's global generator as it is pulled (a
    custom sampler written the short way): every pull moves the generator
    the training loop's dropout draws from."""

    def __len__(self):
        return N

    def __iter__(self):
        for _ in range(N):
            yield int(torch.randint(N, ()))


class LateDraw(tud.Sampler):
    """Yields 0..39 as they are, then a permutation of the rest drawn from
    its generator: its first draw comes after 40 pulls that drew nothing."""

    def __init__(self, generator):
        self.generator = generator

    def __len__(self):
        return N

    def __iter__(self):
        yield from range(40)
        yield from (40 + torch.randperm(N - 40, generator=self.generator)).tolist()


LAZY_SAMPLERS = {
    "global draws per index": dict(batch_size=10, sampler=lambda g: GlobalDraws()),
    "a late first draw": dict(batch_size=10, sampler=lambda g: LateDraw(g)),
    "a user batch sampler of global draws": dict(batch_sampler=lambda g: tud.BatchSampler(
        GlobalDraws(), 9, False)),
}


def loop_that_draws(loader):
    """Each step draws from the global generator (dropout, augmentation in
    the loop), leaves the first epoch after 3 batches, then runs two."""
    out = []
    for epoch in range(3):
        seen = []
        for i, b in enumerate(loader):
            seen.append(ids(b) + [float(torch.rand(()))])
            if epoch == 0 and i == 2:
                break
        out.append(seen)
    return out


@pytest.mark.parametrize("case, how", [
    ("global draws per index", left_by_break), ("global draws per index", left_by_peek),
    ("a late first draw", left_by_break), ("a late first draw", loop_that_draws),
    ("a user batch sampler of global draws", left_by_exception)])
@pytest.mark.parametrize("workers", [0, 2], ids=["nw0", "nw2"])
def test_samplers_that_draw_as_they_are_pulled_move_the_generators_as_torchs(case, how,
                                                                               workers):
    """Issue 19: loader.DataLoader pulls a user's sampler a window ahead
    of its workers, never whole, in generator states of its own; the
    generators the loop sees move only as torch's iterator moves them
    (NOTE [ Drawing the order as torch does ]).  The batches, the loop's
    own draws and the generators afterwards equal torch's."""
    out = both(how, num_workers=workers, **LAZY_SAMPLERS[case])
    per_epoch = -(-N // (9 if "batch sampler" in case else 10))
    assert [len(e) for e in out[-2:]] == [per_epoch] * 2


@pytest.mark.parametrize("how", [left_by_break, left_by_peek], ids=["break", "peek"])
def test_persistent_workers_after_an_epoch_left_early_have_torchs_order(how):
    out = both(how, num_workers=2, persistent_workers=True, batch_size=10, shuffle=True)
    assert [sorted(x for b in e for x in b) for e in out[1:]] == [list(range(N))] * 2


@pytest.mark.parametrize("workers", [0, 2])
def test_errors_in_dataset_take_their_indices_as_torch(workers):
    """A batch whose sample raised counts as taken: the loop goes on past
    it, leaves the epoch early, and the next epoch is torch's."""
    def batches(loader, n):
        it, seen = iter(loader), []
        while len(seen) < n:
            try:
                seen.append(ids(next(it)))
            except ValueError as e:  # (with workers: the worker's traceback, then this line)
                seen.append(str(e).strip().splitlines()[-1].removeprefix("ValueError: "))
            except StopIteration:
                break
        return seen

    def scenario(loader):
        return [batches(loader, 5), batches(loader, N), batches(loader, N)]

    left, *whole = both(scenario, dataset=FailsAt(bad=[7, 61]), num_workers=workers,
                        batch_size=10, shuffle=True)
    assert len(left) == 5
    for epoch in whole:  # two batches failed; every sample of the others once
        assert sorted(b for b in epoch if isinstance(b, str)) == ["bad sample 61", "bad sample 7"]
        delivered = [x for b in epoch if not isinstance(b, str) for x in b]
        assert len(delivered) == len(set(delivered)) == N - 20
        assert not {7, 61} & set(delivered)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_peek_inside_the_loop_leaves_the_epoch_whole(workers):
    """Issue 14 item 3 (repro_dl_second_iterator.py): next(iter(loader)) in
    the loop is a second live iterator: the first goes on."""
    def scenario(loader):
        seen, previews = [], []
        for i, b in enumerate(loader):
            seen.append(ids(b))
            if i in (2, 5):
                previews.append(ids(next(iter(loader))))
        return [seen, previews]

    seen, previews = both(scenario, num_workers=workers, batch_size=10)
    assert [x for b in seen for x in b] == list(range(N)) and previews == [list(range(10))] * 2
    seen, previews = both(scenario, num_workers=workers, batch_size=10, shuffle=True)
    assert sorted(x for b in seen for x in b) == list(range(N)) and len(previews) == 2


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_zip_of_a_loader_with_itself_gives_two_whole_epochs(shuffle, workers):
    """Both iterators are made before either yields: torch draws each one's
    base seed as it is made (and with workers its order too)."""
    def scenario(loader):
        return [[ids(a), ids(b)] for a, b in zip(loader, loader)]

    out = both(scenario, num_workers=workers, batch_size=10, shuffle=shuffle)
    assert len(out) == N // 10
    for side in (0, 1):
        assert sorted(x for pair in out for x in pair[side]) == list(range(N))


def test_two_iterators_each_run_their_own_workers_to_the_end():
    """Interleaved by hand, one abandoned halfway, then a third: each live
    iterator yields its whole epoch, and nothing is left running (the
    autouse guards check the processes)."""
    def scenario(loader):
        a, b = iter(loader), iter(loader)
        got_a = [ids(next(a)) for _ in range(4)]
        got_b = [ids(x) for x in b]
        got_a += [ids(x) for x in a]
        c = iter(loader)
        half = [ids(next(c)) for _ in range(5)]
        del c
        return [got_a, got_b, half, full_epochs(loader, 1)[0]]

    got_a, got_b, half, last = both(scenario, num_workers=2, batch_size=10, shuffle=True)
    for epoch in (got_a, got_b, last):
        assert sorted(x for b in epoch for x in b) == list(range(N))
    assert len(half) == 5


def test_with_persistent_workers_iter_resets_the_one_iterator_as_torch():
    """torch keeps one iterator with persistent workers: iter() resets it,
    so a peek inside the loop starts a new epoch that the loop goes on
    with, and zip(loader, loader) alternates over one epoch."""
    def peek(loader):
        seen = []
        for i, b in enumerate(loader):
            seen.append(ids(b))
            if i == 2:
                seen.append(ids(next(iter(loader))))
        return seen

    def zipped(loader):
        return [[ids(a), ids(b)] for a, b in zip(loader, loader)]

    def same_object(loader):
        return [iter(loader) is iter(loader)]

    for scenario in (peek, zipped, same_object):
        out = both(scenario, num_workers=2, persistent_workers=True, batch_size=10)
    assert out == [True]


def test_no_warning_torch_does_not_give_when_another_thread_is_alive():
    """Issue 14 item 4 (repro_dl_fork_thread_warning.py): tqdm's monitor
    thread or Lightning's process observer is alive as workers start; torch
    says nothing, so under -W error neither may loader.DataLoader, at any
    epoch, persistent or not."""
    stop = threading.Event()
    monitor = threading.Thread(target=stop.wait, name="monitor")
    monitor.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for persistent in (False, True):
                loader = DataLoader(TensorDataset(torch.arange(40)), batch_size=8, num_workers=2,
                                    persistent_workers=persistent)
                for _ in range(3):
                    assert torch.cat([b[0] for b in loader]).tolist() == list(range(40))
                loader.close()
    finally:
        stop.set()
        monitor.join()


@pytest.mark.parametrize("batch_size", [2, None])
def test_a_namedtuple_pickle_cannot_find_loads_without_workers(batch_size):
    """Issue 14 item 6 (repro_dl_namedtuple_nw0.py): nothing leaves the
    process with num_workers=0, so nothing may need pickling."""
    def scenario(loader):
        out = []
        for b in loader:
            assert type(b) is NamedTupleDataset.Batch
            out.append([b.data.tolist(), torch.as_tensor(b.label).tolist()])
        return out

    out = both(scenario, dataset=NamedTupleDataset(), batch_size=batch_size, num_workers=0)
    assert len(out) == (3 if batch_size else 6)


def test_iterator_workers_are_the_worker_processes():
    """Issue 14 item 8: upstream tests and tools read iterator._workers
    (pid, is_alive(), join(), exitcode)."""
    loader = DataLoader(TensorDataset(torch.arange(40)), batch_size=4, num_workers=3)
    it = iter(loader)
    workers = it._workers
    assert len(workers) == 3 and len({w.pid for w in workers}) == 3
    assert all(w.is_alive() and w.exitcode is None for w in workers)
    assert all(os.path.exists(f"/proc/{w.pid}") for w in workers)
    assert torch.cat([b[0] for b in it]).tolist() == list(range(40))
    for w in workers:  # without persistent workers they leave at the epoch's end
        w.join(30)
        assert not w.is_alive() and w.exitcode == 0
    partial = iter(loader)
    workers = partial._workers
    assert next(partial)[0].tolist() == [0, 1, 2, 3]
    del partial  # an abandoned iterator's workers leave too
    for w in workers:
        w.join(30)
        assert not w.is_alive()
    loader.close()
    assert iter(DataLoader(TensorDataset(torch.arange(4)), num_workers=0))._workers == []


class WhoLoads(tud.Dataset):
    """Sample i: [the worker id, its pid] of the worker that loaded it."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        info = tud.get_worker_info()
        return torch.tensor([info.id, os.getpid()])


def test_iterator_workers_stay_listed_once_the_epoch_ended():
    """Issue 29 item 4 (upstream test_get_worker_info): once the epoch ran
    to its end without persistent workers, torch's iterator still lists its
    workers, by worker id; the pid each row was loaded in is the listed
    worker's of its id, and they have ended."""
    loader = DataLoader(WhoLoads(), batch_size=2, num_workers=2)
    it = iter(loader)
    rows = torch.cat(list(it)).tolist()
    workers = it._workers
    assert len(workers) == 2 and {wid for wid, _ in rows} == {0, 1}
    assert all(pid == workers[wid].pid for wid, pid in rows)
    for w in workers:
        w.join(30)
        assert not w.is_alive() and w.exitcode == 0
    loader.close()


@pytest.mark.parametrize("persistent", [False, True])
def test_shutdown_workers_stops_them_and_the_next_iter_starts_new_ones(persistent):
    """Issue 29 item 4 (upstream test_shuffler_iterdatapipe): tools call
    `loader._iterator._shutdown_workers()` and set `loader._iterator = None`
    (mid-epoch or after it); the workers are gone, and the next iter()
    gives a whole epoch on new ones."""
    loader = DataLoader(TensorDataset(torch.arange(40)), batch_size=4, num_workers=2,
                        persistent_workers=persistent)
    it = iter(loader)
    next(it)
    workers = it._workers
    it._shutdown_workers()
    for w in workers:
        w.join(30)
        assert not w.is_alive()
    assert next(it, None) is None
    loader._iterator = None
    again = iter(loader)
    assert torch.cat([b[0] for b in again]).tolist() == list(range(40))
    assert not {w.pid for w in again._workers} & {w.pid for w in workers}
    again._shutdown_workers()
    loader._iterator = None
    loader.close()


def _numbers(n: int = 400) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _samples(batches) -> list:
    return torch.cat([b[0] for b in batches]).tolist()


def _joined(workers) -> list:
    """The exit codes of `workers` once each has ended (bounded wait)."""
    for w in workers:
        w.join(30)
    return [w.exitcode for w in workers]


def test_a_finished_iterator_keeps_listing_its_own_workers_beside_a_new_one():
    """Issue 29 item 4: without persistent workers each pass has workers
    of its own; the first iterator, its pass over, still lists the
    workers it ran on (ended, exit code 0), not the next pass's."""
    loader = DataLoader(_numbers(), batch_size=8, num_workers=2)
    first = iter(loader)
    started = [w.pid for w in first._workers]
    assert _samples(first) == list(range(400))
    second = iter(loader)
    assert next(second)[0].tolist() == list(range(8))
    assert [w.pid for w in first._workers] == started and len(started) == 2
    assert _joined(first._workers) == [0, 0]
    assert not {w.pid for w in second._workers} & set(started)
    assert [w.is_alive() for w in second._workers] == [True, True]
    assert _samples(second) == list(range(8, 400))
    loader.close()


@pytest.mark.parametrize("persistent", [False, True])
def test_iterator_workers_stay_listed_after_shutdown_workers(persistent):
    """torch's iterator keeps `_workers` after _shutdown_workers(): the same
    processes, ended."""
    loader = DataLoader(_numbers(), batch_size=8, num_workers=2, persistent_workers=persistent)
    it = iter(loader)
    next(it)
    started = [w.pid for w in it._workers]
    it._shutdown_workers()
    assert [w.pid for w in it._workers] == started and len(started) == 2
    assert all(code is not None for code in _joined(it._workers))
    assert [w.is_alive() for w in it._workers] == [False, False]
    loader.close()


def test_shutdown_workers_of_a_finished_iterator_leaves_the_next_passes_workers():
    """Issue 29 item 4: _shutdown_workers() on an iterator whose pass is over
    (as a tool that kept it calls it) stopped the loader's workers, which
    by then served the next iterator: its pass ended with "the loader is
    closed".  Now that pass goes on to its end on the same workers."""
    loader = DataLoader(_numbers(), batch_size=8, num_workers=2)
    first = iter(loader)
    assert _samples(first) == list(range(400))
    second = iter(loader)
    assert next(second)[0].tolist() == list(range(8))
    running = [w.pid for w in second._workers]
    first._shutdown_workers()
    first._shutdown_workers()
    assert [w.is_alive() for w in second._workers] == [True, True]
    assert _samples(second) == list(range(8, 400))
    assert [w.pid for w in second._workers] == running
    loader.close()


@pytest.mark.parametrize("which", ["first", "second"])
def test_shutdown_workers_of_one_of_two_live_iterators_stops_only_its_own(which):
    """Two passes at once (the second on workers of its own, as in torch):
    _shutdown_workers() of either stops its workers only; the other pass
    gives the rest of its epoch exactly."""
    loader = DataLoader(_numbers(), batch_size=8, num_workers=2)
    first, second = iter(loader), None
    assert next(first)[0].tolist() == list(range(8))
    second = iter(loader)
    assert next(second)[0].tolist() == list(range(8))
    stopped, other = (first, second) if which == "first" else (second, first)
    stopped._shutdown_workers()
    assert all(code is not None for code in _joined(stopped._workers))
    assert next(stopped, None) is None
    assert [w.is_alive() for w in other._workers] == [True, True]
    assert _samples(other) == list(range(8, 400))
    loader.close()


@pytest.mark.parametrize("forget", [True, False], ids=["iterator_set_to_None", "iterator_kept"])
@pytest.mark.parametrize("persistent", [False, True])
def test_shutdown_workers_twice_mid_epoch_then_a_whole_new_epoch(persistent, forget):
    """Mid-epoch, twice (idempotent): the workers end, the iterator yields
    nothing more; the next pass, whether the tool sets the loader's
    _iterator to None (Lightning, torch's tests) or not, is a whole epoch on
    new workers, and a third one after it too."""
    loader = DataLoader(_numbers(), batch_size=8, num_workers=2, persistent_workers=persistent)
    it = iter(loader)
    assert next(it)[0].tolist() == list(range(8))
    old = it._workers
    it._shutdown_workers()
    it._shutdown_workers()
    assert all(code is not None for code in _joined(old))
    assert next(it, None) is None
    if forget:
        loader._iterator = None
    again = iter(loader)
    assert _samples(again) == list(range(400))
    assert len(again._workers) == 2
    assert not {w.pid for w in again._workers} & {w.pid for w in old}
    assert _samples(loader) == list(range(400))
    loader.close()


def _held_resources() -> tuple:
    """(open fds, child processes, this process's /dev/shm entries)."""
    own = f"-{os.getpid()}-"
    return (len(os.listdir("/proc/self/fd")), len(descendants()),
            len([e for e in os.listdir("/dev/shm") if own in e]))


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("how", ["_shutdown_workers", "close", "end_of_pass"])
def test_shutdown_workers_frees_what_close_and_the_end_of_a_pass_free(how, persistent):
    """What an iterator's workers hold (processes, their fds, shared memory)
    is given back by _shutdown_workers() as by close() and by the end of a
    pass without persistent workers: all of it, the mappings when the loader
    goes."""
    if how == "end_of_pass" and persistent:
        pytest.skip("persistent workers outlive the pass by design")
    gc.collect()
    before, maps_before = _held_resources(), _mappings()
    loader = DataLoader(_numbers(), batch_size=8, num_workers=2, persistent_workers=persistent)
    it = iter(loader)
    assert next(it)[0].tolist() == list(range(8))
    assert _held_resources()[1] >= 3  # two workers and the batcher
    if how == "_shutdown_workers":
        it._shutdown_workers()
    elif how == "close":
        loader.close()
    else:
        assert len(list(it)) == 49
    assert _held_resources() == before
    del it, loader
    gc.collect()
    assert _mappings() == maps_before


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_iterators_are_of_torchs_iterator_classes(workers, persistent):
    """Tools test the iterator's class: Lightning shuts down the workers of
    a _MultiProcessingDataLoaderIter only, and leaves any
    _BaseDataLoaderIter out of what it pickles."""
    from torch.utils.data.dataloader import (_BaseDataLoaderIter, _MultiProcessingDataLoaderIter,
                                             _SingleProcessDataLoaderIter)

    loader = DataLoader(_numbers(40), batch_size=8, num_workers=workers,
                        persistent_workers=persistent and workers > 0)
    it = iter(loader)
    kind = _MultiProcessingDataLoaderIter if workers else _SingleProcessDataLoaderIter
    other = _SingleProcessDataLoaderIter if workers else _MultiProcessingDataLoaderIter
    assert isinstance(it, kind) and isinstance(it, _BaseDataLoaderIter)
    assert not isinstance(it, other)
    assert _samples(it) == list(range(40))
    loader.close()


_LIGHTNING_RESET = """
import json, torch
from torch.utils.data import TensorDataset
from pytorch_lightning.utilities.combined_loader import CombinedLoader
from loader import DataLoader

loader = DataLoader(TensorDataset(torch.arange(400)), batch_size=8, num_workers=2,
                    persistent_workers=True)
combined = CombinedLoader([loader], mode="sequential")
iter(combined)
batch, _, _ = next(combined)
workers = loader._iterator._workers
combined.reset()
forgotten = loader._iterator is None
for w in workers:
    w.join(30)
again = iter(loader)
print(json.dumps({"first": batch[0].tolist(), "iterator_forgotten": forgotten,
                  "exitcodes": [w.exitcode for w in workers],
                  "next_epoch": torch.cat([b[0] for b in again]).tolist(),
                  "shared_pids": sorted({w.pid for w in again._workers}
                                        & {w.pid for w in workers})}))
loader.close()
"""


@pytest.mark.stress  # importing Lightning takes a minute and more on a loaded machine
@pytest.mark.timeout(900)
def test_lightnings_reset_shuts_the_persistent_workers_down():
    """Lightning's CombinedLoader.reset() (the end of fit, validate, ...)
    calls _shutdown_workers() on a _MultiProcessingDataLoaderIter only, then
    sets the loader's _iterator to None: the persistent workers end then, as
    torch's do (they stayed until the loader went), and the next pass starts
    new ones.  In a program of its own: Lightning's import is slow and warns."""
    pytest.importorskip("pytorch_lightning")
    from test_frameworks import _run

    record = json.loads(_run([sys.executable, "-W", "ignore", "-c", _LIGHTNING_RESET],
                             timeout=800).stdout.strip().splitlines()[-1])
    assert record["first"] == list(range(8)) and record["iterator_forgotten"]
    assert record["exitcodes"] == [0, 0]
    assert record["next_epoch"] == list(range(400))
    assert record["shared_pids"] == []


def test_iterator_workers_terminate_as_processes_do():
    """Upstream's test_iterable_style_dataset (persistent workers) calls
    terminate() on every entry of _workers once they have exited: a no-op
    then; on a live worker it is SIGTERM, reported as any worker's death."""
    loader = DataLoader(TensorDataset(torch.arange(40)), batch_size=4, num_workers=2,
                        persistent_workers=True, timeout=30)
    it = iter(loader)
    assert torch.cat([b[0] for b in it]).tolist() == list(range(40))
    victim, other = it._workers
    victim.terminate()
    victim.join(10)
    assert not victim.is_alive() and victim.exitcode == -signal.SIGTERM
    victim.terminate()  # exited: nothing to do
    victim.kill()
    with pytest.raises(RuntimeError, match=f"pid {victim.pid}"):
        list(loader)
    loader.close()
    other.join(10)
    assert not other.is_alive()
    other.terminate()


def test_persistent_iterator_workers_stay_across_epochs_until_close():
    loader = DataLoader(TensorDataset(torch.arange(20)), batch_size=5, num_workers=2,
                        persistent_workers=True)
    pids = []
    for _ in range(2):
        it = iter(loader)
        pids.append([w.pid for w in it._workers])
        assert len(list(it)) == 4
        assert all(w.is_alive() for w in it._workers)
    assert pids[0] == pids[1] and len(pids[0]) == 2
    workers = it._workers
    loader.close()
    for w in workers:
        w.join(30)
        assert not w.is_alive()


def test_a_loader_pickles_and_copies_without_its_workers():
    """Frameworks pickle or deep-copy loaders (spawned processes, Lightning):
    the copy has the arguments and starts workers of its own."""
    import copy
    import pickle

    loader = DataLoader(TensorDataset(torch.arange(12)), batch_size=4, num_workers=2,
                        persistent_workers=True)
    assert [b[0].tolist() for b in loader][0] == [0, 1, 2, 3]  # the original runs its workers
    for other in (pickle.loads(pickle.dumps(loader)), copy.deepcopy(loader)):
        assert torch.cat([b[0] for b in other]).tolist() == list(range(12))
        other.close()
    assert torch.cat([b[0] for b in loader]).tolist() == list(range(12))
    loader.close()


# --- samplers changed after the loader is made (issue 29, item 1) ----------------------
# NOTE [ The samplers a pass takes ]: accelerate's prepare() calls state_dict()
# (which makes the loader's ShmLoader), then puts its own sampler into the
# BatchSampler; torch's next iter() takes it, and so must ours.

class Reversed(tud.Sampler):
    """n-1 .. 0: a sampler drawing from no generator (pulled a window ahead)."""

    def __init__(self, n=N):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))


SAMPLER_CHANGES = {
    # the source of the order changes: the loader's ShmLoader follows it
    "RandomSampler of its own generator": lambda dl: setattr(
        dl.batch_sampler, "sampler", tud.RandomSampler(range(N), generator=torch.Generator()
                                                       .manual_seed(3))),
    "RandomSampler of the loader's generator": lambda dl: setattr(
        dl.batch_sampler, "sampler", tud.RandomSampler(range(N), generator=dl.generator)),
    "RandomSampler of the global generator": lambda dl: setattr(
        dl.batch_sampler, "sampler", tud.RandomSampler(range(N))),
    "a sampler of the user's": lambda dl: setattr(dl.batch_sampler, "sampler", Reversed()),
    # what the ShmLoader was made with changes: a new one
    "batch_size": lambda dl: setattr(dl.batch_sampler, "batch_size", 7),
    "drop_last": lambda dl: (setattr(dl.batch_sampler, "batch_size", 7),
                             setattr(dl.batch_sampler, "drop_last", True)),
}
ORDERS_BEFORE = {"shuffle": dict(shuffle=True), "sequential": dict(shuffle=False)}
WORKERS_AND_PERSISTENCE = [(0, False), (2, False), (2, True)]


def state_if_any(loader):
    if hasattr(loader, "state_dict"):  # torch's DataLoader has none
        loader.state_dict()


@pytest.mark.pairwise  # the default run: a pairwise-covering subset (conftest.py); all with -m stress
@pytest.mark.parametrize("workers,persistent", WORKERS_AND_PERSISTENCE,
                         ids=["nw0", "nw2", "nw2-persistent"])
@pytest.mark.parametrize("before", list(ORDERS_BEFORE))
@pytest.mark.parametrize("change", list(SAMPLER_CHANGES))
def test_a_sampler_changed_after_state_dict_orders_the_next_pass(change, before, workers,
                                                                  persistent):
    """repro_dl_accelerate_seedable_sampler.py (second part): state_dict()
    made the loader's ShmLoader with the sampler of then; a sampler put into
    the BatchSampler afterwards (or its batch_size, drop_last) orders every
    pass after it, before the first and between two, as torch's: the same
    batches and generator states."""
    def scenario(loader):
        state_if_any(loader)
        SAMPLER_CHANGES[change](loader)
        first = full_epochs(loader, 1)
        state_if_any(loader)  # between passes
        loader.batch_sampler.sampler = tud.RandomSampler(range(N), generator=loader.generator)
        return first + full_epochs(loader)

    both(scenario, batch_size=10, num_workers=workers, persistent_workers=persistent,
         **ORDERS_BEFORE[before])


@pytest.mark.parametrize("workers", [0, 2], ids=["nw0", "nw2"])
def test_a_sampler_changed_during_a_pass_orders_the_next_one(workers):
    """As in torch, the pass in progress keeps the order it began with."""
    def scenario(loader):
        seen = []
        for i, b in enumerate(loader):
            seen.append(ids(b))
            if i == 3:
                state_if_any(loader)  # mid-pass: describes the pass, changes nothing
                loader.batch_sampler.sampler = Reversed()
        return [seen] + full_epochs(loader, 1)

    out = both(scenario, batch_size=10, num_workers=workers, shuffle=True)
    assert out[1] == [list(range(N - 1 - 10 * k, N - 11 - 10 * k, -1)) for k in range(10)]


def test_a_loaded_state_goes_to_the_loader_the_changed_samplers_make():
    """load_state_dict(), then a change that makes a new ShmLoader before
    the resumed pass: the new one resumes the state (drop_last changes
    nothing in 100 samples of 10); a change the state does not fit (the
    batch size) is a StateError at iter(), and the loader goes on once the
    samplers fit again."""
    ds = TensorDataset(torch.arange(N))
    whole = DataLoader(ds, batch_size=10, shuffle=True, num_workers=2,
                       generator=torch.Generator().manual_seed(1))
    it = iter(whole)
    for _ in range(3):
        next(it)
    state = whole.state_dict()
    rest = [ids(b) for b in it]
    whole.close()

    resumed = DataLoader(ds, batch_size=10, shuffle=True, num_workers=2,
                         generator=torch.Generator().manual_seed(1))
    resumed.load_state_dict(state)
    resumed.batch_sampler.drop_last = True
    assert [ids(b) for b in resumed] == rest
    resumed.close()

    refused = DataLoader(ds, batch_size=10, shuffle=True, num_workers=2,
                         generator=torch.Generator().manual_seed(1))
    refused.load_state_dict(state)
    refused.batch_sampler.batch_size = 5
    with pytest.raises(StateError, match="batch_size"):
        iter(refused)
    refused.batch_sampler.batch_size = 10
    assert [ids(b) for b in refused] == rest
    refused.close()
