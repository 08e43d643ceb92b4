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
when accelerate is imported (before or after).  `install()` is idempotent.
A path that still ends on another loader class (accelerate's
use_stateful_dataloader=True builds torchdata's StatefulDataLoader; an
accelerate version that changes how it rebuilds) is reported with a
LoaderReplacedWarning naming the class, never silently.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings

from loader.errors import LoaderReplacedWarning
from loader.torch.integrations import install_when_imported as _install_when_imported

__all__ = ["install"]


_lock = threading.RLock()  # the module-global swap below is process-wide


def install() -> None:
    """Make accelerate's prepare_data_loader and skip_first_batches keep
    loader.DataLoader.  Needs accelerate imported (or importable)."""
    import accelerate.data_loader as adl

    with _lock:
        for name in ("prepare_data_loader", "skip_first_batches"):
            fn = getattr(adl, name)
            if getattr(fn, "_keeps_loader", False):
                continue
            wrapped = _keeping(fn)
            setattr(adl, name, wrapped)
            # modules that imported the function by name call their own reference
            for mod in ("accelerate.accelerator", "accelerate"):
                m = sys.modules.get(mod)
                if m is not None and getattr(m, name, None) is fn:
                    setattr(m, name, wrapped)


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
            try:
                result = fn(dataloader, *args, **kwargs)
            finally:
                adl.DataLoader = torch_cls
        if not _ours(result):
            base = getattr(result, "base_dataloader", result)
            kind = type(base)
            warnings.warn(
                f"accelerate's {fn.__name__} rebuilt a loader.DataLoader as "
                f"{kind.__module__}.{kind.__qualname__}: batches now load on its workers, not "
                f"ShmLoader's (use_stateful_dataloader=True builds torchdata's StatefulDataLoader, "
                f"which this project cannot replace); prepare only the model and optimizer and "
                f"iterate the loader.DataLoader with a DistributedSampler to keep it",
                LoaderReplacedWarning, stacklevel=2)
        return result

    keeping._keeps_loader = True
    return keeping


def install_when_imported() -> None:
    """install() now if accelerate is imported, else as soon as it is."""
    _install_when_imported("accelerate.data_loader", install)
