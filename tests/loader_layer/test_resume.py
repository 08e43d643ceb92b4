"""state_dict() / load_state_dict(): after k batches of an epoch, a new
loader given the state yields exactly the remaining batches of that epoch
(in order; in first-ready mode the remaining samples exactly once), then
the following epochs as an uninterrupted run would (issue 8).  See NOTE
[ Resuming an epoch ] in loader/order/progress.py."""

import pickle
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the samples draw from torch's generator too

from loader import DataLoader, ShmLoader, get_worker_info  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class Augmented:
    """Sample i: its index and draws from numpy, random and torch."""

    def __init__(self, n=203):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"i": i, "np": np.random.rand(2), "py": random.random(), "t": torch.rand(1)}


def rows(batch) -> list:
    """A batch as plain values, to compare runs exactly."""
    if isinstance(batch, dict):
        return [(int(i), tuple(np.asarray(batch["np"][k]).tolist()), float(batch["py"][k]),
                 float(batch["t"][k][0])) for k, i in enumerate(batch["i"])]
    return np.asarray(batch).tolist()


def epochs(loader, n):
    return [[rows(b) for b in loader] for _ in range(n)]


def interrupted(make, at_epoch, k, then):
    """Run `make()` to batch k of epoch at_epoch (1-based), take its state,
    drop it; a new loader from the state yields the rest and `then` more
    epochs.  Returns (the batches before the cut, the resumed batches)."""
    loader = make()
    before = epochs(loader, at_epoch - 1)
    it = iter(loader)
    head = [rows(next(it)) for _ in range(k)]
    state = loader.state_dict()
    assert len(pickle.dumps(state)) < 16 << 10  # small: positions, not samples
    del it
    loader.close()
    resumed = make()
    resumed.load_state_dict(pickle.loads(pickle.dumps(state)))
    rest = [[rows(b) for b in resumed]] + epochs(resumed, then)
    resumed.close()
    return before, head, rest


@pytest.mark.parametrize("workers_before,workers_after", [(2, 2), (2, 3), (3, 0)])
def test_in_order_resume_gives_exactly_the_uninterrupted_run(workers_before, workers_after):
    def make(workers=[workers_before]):
        w = workers.pop(0) if workers else workers_after
        return ShmLoader(Augmented(), batch_size=8, shuffle=True, seed=7, num_workers=w,
                         output="torch")

    full = epochs(ShmLoader(Augmented(), batch_size=8, shuffle=True, seed=7, num_workers=2,
                            output="torch"), 4)
    before, head, rest = interrupted(make, at_epoch=2, k=11, then=2)
    assert before == full[:1]
    assert head + rest[0] == full[1]     # the rest of epoch 2, batch for batch
    assert rest[1:] == full[2:4]         # then epochs 3 and 4


def test_first_ready_resume_delivers_the_remaining_samples_once():
    def make():
        return ShmLoader(Augmented(500), batch_size=16, shuffle=True, seed=3, num_workers=3,
                         in_order=False, output="torch")

    full = epochs(make(), 3)
    before, head, rest = interrupted(make, at_epoch=1, k=9, then=2)
    seen = sorted(r for b in head + rest[0] for r in b)
    assert seen == sorted(r for b in full[0] for r in b)  # every sample once, same draws
    for resumed, uninterrupted in zip(rest[1:], full[1:]):
        assert sorted(r for b in resumed for r in b) == sorted(r for b in uninterrupted for r in b)


def test_a_batch_sampler_epoch_resumes_at_its_next_batch():
    batches = [[3, 1], [4, 1, 5, 9], [2], [6, 5, 3, 5], [8, 9, 7], [9, 3, 2, 3, 8]]

    def make():
        return ShmLoader(np.arange(10) * 10, batch_sampler=batches, num_workers=2)

    before, head, rest = interrupted(make, at_epoch=1, k=2, then=1)
    assert head + rest[0] == [[10 * i for i in b] for b in batches]
    assert rest[1] == head + rest[0]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_resume_continues_torchs_shuffle(num_workers):
    """The torch generator's state at the epoch's start is in the state:
    the resumed epoch and the following ones have torch's order."""
    def make():
        return DataLoader(torch.arange(100), batch_size=6, shuffle=True, num_workers=num_workers,
                          generator=torch.Generator().manual_seed(12))

    import torch.utils.data as tud
    theirs = tud.DataLoader(torch.arange(100), batch_size=6, shuffle=True,
                            generator=torch.Generator().manual_seed(12))
    full = [[b.tolist() for b in theirs] for _ in range(3)]
    before, head, rest = interrupted(make, at_epoch=2, k=5, then=1)
    assert before == full[:1] and head + rest[0] == full[1] and rest[1] == full[2]


