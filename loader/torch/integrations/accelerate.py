"""HF accelerate keeps loader.DataLoader.

`Accelerator.prepare()` (accelerate.data_loader.prepare_data_loader) and
`Accelerator.skip_first_batches()` rebuild every DataLoader they are given:
a DataLoaderShard (or DataLoaderDispatcher) wrapping a new loader made from
the old one's arguments, with a per-process BatchSamplerShard.  accelerate
makes that new loader with the name `DataLoader` of its own module, i.e.
torch's class, so a loader.DataLoader would silently load on torch's
workers.  accelerate offers no hook for the class, so this module wraps
those two functions: while they rebuild a loader.DataLoader, the name
`accelerate.data_loader.DataLoader` is this project's class, so the new
loader has exactly the arguments accelerate chose (its sharded batch
sampler, its synchronized generator) and loads on ShmLoader's workers.

Installed without being asked: `from loader import DataLoader` installs it
when accelerate is imported (before or after), and points the names of
modules that imported the two functions before (transformers.trainer's
`skip_first_batches`, which Trainer's resume calls) at the wrapped ones
(NOTE [ Installing the integrations ]).  `install()` is idempotent.
A path that still ends on another loader class is reported with a
LoaderReplacedWarning naming the class, never silently: through the
wrappers (accelerate's use_stateful_dataloader=True builds torchdata's
StatefulDataLoader; an accelerate version that changes how it rebuilds),
and without them (a reference to the unwrapped function kept where no
module name holds it): every DataLoaderAdapter accelerate makes checks
whether its torch DataLoader was made from a loader.DataLoader's sampler
or batch sampler (an iterable dataset's loader has none to recognise).
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref

from loader.errors import LoaderReplacedWarning
from loader.torch.integrations import install_when_imported as _install_when_imported
from loader.torch.integrations import rebind

__all__ = ["install"]


_lock = threading.RLock()  # the module-global swap below is process-wide
_FUNCTIONS = ("prepare_data_loader", "skip_first_batches")

# the samplers and batch samplers of every loader.DataLoader made, by
# identity: what a loader rebuilt without the wrappers is recognised by
_samplers_of_ours: "weakref.WeakSet" = weakref.WeakSet()
_wrapping = threading.local()  # .depth: inside a wrapper, which reports its own result


def install() -> None:
    """Make accelerate's prepare_data_loader and skip_first_batches keep
    loader.DataLoader.  Needs accelerate imported (or importable)."""
    import accelerate.data_loader as adl

    with _lock:
        for name in _FUNCTIONS:
            if not getattr(getattr(adl, name), "_keeps_loader", False):
                setattr(adl, name, _keeping(getattr(adl, name)))
            # accelerate, accelerate.accelerator, transformers.trainer, a script:
            # modules that imported the function by name call their own reference
            rebind(getattr(adl, name))
        _watch_rebuilds(adl.DataLoaderAdapter)


def remember_samplers(dataloader) -> None:
    """A loader.DataLoader is made: its samplers identify it in a loader
    accelerate rebuilds from it (_watch_rebuilds)."""
    for sampler in (dataloader.sampler, dataloader.batch_sampler):
        if sampler is not None:
            try:
                _samplers_of_ours.add(sampler)
            except TypeError:  # unhashable (an __eq__ without __hash__): not recognised
                pass


def _made_from_ours(base) -> bool:
    """Was this loader made from a loader.DataLoader's sampler or batch
    sampler (accelerate wraps them: BatchSamplerShard, SkipBatchSampler)?"""
    seen = [getattr(base, "batch_sampler", None), getattr(base, "sampler", None)]
    for _ in range(3):  # a BatchSamplerShard of a BatchSampler of its sampler, at most
        for sampler in seen:
            try:
                if sampler is not None and sampler in _samplers_of_ours:
                    return True
            except TypeError:
                pass
        seen = [getattr(s, name, None) for s in seen for name in ("batch_sampler", "sampler")]
    return False


def _watch_rebuilds(adapter_cls) -> None:
    """Every DataLoaderAdapter (DataLoaderShard, DataLoaderDispatcher,
    SkipDataLoader) made outside the wrappers warns if it loads a
    loader.DataLoader's samplers on another class: a call of the
    unwrapped prepare_data_loader or skip_first_batches."""
    init = adapter_cls.__init__
    if getattr(init, "_watches_rebuilds", False):
        return

    @functools.wraps(init)
    def watching(self, *args, **kwargs):
        init(self, *args, **kwargs)
        base = self.base_dataloader
        if getattr(_wrapping, "depth", 0) == 0 and not _ours(base) and _made_from_ours(base):
            _warn_replaced(
                "a reference to accelerate's prepare_data_loader or skip_first_batches taken "
                "where no module name holds it", base,
                "take the function from accelerate after importing loader (the "
                "integration's), or call accelerate.skip_first_batches", stacklevel=4)

    watching._watches_rebuilds = True
    adapter_cls.__init__ = watching


def _ours(dataloader) -> bool:
    from loader.torch.dataloader import DataLoader

    base = getattr(dataloader, "base_dataloader", dataloader)
    return isinstance(base, DataLoader) or isinstance(dataloader, DataLoader)


def _keeping(fn):
    @functools.wraps(fn)
    def keeping(dataloader, *args, **kwargs):
        if not _ours(dataloader):
            with _lock:  # not while another thread has the name swapped
                return fn(dataloader, *args, **kwargs)
        import accelerate.data_loader as adl
        from loader.torch.dataloader import DataLoader

        with _lock:
            torch_cls = adl.DataLoader
            adl.DataLoader = DataLoader
            _wrapping.depth = getattr(_wrapping, "depth", 0) + 1
            try:
                result = fn(dataloader, *args, **kwargs)
            finally:
                _wrapping.depth -= 1
                adl.DataLoader = torch_cls
        if not _ours(result):
            _warn_replaced(
                f"accelerate's {fn.__name__}", getattr(result, "base_dataloader", result),
                "use_stateful_dataloader=True builds torchdata's StatefulDataLoader, which this "
                "project cannot replace: prepare only the model and optimizer and iterate the "
                "loader.DataLoader with a DistributedSampler", stacklevel=3)
        return result

    keeping._keeps_loader = True
    return keeping


def _warn_replaced(path: str, base, remedy: str, stacklevel: int) -> None:
    kind = type(base)
    warnings.warn(
        f"{path} rebuilt a loader.DataLoader as {kind.__module__}.{kind.__qualname__}: batches "
        f"now load on its workers, not ShmLoader's; to keep it: {remedy}",
        LoaderReplacedWarning, stacklevel=stacklevel)


def install_when_imported() -> None:
    """install() now if accelerate is imported, else as soon as it is."""
    _install_when_imported("accelerate.data_loader", install)
