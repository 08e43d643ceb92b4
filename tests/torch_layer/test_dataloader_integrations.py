"""Issue 14 items 5 and 7 and namedtuples with workers: loader.DataLoader
where torch's DataLoader has special paths (IterDataPipes) and where a
framework rebuilds loaders (HF accelerate's prepare).  The multi-process
runs of the frameworks are in test_frameworks.py."""

import collections
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from extras import import_or_skip_on_older_python

torch = pytest.importorskip("torch")
import torch.utils.data.datapipes as dp  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from loader import DataLoader, ShmLoader  # noqa: E402
from torch_conformance_datasets import NamedTupleDataset  # noqa: E402

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _pipe(n=100):
    return dp.iter.IterableWrapper(list(range(n))).shuffle(buffer_size=5).sharding_filter()


def _quiet_datapipe_iter(loader):
    # torch warns that IterDataPipes are deprecated; for either loader alike
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return [int(x) for x in loader]


# --- item 7: IterDataPipes -------------------------------------------------------------

@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_sharding_filter_gives_every_sample_once_per_epoch(workers):
    """repro_dl_datapipe_sharding.py: sharding_filter is applied in each
    worker over num_workers instances, as torch's _sharding_worker_init_fn
    does, so a 100-sample pipe yields 100 samples, each once."""
    got = _quiet_datapipe_iter(DataLoader(_pipe(), num_workers=workers, shuffle=True))
    assert sorted(got) == list(range(100))


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_datapipe_shuffle_is_reseeded_each_epoch_from_the_generator(workers, persistent):
    """repro_dl_datapipe_reseed.py: each epoch draws the pipe's shared seed
    from the loader's generator (torch's global one here), so the same
    torch.manual_seed gives the same order, another seed another one, and
    with one worker the order is torch's own."""
    dl = DataLoader(_pipe(), num_workers=workers, shuffle=True, persistent_workers=persistent)
    epochs = []
    for seed in (123, 123, 7):
        torch.manual_seed(seed)
        epochs.append(_quiet_datapipe_iter(dl))
    assert epochs[0] == epochs[1] and sorted(epochs[0]) == list(range(100))
    assert epochs[2] != epochs[0] and sorted(epochs[2]) == list(range(100))
    torch.manual_seed(123)
    one = _quiet_datapipe_iter(DataLoader(_pipe(), num_workers=1 if workers else 0, shuffle=True))
    torch.manual_seed(123)
    theirs = _quiet_datapipe_iter(torch.utils.data.DataLoader(
        _pipe(), num_workers=1 if workers else 0, shuffle=True))
    assert one == theirs


def test_datapipe_order_with_a_loader_generator_is_torchs():
    """The shared seed comes from the loader's generator when it has one."""
    def run(cls):
        return _quiet_datapipe_iter(cls(_pipe(), num_workers=0, shuffle=True,
                                        generator=torch.Generator().manual_seed(5)))
    assert run(DataLoader) == run(torch.utils.data.DataLoader)


# --- namedtuple classes pickle cannot find, with workers -----------------------------

@pytest.mark.parametrize("batch_size", [2, None])
def test_a_namedtuple_pickle_cannot_find_loads_with_two_workers(batch_size):
    """The worker→batcher messages name such a class by its identity (the
    processes are forked, so it is the same object there), not by pickle."""
    got = []
    for b in DataLoader(NamedTupleDataset(), batch_size=batch_size, num_workers=2):
        assert type(b) is NamedTupleDataset.Batch
        got.append((b.data.tolist(), torch.as_tensor(b.label).tolist()))
    if batch_size:
        assert got == [([[0, 0], [1, 1]], [0, 1]), ([[2, 2], [3, 3]], [2, 3]),
                       ([[4, 4], [5, 5]], [4, 5])]
    else:
        assert got == [([i, i], i) for i in range(6)]


def test_a_function_local_namedtuple_loads_with_shmloader_workers():
    Pair = collections.namedtuple("Pair", ["x", "y"])  # defined in a function

    class Local:
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return Pair(x=i, y="s%d" % i)  # a string leaf travels in a message too

    got = [(b.x.tolist(), list(b.y)) for b in ShmLoader(Local(), batch_size=4, num_workers=2)]
    assert got == [([0, 1, 2, 3], ["s0", "s1", "s2", "s3"]), ([4, 5, 6, 7], ["s4", "s5", "s6", "s7"])]