@pytest.mark.parametrize("at_epoch", [1, 2])
@pytest.mark.parametrize("persistent", [True, False])
def test_dataloader_resume_in_any_epoch_continues_torchs_shuffle(persistent, at_epoch):
    """Issue 14 item 1 (repro_dl_state_first_epoch.py): a state taken in the
    first epoch with persistent workers resumed another permutation (the
    base seed, drawn in that epoch only, was recorded but the generator
    state was from before its draw).  Every epoch, persistent or not,
    resumes torch's order: each sample exactly once."""
    def make(cls=DataLoader):
        return cls(torch.arange(200), batch_size=10, shuffle=True, num_workers=2,
                   persistent_workers=persistent, generator=torch.Generator().manual_seed(0))

    import torch.utils.data as tud
    theirs = make(tud.DataLoader)
    full = [[b.tolist() for b in theirs] for _ in range(3)]
    del theirs
    before, head, rest = interrupted(make, at_epoch=at_epoch, k=3, then=1)
    assert before == full[:at_epoch - 1]
    assert head + rest[0] == full[at_epoch - 1] and rest[1] == full[at_epoch]
    assert sorted(x for b in head + rest[0] for x in b) == list(range(200))


@pytest.mark.parametrize("at_epoch", [1, 2])
def test_shmloader_resume_with_a_generator_and_persistent_workers(at_epoch):
    """ShmLoader(generator=...) draws its workers' base seed from the
    generator once (persistent workers): a state of any epoch resumes the
    uninterrupted run's order and seeds."""
    def make():
        return ShmLoader(Augmented(60), batch_size=7, shuffle=True, num_workers=2,
                         generator=torch.Generator().manual_seed(4), seed=3)

    full = epochs(make(), 3)
    before, head, rest = interrupted(make, at_epoch=at_epoch, k=2, then=1)
    assert before == full[:at_epoch - 1]
    assert head + rest[0] == full[at_epoch - 1] and rest[1] == full[at_epoch]


def test_dataloader_resume_with_torchs_global_generator_leaves_it_alone():
    def make():
        return DataLoader(torch.arange(40), batch_size=4, shuffle=True, num_workers=2)

    torch.manual_seed(0)
    loader = make()
    it = iter(loader)
    head = [next(it).tolist() for _ in range(3)]
    state = loader.state_dict()
    rest_uninterrupted = [b.tolist() for b in it]
    loader.close()
    torch.manual_seed(99)
    marker = torch.rand(1)
    torch.manual_seed(99)
    resumed = make()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == rest_uninterrupted
    assert torch.equal(torch.rand(1), marker)  # the global generator was not touched
    assert sorted(x for b in head + rest_uninterrupted for x in b) == list(range(40))
    resumed.close()


class Stream:
    """Worker w yields (w, k) for k < 13 + w, with a draw."""

    def __iter__(self):
        info = get_worker_info()
        w = 0 if info is None else info.id
        for k in range(13 + w):
            yield np.array([w, k, int(np.random.randint(1000))])


@pytest.mark.parametrize("num_workers", [0, 3])
def test_an_iterable_dataset_resumes_each_stream_where_it_was(num_workers):
    def make():
        return ShmLoader(Stream(), batch_size=4, num_workers=num_workers, seed=5)

    full = epochs(make(), 3)
    before, head, rest = interrupted(make, at_epoch=2, k=4, then=1)
    assert before == full[:1] and head + rest[0] == full[1] and rest[1] == full[2]


def test_an_iterable_state_needs_the_same_number_of_workers():
    loader = ShmLoader(Stream(), batch_size=4, num_workers=3, seed=5)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.close()
    other = ShmLoader(Stream(), batch_size=4, num_workers=2, seed=5)
    with pytest.raises(ValueError, match="same number of workers"):
        other.load_state_dict(state)
    other.close()


