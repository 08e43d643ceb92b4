"""Ray Train keeps loader.DataLoader and ShmLoader.

`ray.train.torch.prepare_data_loader(dl)` (Train V1 and V2 alike) does two
things to a loader, and both used to lose this project's loader:

- with more than one worker, a loader whose sampler is not a
  DistributedSampler (the usual `DataLoader(ds, shuffle=True)`, or a custom
  sampler) is rebuilt as `DataLoader(**args)` with a DistributedSampler,
  where `DataLoader` is the name in Ray's module, i.e. torch's class: the
  batches then load on torch's workers, with no warning;
- with move_to_device=True (the default) the loader is wrapped in Ray's
  `_WrappedDataLoader`, which moves each batch to the device and pulls
  one batch ahead of the training loop and has no state_dict().

So this module wraps Ray's prepare_data_loader (as accelerate.py wraps
accelerate's): while it prepares a loader.DataLoader, Ray's names
`DataLoader` and `_WrappedDataLoader` are this project's DataLoader and
`StatefulWrappedDataLoader`, so the rebuilt loader has exactly the
arguments Ray chose (its DistributedSampler, shuffle kept from the
original's sampler) and the wrapper has state_dict()/load_state_dict()
counting only what the training loop received.  A ShmLoader is prepared
here, not by Ray (it shards itself with distributed=True; Ray cannot
rebuild it): an unsharded one under several workers is a ValueError.

Installed without being asked: `import loader` installs it when Ray
Train's torch utilities are imported (before or after);
`loader.torch.integrations.ray.prepare_data_loader` is the same function, named
for readers and for code that imports it explicitly.  A path that still
ends on another loader class is reported with a LoaderReplacedWarning.

Why a state through Ray's wrapper needs it: NOTE [ A state through a
look-ahead wrapper ] in loader/main/lookahead.py.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings

from loader.errors import ArgumentError, LoaderReplacedWarning
from loader.torch.integrations import install_when_imported as _install_when_imported

__all__ = ["prepare_data_loader", "install"]

# Ray's modules that define prepare_data_loader over module globals
# `DataLoader` and `_WrappedDataLoader` (V1; V2, which ray.train.torch exports
# when Train V2 is on).
_RAY_MODULES = ("ray.train.torch.train_loop_utils", "ray.train.v2.torch.train_loop_utils")

_lock = threading.RLock()  # the module-global swap below is process-wide


def prepare_data_loader(data_loader, add_dist_sampler: bool = True, move_to_device: bool = True,
                        auto_transfer: bool = True):
    """ray.train.torch.prepare_data_loader, keeping this project's loaders.

    loader.DataLoader: Ray's own preparation, with the rebuilt loader (if
    Ray adds a DistributedSampler) a loader.DataLoader and the device-move
    wrapper a StatefulWrappedDataLoader.  ShmLoader: kept as it is (it
    shards itself with distributed=True), wrapped for the device move when
    asked.  Any other loader: Ray's function, untouched."""
    install()
    import ray.train.torch as rtt

    return rtt.prepare_data_loader(data_loader, add_dist_sampler=add_dist_sampler,
                                   move_to_device=move_to_device, auto_transfer=auto_transfer)


def install() -> None:
    """Make Ray Train's prepare_data_loader keep loader.DataLoader and
    ShmLoader.  Needs ray.train.torch importable.  Idempotent."""
    import ray.train.torch  # noqa: F401  (imports the V1 and, if on, the V2 module)

    with _lock:
        for name in _RAY_MODULES:
            mod = sys.modules.get(name)
            if mod is None:
                continue
            fn = mod.prepare_data_loader
            if getattr(fn, "_keeps_loader", False):
                continue
            wrapped = _keeping(fn, mod)
            mod.prepare_data_loader = wrapped
            # ray.train.torch imported the function by name: its reference too
            for other in ("ray.train.torch", "ray.train.v2.torch"):
                m = sys.modules.get(other)
                if m is not None and getattr(m, "prepare_data_loader", None) is fn:
                    m.prepare_data_loader = wrapped