_AFTER_GC_FREEZE = textwrap.dedent("""
    import collections, gc, json
    from loader import ShmLoader

    def main():
        Pair = collections.namedtuple("Pair", ["x", "y"])  # found only through the dataset

        class InClassBody:
            Row = collections.namedtuple("Row", ["i", "name"])  # qualname 'Row'

            def __len__(self):
                return 8

            def __getitem__(self, i):
                return self.Row(i=Pair(x=i, y=-i), name="s%d" % i)

        gc.freeze()  # as a program that spares its heap copy-on-write before it forks
        out = []
        with ShmLoader(InClassBody(), batch_size=4, num_workers=2) as ld:
            for b in ld:
                assert type(b).__name__ == "Row" and type(b.i).__name__ == "Pair"
                out.append([b.i.x.tolist(), b.i.y.tolist(), list(b.name)])
        print(json.dumps(out))

    main()
""")


def test_classes_pickle_cannot_find_load_after_gc_freeze():
    """gc.freeze() before the loader starts (a habit of servers and
    trainers that fork: frozen objects are not touched by the collector,
    so forked children share their pages) hides the classes from
    gc.get_objects(); the loader's processes still find a namedtuple made
    in a class body or a function by its identity."""
    out = subprocess.run([sys.executable, "-c", _AFTER_GC_FREEZE], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [
        [[0, 1, 2, 3], [0, -1, -2, -3], ["s0", "s1", "s2", "s3"]],
        [[4, 5, 6, 7], [-4, -5, -6, -7], ["s4", "s5", "s6", "s7"]]]


class MadeInTheWorker:
    """A namedtuple class made after the workers forked: no other process
    has it, so the error must say so (typed, naming the class)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        late = collections.namedtuple("Late", ["v"])
        return late(v=i)


def test_a_class_made_in_a_worker_is_a_clear_error():
    with pytest.raises(Exception, match=r"Late.*made in a loader worker after it started"):
        list(ShmLoader(MadeInTheWorker(), batch_size=2, num_workers=2, timeout=60))


# --- item 5: HF accelerate -------------------------------------------------------------

# A LoaderReplacedWarning is an error in these programs.  By its text: a -W
# option naming the class is ignored at start-up, before numpy can be imported,
# and importing loader first would change the import order under test.
_REPLACED_IS_AN_ERROR = """
import warnings
warnings.filterwarnings("error", message=r"(?s).*rebuilt a loader\\.DataLoader as")
"""


def _run(code: str, timeout: float = 90) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", _REPLACED_IS_AN_ERROR + textwrap.dedent(code)],
                          env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


ACCELERATE_PREPARE = """
    import sys
    {first}
    import torch
    from torch.utils.data import TensorDataset
    {second}
    ds = TensorDataset(torch.arange(256), torch.arange(256) % 2)
    dl = DataLoader(ds, batch_size=32, shuffle=True, num_workers=2)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, prepared = Accelerator(cpu=True).prepare(model, opt, dl)
    inner = prepared.base_dataloader
    assert type(inner) is DataLoader, type(inner)
    assert isinstance(prepared, DataLoader)
    seen, workers = [], set()
    for x, y in prepared:
        seen += x.tolist()
        if len(seen) == 32:  # (the shard reads one batch ahead: at the last, they are gone)
            workers = {c.pid for c in inner._shm._session.worker_children()}
    assert len(workers) == 2, workers
    assert sorted(seen) == list(range(256)), seen
    print("OK", type(prepared).__name__)
"""


@pytest.mark.parametrize("accelerate_first", [True, False])
def test_accelerate_prepare_keeps_the_loader(accelerate_first):
    """repro_dl_accelerate_prepare.py: prepare() rebuilds the loader; it
    stays loader.DataLoader (batches from ShmLoader's two workers, each
    sample once), whether accelerate is imported before or after loader."""
    pytest.importorskip("accelerate")
    imports = ["from accelerate import Accelerator", "from loader import DataLoader"]
    if not accelerate_first:
        imports.reverse()
    r = _run(ACCELERATE_PREPARE.replace("{first}", imports[0]).replace("{second}", imports[1]))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK DataLoaderShard" in r.stdout


def test_accelerate_skip_first_batches_keeps_the_loader():
    """Resuming with accelerator.skip_first_batches rebuilds it again."""
    pytest.importorskip("accelerate")
    r = _run("""
        import torch
        from accelerate import Accelerator
        from torch.utils.data import TensorDataset
        from loader import DataLoader
        acc = Accelerator(cpu=True)
        dl = acc.prepare(DataLoader(TensorDataset(torch.arange(64)), batch_size=8, num_workers=2))
        skipped = acc.skip_first_batches(dl, 3)
        assert type(skipped.base_dataloader) is DataLoader, type(skipped.base_dataloader)
        got = [x.tolist() for (x,) in skipped]
        assert got == [list(range(i, i + 8)) for i in range(24, 64, 8)], got
        print("OK")
    """)
    assert r.returncode == 0, r.stdout + r.stderr


def test_accelerate_path_that_cannot_keep_it_warns():
    """A rebuild that still ends on another class (here: accelerate made to
    build torch's, as its stateful path builds torchdata's) is a
    LoaderReplacedWarning naming the class, never silent."""
    pytest.importorskip("accelerate")
    import accelerate.data_loader as adl

    from loader import LoaderReplacedWarning
    from loader.torch.integrations.accelerate import install

    install()
    dl = DataLoader(TensorDataset(torch.arange(16)), batch_size=4)
    real = adl.DataLoaderAdapter.__init__

    def torch_base(self, dataset, use_stateful_dataloader=False, batch_sampler=None, **kw):
        real(self, dataset, use_stateful_dataloader, batch_sampler, **kw)
        self.base_dataloader = torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler)

    adl.DataLoaderAdapter.__init__ = torch_base
    try:
        with pytest.warns(LoaderReplacedWarning,
                          match=r"rebuilt a loader.DataLoader as torch.utils.data.dataloader.DataLoader"):
            adl.prepare_data_loader(dl, num_processes=1, process_index=0)
    finally:
        adl.DataLoaderAdapter.__init__ = real
    # a plain torch DataLoader is not ours to keep: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = adl.prepare_data_loader(torch.utils.data.DataLoader(TensorDataset(torch.arange(4))),
                                      num_processes=1, process_index=0)
    assert type(out.base_dataloader) is torch.utils.data.DataLoader


# --- issue 29 item 1: accelerate's seedable sampler, Trainer's resume ------------------
# (Trainer itself, whole runs cut and resumed: test_hf_trainer.py)

def _seedable(cls, workers, persistent, epoch_order):
    """accelerate's prepare as Trainer does it (use_seedable_sampler=True):
    the sample order of each epoch set with set_epoch, the global generator
    reseeded before each (as a resume restores it)."""
    import accelerate.data_loader as adl

    torch.manual_seed(42)
    dl = cls(TensorDataset(torch.arange(40)), batch_size=4, shuffle=True, num_workers=workers,
             persistent_workers=persistent)
    prepared = adl.prepare_data_loader(dl, num_processes=1, process_index=0,
                                       use_seedable_sampler=True)
    out = []
    for k, epoch in enumerate(epoch_order):
        prepared.set_epoch(epoch)
        torch.manual_seed(1000 + k)
        out.append([i for (b,) in prepared for i in b.tolist()])
    base = prepared.base_dataloader
    if isinstance(base, DataLoader):
        base.close()
    return out, type(base)


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)],
                         ids=["nw0", "nw2", "nw2-persistent"])
def test_accelerate_seedable_sampler_orders_every_epoch_as_torch(workers, persistent):
    """repro_dl_accelerate_seedable_sampler.py: accelerate's DataLoaderAdapter
    calls state_dict(), then puts its SeedableRandomSampler into the
    BatchSampler; each epoch is drawn from it (set_epoch decides the order,
    the global generator does not), as with torch's DataLoader."""
    pytest.importorskip("accelerate")
    from loader.torch.integrations.accelerate import install

    install()
    theirs, _ = _seedable(torch.utils.data.DataLoader, workers, persistent, [0, 1, 0])
    ours, kind = _seedable(DataLoader, workers, persistent, [0, 1, 0])
    assert kind is DataLoader
    assert ours == theirs
    assert ours[0] == ours[2] != ours[1]
    assert all(sorted(e) == list(range(40)) for e in ours)


@pytest.mark.parametrize("epoch", [0, 1])
def test_accelerate_resume_by_skipping_batches_gives_the_rest_of_the_cut_epoch(epoch):
    """Trainer's resume: a new prepared loader, set_epoch(epoch),
    skip_first_batches(k): the rest of that epoch, exactly, on ShmLoader's
    workers."""
    pytest.importorskip("accelerate")
    import accelerate.data_loader as adl

    from loader.torch.integrations.accelerate import install

    install()
    whole, _ = _seedable(DataLoader, 2, False, [0, 1])
    torch.manual_seed(42)
    prepared = adl.prepare_data_loader(
        DataLoader(TensorDataset(torch.arange(40)), batch_size=4, shuffle=True, num_workers=2),
        num_processes=1, process_index=0, use_seedable_sampler=True)
    skipped = adl.skip_first_batches(prepared, 3)
    skipped.set_epoch(epoch)
    torch.manual_seed(7)  # another global state than the cut run had
    rest = [i for (b,) in skipped for i in b.tolist()]
    assert type(skipped.base_dataloader) is DataLoader
    skipped.base_dataloader.close()
    prepared.base_dataloader.close()
    assert rest == whole[epoch][12:]


_TRAINER_RESUME = """
import warnings
{first}
{second}
import torch
from accelerate import Accelerator
import transformers.trainer as hf_trainer
ds = torch.utils.data.TensorDataset(torch.arange(24))
prepared = Accelerator(cpu=True).prepare(DataLoader(ds, batch_size=4, shuffle=True, num_workers=2))
resumed = hf_trainer.skip_first_batches(prepared, 2)  # what Trainer calls on resume_from_checkpoint
assert type(resumed.base_dataloader) is DataLoader, type(resumed.base_dataloader)
assert len([i for (b,) in resumed for i in b.tolist()]) == 16
print("OK")
"""


@pytest.mark.parametrize("trainer_first", [True, False], ids=["trainer-first", "loader-first"])
def test_trainers_resume_keeps_the_loader_in_either_import_order(trainer_first):
    """repro_dl_trainer_import_order.py: transformers.trainer took its own
    reference to accelerate's skip_first_batches when it was imported; with
    `from transformers import Trainer` first, Trainer's resume rebuilt the
    loader as torch's class, silently.  Now the integration points that
    reference at its wrapper, in either order (LoaderReplacedWarning is an
    error here)."""
    import_or_skip_on_older_python("transformers")
    imports = ["from transformers import Trainer", "from loader import DataLoader"]
    if not trainer_first:
        imports.reverse()
    r = _run(_TRAINER_RESUME.replace("{first}", imports[0]).replace("{second}", imports[1]))
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout + r.stderr[-3000:]


def test_a_rebuild_by_a_reference_no_module_holds_warns():
    """A reference to accelerate's own skip_first_batches kept where no
    module name holds it (here a list, taken before loader was imported)
    still rebuilds as torch's class: the DataLoaderAdapter it makes says so."""
    pytest.importorskip("accelerate")
    r = _run("""
        import warnings
        import accelerate.data_loader as adl
        kept = [adl.skip_first_batches]
        import torch
        from accelerate import Accelerator
        from loader import DataLoader
        from loader.torch.integrations import LoaderReplacedWarning
        ds = torch.utils.data.TensorDataset(torch.arange(24))
        prepared = Accelerator(cpu=True).prepare(DataLoader(ds, batch_size=4, num_workers=2))
        warnings.simplefilter("default", LoaderReplacedWarning)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed = kept[0](prepared, 2)
        assert type(resumed.base_dataloader) is torch.utils.data.DataLoader
        assert [w.category for w in caught] == [LoaderReplacedWarning], caught
        print(str(caught[0].message))
        with warnings.catch_warnings(record=True) as caught:  # the wrapped one: no warning
            warnings.simplefilter("always")
            kept_now = adl.skip_first_batches(prepared, 2)
        assert type(kept_now.base_dataloader) is DataLoader and not caught, caught
    """)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "rebuilt a loader.DataLoader as torch.utils.data.dataloader.DataLoader" in r.stdout
    assert "where no module name holds it" in r.stdout


# --- the sampler's epoch in a state (found under Lightning DDP) ------------------------

def _distributed(rank=0):
    ds = TensorDataset(torch.arange(40))
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True,
                                                  seed=3)
    return DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, persistent_workers=True)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_state_resumes_the_set_epoch_it_was_drawn_with(rank):
    """Lightning iterates a resumed loader before it calls set_epoch, and
    gives every rank rank 0's state: the state records the sampler's epoch
    (NOTE [ The sampler's epoch in a state ]), so the resumed epoch is the
    cut one on every rank, not epoch 0's order."""
    dl = _distributed(rank=0)
    for epoch in range(2):
        dl.sampler.set_epoch(epoch)
        it = iter(dl)
        got = [next(it)[0].tolist() for _ in range(2)]
        if epoch == 0:
            got += [b[0].tolist() for b in it]
    state = dl.state_dict()
    assert state["sampler_epoch"] == 1
    dl.close()
    whole = _distributed(rank)
    whole.sampler.set_epoch(1)
    expected = [b[0].tolist() for b in whole]
    whole.close()
    resumed = _distributed(rank)  # its sampler is at epoch 0, as Lightning leaves it
    resumed.load_state_dict(state)
    rest = [b[0].tolist() for b in resumed]
    resumed.close()
    assert rest == expected[2:]
    assert resumed.sampler.epoch == 1


def test_a_bad_sampler_epoch_is_refused_before_anything_changes():
    dl = _distributed()
    dl.sampler.set_epoch(1)
    it = iter(dl)
    next(it)
    state = dl.state_dict()
    dl.close()
    with pytest.raises(ValueError, match="field 'sampler_epoch' is '1'"):
        _distributed().load_state_dict(dict(state, sampler_epoch="1"))
    plain = DataLoader(TensorDataset(torch.arange(40)), batch_size=4, shuffle=True, num_workers=2)
    with pytest.raises(ValueError, match="sampler has none"):
        plain.load_state_dict(state)
    plain.close()