def test_states_between_epochs_and_before_any():
    loader = ShmLoader(np.arange(12), batch_size=5, num_workers=2, shuffle=True, seed=1)
    fresh = loader.state_dict()
    assert fresh["complete"] and fresh["epoch"] == 0
    first = [b.tolist() for b in loader]
    after_one = loader.state_dict()
    assert after_one["complete"] and after_one["epoch"] == 1
    second = [b.tolist() for b in loader]
    loader.close()
    again = ShmLoader(np.arange(12), batch_size=5, num_workers=2, shuffle=True, seed=1)
    again.load_state_dict(fresh)
    assert [b.tolist() for b in again] == first
    again.load_state_dict(after_one)
    assert [b.tolist() for b in again] == second
    again.close()


def test_bad_states_are_refused_with_the_reason():
    loader = ShmLoader(np.arange(30), batch_size=4, num_workers=2, seed=1)
    with pytest.raises(ValueError, match="not a ShmLoader state"):
        loader.load_state_dict({"epoch": 3})
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.close()
    smaller = ShmLoader(np.arange(20), batch_size=4, num_workers=2, seed=1)
    with pytest.raises(ValueError, match="field 'dataset_len' is 30, but this loader's is 20"):
        smaller.load_state_dict(state)
    smaller.close()
    stream = ShmLoader(Stream(), batch_size=4, num_workers=2)
    with pytest.raises(ValueError, match="field 'iterable' is False, but this loader has an "
                                         "iterable dataset"):
        stream.load_state_dict(state)
    stream.close()


def _state_of(make, k=2):
    loader = make()
    it = iter(loader)
    for _ in range(k):
        next(it)
    state = loader.state_dict()
    del it
    loader.close()
    return state


def _edit(state, path, value):
    """A copy of state with the field at path (keys, then maybe an index)
    set to value, or removed (value is _DROP)."""
    out = pickle.loads(pickle.dumps(state))
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is _DROP:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


_DROP = object()

# (what is wrong, the edit, the field the error names, words that show both values)
BAD_MAP_STATES = [
    ("truncated", ("epoch",), _DROP, "'epoch'", "no field"),
    ("not a dict", ("map",), [3, 4], "'map'", "[3, 4]"),
    ("negative range", ("map", "done_ranges"), [[-1, 2]], "'map.done_ranges'", "-1"),
    ("range past the epoch", ("map", "done_ranges"), [[20, 10 ** 6]], "'map.done_ranges'",
     "1000000"),
    ("ranges out of order", ("map", "done_ranges"), [[25, 27], [20, 22]], "'map.done_ranges'",
     "[20, 22]"),
    ("ranges touching", ("map", "done_ranges"), [[20, 22], [22, 24]], "'map.done_ranges'",
     "[22, 24]"),
    ("empty range", ("map", "done_ranges"), [[20, 20]], "'map.done_ranges'", "[20, 20]"),
    ("a range not a pair", ("map", "done_ranges"), [[20, 21, 22]], "'map.done_ranges'",
     "[20, 21, 22]"),
    ("ranges a dict", ("map", "done_ranges"), {"20": 21}, "'map.done_ranges'", "'20'"),
    ("prefix past the epoch", ("map", "done_prefix"), 31, "'map.done_prefix'", "31"),
    ("prefix a float", ("map", "done_prefix"), 2.0, "'map.done_prefix'", "2.0"),
    ("huge prefix", ("map", "done_prefix"), 1 << 70, "'map.done_prefix'", str(1 << 70)),
    ("positions of another size", ("map", "positions"), 29, "'map.positions'", "has 30"),
    ("another batch size", ("batch_size",), 5, "'batch_size'", "is 4"),
    ("another dataset", ("dataset_len",), 31, "'dataset_len'", "is 30"),
    ("another sampler", ("sampler",), "RandomSampler", "'sampler'", "None"),
    ("another seed", ("seed",), 2, "'seed'", "seed is 1"),
    ("a rank outside the world", ("rank",), 3, "'rank'", "<= 0"),
    ("an epoch string", ("epoch",), "1", "'epoch'", "'1'"),
    ("a generator this loader lacks", ("rng",), {"generator": b"x" * 5056}, "rng.generator",
     "no such generator"),
    ("a base seed of 80 bits", ("base_seed",), 1 << 80, "'base_seed'", str(1 << 80)),
    ("complete not a bool", ("complete",), "no", "'complete'", "'no'"),
    ("another format", ("format",), "shmloader-state-0", "'format'", "shmloader-state-2"),
]


