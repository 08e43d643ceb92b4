"""Hugging Face transformers' Trainer building loader.DataLoader.

Trainer makes its loaders itself: get_train_dataloader(),
get_eval_dataloader() and get_test_dataloader() call
`accelerator.prepare(DataLoader(dataset, **params))` with its collator,
sampler, worker_init_fn and the TrainingArguments' dataloader_* options,
where `DataLoader` is the name in transformers.trainer, i.e. torch's class.
Trainer offers no hook for the class, so `Trainer` here (and
`DataLoaderMixin`, for a subclass of another Trainer, such as trl's) makes
those three methods run with that name bound to this project's class: the
loader has exactly the arguments Trainer chose, accelerate's prepare keeps
it (accelerate.py), and so does Trainer's resume (skip_first_batches).
A Trainer whose loader still comes out of another class (a transformers
version that builds loaders another way) gives a LoaderReplacedWarning.

The other way needs nothing from here: a Trainer subclass whose
get_train_dataloader() returns
`self.accelerator.prepare(loader.DataLoader(...))` (docs/frameworks.md,
"HF Trainer").  Importing this module imports transformers.
"""

from __future__ import annotations

import threading
import warnings

import transformers
import transformers.trainer as _hf_trainer

from loader.torch.integrations import LoaderReplacedWarning

__all__ = ["Trainer", "DataLoaderMixin", "LoaderReplacedWarning"]

_lock = threading.RLock()  # the module-global swap below is process-wide


class DataLoaderMixin:
    """Put before a transformers.Trainer class: the loaders it builds are
    loader.DataLoader (see the module's docstring)."""

    def get_train_dataloader(self):
        return _built_as_ours("get_train_dataloader", super().get_train_dataloader)

    def get_eval_dataloader(self, eval_dataset=None):
        return _built_as_ours("get_eval_dataloader",
                              lambda: super(DataLoaderMixin, self).get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset):
        return _built_as_ours("get_test_dataloader",
                              lambda: super(DataLoaderMixin, self).get_test_dataloader(test_dataset))


class Trainer(DataLoaderMixin, transformers.Trainer):
    """transformers.Trainer, its loaders loader.DataLoader."""


def _built_as_ours(method: str, build):
    from loader.torch.dataloader import DataLoader

    with _lock:
        torch_cls = _hf_trainer.DataLoader
        _hf_trainer.DataLoader = DataLoader
        try:
            result = build()
        finally:
            _hf_trainer.DataLoader = torch_cls
    base = getattr(result, "base_dataloader", result)
    if not isinstance(base, DataLoader):
        kind = type(base)
        warnings.warn(
            f"Trainer.{method}() built a {kind.__module__}.{kind.__qualname__}, not a "
            f"loader.DataLoader: this transformers version builds its loaders another way; "
            f"override {method}() to return self.accelerator.prepare(loader.DataLoader(...))",
            LoaderReplacedWarning, stacklevel=3)
    return result
