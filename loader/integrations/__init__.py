"""Integrations of the loaders with training frameworks that rebuild or
wrap data loaders (see each module)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


class LoaderReplacedWarning(UserWarning):
    """A framework rebuilt a loader.DataLoader as another class: its batches
    do not come from ShmLoader's workers."""


class _InstallAfterImport(importlib.abc.MetaPathFinder):
    """Calls install() as `module` finishes importing (before modules that
    import it take their references), then leaves sys.meta_path."""

    def __init__(self, module: str, install):
        self.module, self.install = module, install

    def find_spec(self, name, path, target=None):
        if name != self.module:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, install = spec.loader.exec_module, self.install

        def exec_then_install(module):
            exec_module(module)
            install()

        spec.loader.exec_module = exec_then_install
        return spec


def install_when_imported(module: str, install) -> None:
    """install() now if `module` is imported, else as soon as it is: no
    import of the framework, no cost without it."""
    if module in sys.modules:
        install()
    elif not any(isinstance(f, _InstallAfterImport) and f.module == module
                 for f in sys.meta_path):
        sys.meta_path.insert(0, _InstallAfterImport(module, install))