@pytest.mark.parametrize("what,path,value,field,words", BAD_MAP_STATES,
                         ids=[c[0] for c in BAD_MAP_STATES])
def test_every_field_of_a_state_is_checked_and_the_loader_stays_usable(what, path, value, field,
                                                                        words):
    """Issue 15 item 6: a state from elsewhere (garbage, truncated, another
    dataset, batch size, seed or sampler) is one ValueError naming the
    field and the values, before anything changes: the loader then yields
    its own epochs exactly, or resumes a good state."""
    def make():
        return ShmLoader(np.arange(30), batch_size=4, num_workers=2, shuffle=True, seed=1)

    good = _state_of(make)
    full = [b.tolist() for b in make_and_close(make)]
    loader = make()
    with pytest.raises(ValueError) as raised:
        loader.load_state_dict(_edit(good, path, value))
    text = str(raised.value)
    assert field in text and words in text, text
    assert [b.tolist() for b in loader] == full  # untouched: its own first epoch
    loader.load_state_dict(good)
    rest = [x for b in loader for x in b.tolist()]
    assert len(rest) == 30 - 8 and sorted(rest + [x for b in full[:2] for x in b]) == list(range(30))
    loader.close()


def make_and_close(make):
    loader = make()
    out = list(loader)
    out = [b.copy() for b in out]
    loader.close()
    return out


def test_a_stream_state_is_checked_field_by_field():
    def make(workers=2):
        return ShmLoader(Stream(), batch_size=4, num_workers=workers, seed=5)

    good = _state_of(make)
    loader = make()
    for path, value, field in [(("stream",), good["stream"][:1], "'stream'"),
                               (("stream", 0, "prefix"), -3, "'stream[0].prefix'"),
                               (("stream", 1, "extra"), [0], "'stream[1].extra'"),
                               (("workers",), 3, "'workers'")]:
        with pytest.raises(ValueError, match=field.replace("[", r"\[")):
            loader.load_state_dict(_edit(good, path, value))
    loader.load_state_dict(good)
    assert sum(len(b) for b in loader) == 13 + 14 - 8
    loader.close()


def test_dataloader_states_are_checked_against_its_sampler_and_generator():
    def make(**kw):
        kw = {"batch_size": 6, "shuffle": True, "num_workers": 2,
              "generator": torch.Generator().manual_seed(3), **kw}
        return DataLoader(torch.arange(60), **kw)

    good = _state_of(make)
    assert good["sampler"] == "RandomSampler" and good["batch_size"] == 6
    for kw, field, words in [({"batch_size": 5}, "'batch_size'", "is 6"),
                             ({"shuffle": False}, "'sampler'", "'RandomSampler'"),
                             ({"generator": None}, "rng.generator", "no such generator")]:
        other = make(**kw)
        with pytest.raises(ValueError) as raised:
            other.load_state_dict(good)
        assert field in str(raised.value) and words in str(raised.value), str(raised.value)
        assert sum(len(b) for b in other) == 60  # still usable
        other.close()


_WITHOUT_TORCH = """
import json, sys
sys.modules["torch"] = None   # `import torch` raises ImportError: as if it were not installed
import numpy as np
from loader import ShmLoader

class Rows:
    def __len__(self): return 1000
    def __getitem__(self, i): return np.full(2, i)

kw = dict(batch_size=10, shuffle=True, seed=5, num_workers=2)
with ShmLoader(Rows(), **kw) as ld:
    it = iter(ld)
    head = [next(it)[:, 0].tolist() for _ in range(30)]
    state = ld.state_dict()
    rest = [b[:, 0].tolist() for b in it]
with ShmLoader(Rows(), **kw) as ld:
    ld.load_state_dict(state)
    resumed = [b[:, 0].tolist() for b in ld]
print(json.dumps({"same": resumed == rest, "rest": len(rest),
                  "whole": sorted(sum(head + rest, [])) == list(range(1000))}))
"""


