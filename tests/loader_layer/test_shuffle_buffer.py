"""shuffle_buffer=N (issue 9): a stream's samples go to random rows of a
window of pending batch slabs (the buffer lives in shared memory), so a
stream is shuffled without a second copy; every sample exactly once per
epoch, reproducible with the seed, with several workers, distributed and
resumed."""

import numpy as np
import pytest

from loader import ShmLoader, get_worker_info

pytestmark = pytest.mark.timeout(120)


class Stream:
    """Samples 0..n-1 split between the workers (and ranks); each carries
    its number as an array, a number and a string."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        w, k = (0, 1) if info is None else (info.id, info.num_workers)
        r, world = (0, 1) if info is None else (info.rank, info.world_size)
        for i in range(r * k + w, self.n, k * world):
            yield {"x": np.full(3, i, np.int64), "i": i, "s": f"#{i}"}


def ids_of(batches):
    out = []
    for b in batches:
        i = b["i"].tolist()
        assert b["x"][:, 0].tolist() == i and b["s"] == [f"#{k}" for k in i]
        out += i
    return out


@pytest.mark.parametrize("num_workers", [1, 3])
def test_every_sample_once_in_a_shuffled_order(num_workers):
    n, buf = 2000, 256
    with ShmLoader(Stream(n), batch_size=16, num_workers=num_workers, shuffle_buffer=buf,
                   seed=3) as loader:
        epochs = [ids_of(loader) for _ in range(2)]
    for ids in epochs:
        assert sorted(ids) == list(range(n))
    assert epochs[0] != epochs[1]
    # mixed: within each worker's stream samples move by about its share of the
    # buffer; in order they would not move at all
    displacement = np.mean(np.abs(np.argsort(epochs[0]) - np.arange(n)))
    assert displacement > buf / num_workers / 8, displacement
    with ShmLoader(Stream(n), batch_size=16, num_workers=num_workers, shuffle_buffer=buf,
                   seed=3) as again:
        assert ids_of(again) == epochs[0]  # the seed decides


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_last_batches_are_closed_up(drop_last):
    n = 1003  # the last batches of each stream have holes to close up
    with ShmLoader(Stream(n), batch_size=10, num_workers=2, shuffle_buffer=100, seed=1,
                   drop_last=drop_last) as loader:
        for _ in range(3):
            batches = list(loader)
            ids = ids_of(batches)
            sizes = [len(b["i"]) for b in batches]
            assert len(set(ids)) == len(ids)
            if drop_last:
                assert set(sizes) == {10} and len(ids) >= n - 2 * 9
            else:
                assert sorted(ids) == list(range(n)) and sizes.count(10) >= len(sizes) - 2


def test_distributed_ranks_shuffle_their_own_streams():
    n, got = 900, []
    for rank in range(2):
        with ShmLoader(Stream(n), batch_size=8, num_workers=2, shuffle_buffer=64, seed=5,
                       distributed=(rank, 2)) as loader:
            got.append(ids_of(loader))
    assert sorted(got[0] + got[1]) == list(range(n))
    assert {i % 4 for i in got[0]} == {0, 1} and {i % 4 for i in got[1]} == {2, 3}
    assert got[0] != sorted(got[0]) and got[1] != sorted(got[1])


def test_a_shuffled_stream_resumes_with_the_remaining_samples_once():
    def make():
        return ShmLoader(Stream(1500), batch_size=12, num_workers=2, shuffle_buffer=200, seed=8)

    with make() as loader:
        it = iter(loader)
        head = ids_of(next(it) for _ in range(40))
        state = loader.state_dict()
        del it
    assert sum(len(s["extra"]) for s in state["stream"]) > 0  # delivered out of order
    with make() as resumed:
        resumed.load_state_dict(state)
        rest = ids_of(resumed)
        second = ids_of(resumed)
    assert sorted(head + rest) == list(range(1500))
    assert sorted(second) == list(range(1500))


def test_shuffle_buffer_needs_a_stream_and_the_default_collate():
    with pytest.raises(ValueError, match="iterable dataset"):
        ShmLoader(list(range(10)), shuffle_buffer=4)
    with pytest.raises(ValueError, match="default collate"):
        ShmLoader(Stream(10), shuffle_buffer=4, collate_fn=list)