def _kind(data_loader) -> str:
    """'DataLoader' or 'ShmLoader' for this project's loaders, else ''."""
    from loader.main.loader import ShmLoader

    if isinstance(data_loader, ShmLoader):
        return "ShmLoader"
    torch_mod = sys.modules.get("loader.torch.dataloader")
    if torch_mod is not None and isinstance(data_loader, torch_mod.DataLoader):
        return "DataLoader"
    return ""


def _keeping(fn, mod):
    @functools.wraps(fn)
    def keeping(data_loader, add_dist_sampler=True, move_to_device=True, auto_transfer=True):
        kind = _kind(data_loader)
        if kind == "ShmLoader":
            return _prepare_shm(data_loader, add_dist_sampler, move_to_device, auto_transfer)
        if not kind:
            with _lock:  # not while another thread has the names swapped
                return fn(data_loader, add_dist_sampler, move_to_device, auto_transfer)
        from loader.torch.dataloader import DataLoader

        with _lock:
            torch_cls, wrapper_cls = mod.DataLoader, mod._WrappedDataLoader
            mod.DataLoader, mod._WrappedDataLoader = DataLoader, wrapper_class()
            try:
                result = fn(data_loader, add_dist_sampler, move_to_device, auto_transfer)
            finally:
                mod.DataLoader, mod._WrappedDataLoader = torch_cls, wrapper_cls
        base = getattr(result, "_dataloader", result)
        if not _kind(base):
            warnings.warn(
                f"ray.train.torch.prepare_data_loader rebuilt a loader.DataLoader as "
                f"{type(base).__module__}.{type(base).__qualname__}: batches now load on its "
                f"workers, not ShmLoader's (a Ray version that rebuilds loaders another way); "
                f"pass the loader.DataLoader a DistributedSampler yourself and call "
                f"prepare_data_loader(dl, add_dist_sampler=False) to keep it",
                LoaderReplacedWarning, stacklevel=2)
        return result

    keeping._keeps_loader = True
    return keeping


def _prepare_shm(shm, add_dist_sampler: bool, move_to_device: bool, auto_transfer: bool):
    import ray.train
    import ray.train.torch as rtt

    world = ray.train.get_context().get_world_size()
    if world > 1 and add_dist_sampler and not shm.distributed and not shm.iterable and not (
            _is_distributed_sampler(shm.sampler)):
        raise ArgumentError(
            f"prepare_data_loader: this ShmLoader is not sharded (distributed=False) and Ray "
            f"Train runs {world} workers, so every rank would load the whole dataset; Ray "
            f"cannot rebuild a ShmLoader with a DistributedSampler: create it with "
            f"ShmLoader(..., distributed=True), or pass add_dist_sampler=False to load all of "
            f"it on every rank")
    if not move_to_device:
        return shm
    return wrapper_class()(shm, rtt.get_device(), auto_transfer)


def _is_distributed_sampler(sampler) -> bool:
    from torch.utils.data import DistributedSampler

    return isinstance(sampler, DistributedSampler)


@functools.cache
def wrapper_class():
    """StatefulWrappedDataLoader: made at first use, since it subclasses
    Ray's class (no import of ray before it is needed)."""
    from ray.train.torch.train_loop_utils import _WrappedDataLoader

    class StatefulWrappedDataLoader(_WrappedDataLoader):
        """Ray's device-move wrapper, with the loader's state as the
        training loop has it (NOTE [ A state through a look-ahead wrapper ])."""

        def _prefetch_next_batch(self):
            # the one place Ray's wrapper pulls ahead (at iter() and in each
            # __next__): the loop has what was handed out before it, not this
            self._dataloader.freeze_state()
            super()._prefetch_next_batch()
            if self.next_batch is None:  # the pass is over: nothing is held back
                self._dataloader.thaw_state()

        def state_dict(self) -> dict:
            """The loader's state as of the last batch the loop received."""
            return self._dataloader.state_dict()

        def load_state_dict(self, state: dict) -> None:
            self._dataloader.load_state_dict(state)
            self.next_batch = None  # a batch pulled ahead at the old position is dropped

        def stats(self):
            return self._dataloader.stats()

        def close(self) -> None:
            self._dataloader.close()

    StatefulWrappedDataLoader.__module__ = __name__
    return StatefulWrappedDataLoader


def install_when_imported() -> None:
    """install() now if ray.train.torch is imported, else as soon as it is."""
    _install_when_imported("ray.train.torch", install)