def test_a_state_resumes_where_torch_is_not_installed():
    """ShmLoader needs numpy only: a state (no torch generator recorded in
    it) resumes without importing torch (it imported torch to restore
    generator states even when there were none)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"same": True, "rest": 70,
                                                                "whole": True}


# --- the keys of a state: every mode's state_dict() round-trips; nothing else loads -----
# (issue 28, item 15: a key the loader does not know, as map.done_extra in a format-2
# state, was accepted and ignored)

def _batch_sampler_loader():
    return ShmLoader(np.arange(10) * 10, num_workers=2,
                     batch_sampler=[[3, 1], [4, 1, 5, 9], [2], [6, 5, 3, 5], [8, 9, 7]])


def _shuffled(**kw):
    return ShmLoader(np.arange(100), batch_size=8, shuffle=True, seed=2, **kw)


def _distributed_dataloader():
    """A DistributedSampler at its epoch 1: the state records sampler_epoch."""
    sampler = torch.utils.data.DistributedSampler(range(100), num_replicas=1, rank=0, seed=3)
    sampler.set_epoch(1)
    return DataLoader(torch.arange(100), batch_size=6, sampler=sampler, num_workers=2)


# mode -> (the loader, batches into an epoch when the state is taken: None at its end,
# 0 before any epoch, "frozen k" taken by freeze_state() after k with one pulled ahead)
STATE_MODES = {
    "map processes": (lambda: _shuffled(num_workers=2), 3),
    "map first-ready": (lambda: _shuffled(num_workers=2, in_order=False), 3),
    "map threads": (lambda: _shuffled(num_workers=2, worker_mode="thread"), 3),
    "map inline": (lambda: _shuffled(num_workers=0), 3),
    "map a generator": (lambda: ShmLoader(np.arange(100), batch_size=8, shuffle=True,
                                          num_workers=2,
                                          generator=torch.Generator().manual_seed(1)), 3),
    "map a batch sampler": (_batch_sampler_loader, 2),
    "map before any epoch": (lambda: _shuffled(num_workers=2), 0),
    "map at an epoch's end": (lambda: _shuffled(num_workers=2), None),
    "map frozen": (lambda: _shuffled(num_workers=2), "frozen 3"),
    "stream processes": (lambda: ShmLoader(Stream(), batch_size=4, num_workers=2, seed=5), 3),
    "stream inline": (lambda: ShmLoader(Stream(), batch_size=4, num_workers=0, seed=5), 3),
    "stream frozen": (lambda: ShmLoader(Stream(), batch_size=4, num_workers=2, seed=5),
                      "frozen 2"),
    "DataLoader": (lambda: DataLoader(torch.arange(100), batch_size=6, shuffle=True,
                                      num_workers=2,
                                      generator=torch.Generator().manual_seed(3)), 3),
    "DataLoader inline": (lambda: DataLoader(torch.arange(100), batch_size=6, shuffle=True,
                                             num_workers=0,
                                             generator=torch.Generator().manual_seed(3)), 3),
    "DataLoader set_epoch": (_distributed_dataloader, 3),
}


def _state_and_rest(mode):
    """(the mode's state, what the loader then yields: the rest of the
    epoch, or the next epoch once it ended)."""
    make, at = STATE_MODES[mode]
    loader = make()
    try:
        if at is None:
            list(loader)
            return loader.state_dict(), [rows(b) for b in loader]
        if at == 0:
            return loader.state_dict(), [rows(b) for b in loader]
        frozen = isinstance(at, str)
        k = int(at.split()[1]) if frozen else at
        it = iter(loader)
        head = [rows(next(it)) for _ in range(k)]
        if frozen:  # a wrapper pulls a batch ahead of its loop (NOTE [ A state through ...
            unfrozen = loader.state_dict()
            loader.freeze_state()
            ahead = [rows(next(it))]
            state = loader.state_dict()
            assert state == unfrozen  # as of the loop's last batch, not the one pulled ahead
            rest = ahead + [rows(b) for b in it]
            loader.thaw_state()
            assert loader.state_dict() != state  # counts the batch pulled ahead again
        else:
            state = loader.state_dict()
            rest = [rows(b) for b in it]
        assert head
        return state, rest
    finally:
        loader.close()


def _same(mode, got, expected) -> bool:
    """got == expected (first-ready: the same samples, each once)."""
    if "first-ready" in mode:
        return sorted(x for b in got for x in b) == sorted(x for b in expected for x in b)
    return got == expected


def _keys_tree(state) -> dict:
    """The keys of a state at every level."""
    tree = {"": set(state), "rng": set(state["rng"])}
    if state["map"] is not None:
        tree["map"] = set(state["map"])
    for w, s in enumerate(state["stream"] or ()):
        tree[f"stream[{w}]"] = set(s)
    return tree


@pytest.mark.parametrize("mode", list(STATE_MODES))
def test_every_modes_state_has_its_formats_keys_and_round_trips(mode):
    """state_dict() in every mode (map-style with processes, threads,
    first-ready, inline, a generator, a batch sampler; before any epoch and
    at an epoch's end; stream with processes and inline; loader.DataLoader,
    with a set_epoch sampler too; taken by freeze_state() while a batch is
    pulled ahead): exactly the keys STATE_KEYS defines for its format at
    every level (plus loader.DataLoader's sampler_epoch), and a new loader
    given it, pickled, yields exactly what the original went on to yield."""
    from loader.main.state import STATE_FORMAT, STATE_KEYS

    state, rest = _state_and_rest(mode)
    keys = STATE_KEYS[STATE_FORMAT]
    tree = _keys_tree(state)
    extra = {"sampler_epoch"} if mode == "DataLoader set_epoch" else set()
    assert tree.pop("") == keys.required | extra
    assert tree.pop("rng") <= {"generator", "global", "sampler"}
    assert all(level == (keys.map if name == "map" else keys.stream)
               for name, level in tree.items()), tree
    assert ("map" in tree) == (state["map"] is not None) and state["format"] == STATE_FORMAT
    loader = STATE_MODES[mode][0]()
    try:
        loader.load_state_dict(pickle.loads(pickle.dumps(state)))
        assert _same(mode, [rows(b) for b in loader], rest)
    finally:
        loader.close()


def _edits_of(state):
    """(the edit's path, a copy of state with a key added or removed there,
    the words the StateError must hold), at every level the state has."""
    out = []

    def edited(where, change):
        copy = pickle.loads(pickle.dumps(state))
        node = copy
        for key in where:
            node = node[key]
        change(node)
        return copy

    levels = [((), ""), (("rng",), "rng")]
    if state["map"] is not None:
        levels.append((("map",), "map"))
    for w in range(len(state["stream"] or ())):
        levels.append((("stream", w), f"stream[{w}]"))
    for where, name in levels:
        prefix = f"{name}." if name else ""
        for key in ("done_extra", "oops"):
            out.append((f"{prefix}{key}", edited(where, lambda d, k=key: d.update({k: [1]})),
                        f"field '{prefix}{key}', which a state of format"))
        out.append((f"{name}[7]", edited(where, lambda d: d.update({7: 1})),
                    f"field '{name}[7]', which" if name else "field '[7]', which"))
    removable = [((), "batch_size"), ((), "epoch"), ((), "rng"), ((), "map"), ((), "stream")]
    if state["map"] is not None:
        removable += [(("map",), k) for k in ("positions", "done_prefix", "done_ranges")]
    last = len(state["stream"] or ()) - 1
    if last >= 0:
        removable += [(("stream", last), k) for k in ("batches", "prefix", "extra")]
    for where, key in removable:
        name = where[0] if len(where) == 1 else f"stream[{last}]" if where else ""
        full = f"{name}.{key}" if name else key
        out.append((f"no {full}", edited(where, lambda d, k=key: d.pop(k)),
                    f"the state has no field '{full}'"))
    return out


@pytest.mark.parametrize("mode", ["map processes", "map inline", "map before any epoch",
                                  "map at an epoch's end", "stream processes", "stream inline",
                                  "DataLoader", "DataLoader set_epoch"])
def test_a_key_the_format_does_not_define_or_lacks_is_refused_at_every_level(mode):
    """A key added at every level of the state (the top, rng, map, each
    stream; done_extra, a name, a non-str key) or a required one removed:
    a StateError (a ValueError) naming the key by its full path; the
    loader is unchanged and then resumes the state itself exactly."""
    from loader import StateError

    state, rest = _state_and_rest(mode)
    loader = STATE_MODES[mode][0]()
    try:
        edits = _edits_of(state)
        assert len(edits) >= 11
        for what, bad, words in edits:
            with pytest.raises(StateError) as raised:
                loader.load_state_dict(bad)
            assert isinstance(raised.value, ValueError)
            assert words in str(raised.value), (what, str(raised.value))
        loader.load_state_dict(state)
        assert _same(mode, [rows(b) for b in loader], rest)
    finally:
        loader.close()


def test_a_format_1_state_may_lack_what_it_wrote_later_but_nothing_else():
    """batch_size, dataset_len and sampler came late in format 1: a format-1
    state without them loads; its map is done_extra's, and done_ranges in
    it is refused as format 2's."""
    from loader import StateError

    def old(state, **over):
        m = {k: v for k, v in state["map"].items() if k != "done_ranges"}
        m["done_extra"] = [p for a, b in state["map"]["done_ranges"] for p in range(a, b)]
        out = {k: v for k, v in state.items()
               if k not in ("batch_size", "dataset_len", "sampler")}
        return dict(out, format="shmloader-state-1", map=dict(m, **over))

    def make():  # (an epoch of the old seeded shuffle in progress is refused: test_scale.py)
        return ShmLoader(np.arange(100), batch_size=8, num_workers=2, in_order=False)

    loader = make()
    it = iter(loader)
    head = [rows(next(it)) for _ in range(3)]
    state = loader.state_dict()
    del it
    loader.close()
    loader = make()
    with pytest.raises(StateError, match="field 'map.done_ranges', which a state of format "
                                         "'shmloader-state-1' does not define"):
        loader.load_state_dict(old(state, done_ranges=[]))
    loader.load_state_dict(old(state))
    assert _same("first-ready", head + [rows(b) for b in loader], [list(range(100))])
    loader.close()


def test_a_dataloader_state_into_a_shmloader_names_sampler_epoch():
    """loader.DataLoader's state of a set_epoch sampler holds sampler_epoch,
    which a ShmLoader would ignore: refused, saying whose it is."""
    from loader import StateError

    state, _ = _state_and_rest("DataLoader set_epoch")
    assert state["sampler_epoch"] == 1
    with ShmLoader(torch.arange(100), batch_size=6, num_workers=2) as loader:
        with pytest.raises(StateError) as raised:
            loader.load_state_dict(state)
        text = str(raised.value)
        assert "field 'sampler_epoch'" in text and "load this state into a loader.DataLoader" \
            in text, text
        assert sum(len(b) for b in loader) == 100


# States as ShmLoader's state_dict() wrote them before LoaderState
# (main/state.py) took them over (main at 9f3ccd2), pasted as they were
# saved: checkpoints hold these, and must load, and be written again byte
# for byte.  Each: (how its loader was made and run, the state).
class Hundred:
    def __len__(self):
        return 100

    def __getitem__(self, i):
        return np.int64(i)


class Forty:
    """A stream of 0..39, split between the workers."""

    def __iter__(self):
        info = get_worker_info()
        w, n = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(w, 40, n))


SAVED_BEFORE = {
    "map_mid": (3, {
        'format': 'shmloader-state-2', 'epoch': 1, 'seed': 5, 'rank': 0, 'world': 1,
        'workers': 2, 'iterable': False, 'rng': {}, 'base_seed': 3925597770706564026,
        'map': {'positions': 100, 'done_prefix': 24, 'done_ranges': []}, 'stream': None,
        'batch_size': 8, 'dataset_len': 100, 'sampler': None, 'complete': False}),
    "map_fresh": (None, {
        'format': 'shmloader-state-2', 'epoch': 0, 'seed': 5, 'rank': 0, 'world': 1,
        'workers': 2, 'iterable': False, 'rng': {}, 'base_seed': None, 'map': None,
        'stream': None, 'batch_size': 8, 'dataset_len': 100, 'sampler': None,
        'complete': True}),
    "map_complete": (13, {
        'format': 'shmloader-state-2', 'epoch': 1, 'seed': 5, 'rank': 0, 'world': 1,
        'workers': 2, 'iterable': False, 'rng': {}, 'base_seed': 3925597770706564026,
        'map': {'positions': 100, 'done_prefix': 100, 'done_ranges': []}, 'stream': None,
        'batch_size': 8, 'dataset_len': 100, 'sampler': None, 'complete': True}),
    "stream_mid": (3, {
        'format': 'shmloader-state-2', 'epoch': 1, 'seed': 5, 'rank': 0, 'world': 1,
        'workers': 2, 'iterable': True, 'rng': {}, 'base_seed': 3925597770706564026,
        'map': None, 'stream': [{'batches': 2, 'prefix': 8, 'extra': []},
                                {'batches': 1, 'prefix': 4, 'extra': []}],
        'batch_size': 4, 'dataset_len': None, 'sampler': None, 'complete': False}),
}


def _saved_loader(name):
    if name.startswith("stream"):
        return ShmLoader(Forty(), batch_size=4, num_workers=2, seed=5)
    return ShmLoader(Hundred(), batch_size=8, num_workers=2, seed=5, shuffle=True)


@pytest.mark.parametrize("name", list(SAVED_BEFORE))
def test_a_state_is_written_byte_for_byte_as_the_previous_version_wrote_it(name):
    """The loader run to where each saved state was taken: its state_dict()
    pickles to the same bytes as the saved one (the same keys, values and
    order)."""
    batches, saved = SAVED_BEFORE[name]
    with _saved_loader(name) as loader:
        if batches is not None:
            it = iter(loader)
            got = [next(it) for _ in range(batches)]
            assert len(got) == batches
        assert pickle.dumps(loader.state_dict()) == pickle.dumps(saved)


@pytest.mark.parametrize("name", list(SAVED_BEFORE))
def test_a_state_the_previous_version_saved_resumes_exactly(name):
    """Each saved state, loaded into a new loader, yields exactly what the
    uninterrupted loader went on to yield: the rest of its epoch, then the
    next epoch (the next epoch, for a state taken before the first or at an
    epoch's end); the dict loaded is left as it was."""
    batches, saved = SAVED_BEFORE[name]
    with _saved_loader(name) as loader:
        first = [rows(b) for b in loader]
        second = [rows(b) for b in loader]
    if name == "map_fresh":
        expected = first
    elif name == "map_complete":
        expected = second
    else:
        expected = first[batches:] + second
    given = pickle.loads(pickle.dumps(saved))
    with _saved_loader(name) as resumed:
        resumed.load_state_dict(given)
        got = [rows(b) for b in resumed]
        if saved["complete"] is False:  # and the epoch after it
            got += [rows(b) for b in resumed]
    assert given == saved
    if name.startswith("stream"):  # one epoch's stream: the rest of it, then all of it again
        assert sorted(got) == sorted(expected) and len(got) == len(expected)
    else:
        assert got == expected


def test_loader_state_from_dict_checks_and_to_dict_gives_the_dict_back():
    """LoaderState.from_dict() refuses what check_state refuses (a StateError
    naming the field) and to_dict() of what it takes is the dict, key for key
    and in order; a format 1 state keeps lacking the keys it lacked."""
    from loader.errors import StateError
    from loader.main.state import Expected, LoaderState

    saved = SAVED_BEFORE["map_mid"][1]
    expected = Expected(iterable=False, num_workers=2, streams=2, rank=0, world=1, seed=5,
                        batch_size=8, positions=100, dataset_len=100, sampler=None,
                        rng_bytes={}, seeded_shuffle=True)
    state = LoaderState.from_dict(saved, expected)
    assert (state.epoch, state.map["done_prefix"], state.complete) == (1, 24, False)
    assert list(state.to_dict().items()) == list(saved.items())
    with pytest.raises(StateError, match="field 'map.done_prefix' is 100"):
        LoaderState.from_dict(dict(saved, map=dict(saved["map"], done_prefix=100)), expected)
    old = {k: v for k, v in SAVED_BEFORE["map_complete"][1].items()
           if k not in ("batch_size", "dataset_len", "sampler")}
    old = dict(old, format="shmloader-state-1", map={"positions": 100, "done_prefix": 100,
                                                     "done_extra": []})
    assert list(LoaderState.from_dict(old, expected).to_dict().items()) == list(old.items())
