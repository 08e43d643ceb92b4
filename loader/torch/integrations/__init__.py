"""Integrations of the loaders with training frameworks that rebuild or
wrap data loaders (see each module).

NOTE [ Installing the integrations ]
====================================

Each integration patches a framework module (Ray Train's
prepare_data_loader, accelerate's prepare and skip_first_batches) and
must do so before the framework uses it, without importing the framework
itself (no import of ray or accelerate, no cost, unless the program uses
them).  One registry here, `install_when_imported(module, install)`, does
it for all of them:

  * `module` already imported: install() at once;
  * else an _IntegrationFinder on sys.meta_path patches the module's spec
    so install() runs as the module finishes executing, before any module
    that imports it takes its references;
  * and every loader made (ShmLoader, loader.DataLoader) installs what is
    pending for a module imported by then (install_imported), so an import
    the finder never saw still gets its integration before a loader can
    reach the framework.

The finder stays until each of its installs ran: a find_spec() probe
(importlib.util.find_spec, which executes nothing) or an import that failed
and is retried is seen again.  It asks the other finders for the spec (an
instrumenting finder still wraps the module).  It never moves itself in
sys.meta_path (code that inserts its own finder at 0 removes index 0 again);
a finder inserted ahead of it that finds the module itself hides the import
from it, and then the loader made next installs the integration.  What no
hook sees: a loader made before the framework is imported through such a
finder, and handed to it without a loader made in between.

A module that imported a patched function by name before the install
(transformers.trainer's `from accelerate import skip_first_batches`, a
training script's) holds the framework's own function: install() points
every such module-level name at the integration's (rebind), and modules
imported after it get the integration's by the same import.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import types

from loader.errors import LoaderReplacedWarning


_pending: dict = {}            # module name -> install(), until it ran
_lock = threading.RLock()


class _IntegrationFinder(importlib.abc.MetaPathFinder):
    """Runs an integration's install() as its module finishes importing
    (NOTE [ Installing the integrations ])."""

    def find_spec(self, name, path, target=None):
        if name not in _pending:
            return None
        spec = self._spec_from_the_others(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            _install(name)

        spec.loader.exec_module = exec_then_install
        return spec

    def _spec_from_the_others(self, name, path, target):
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                return spec
        return None


_finder = _IntegrationFinder()


def _install(module: str) -> None:
    with _lock:
        install = _pending.pop(module, None)
        if not _pending and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
    if install is not None:
        install()


def _imported(module: str) -> bool:
    """The module is in sys.modules and done executing."""
    mod = sys.modules.get(module)
    spec = getattr(mod, "__spec__", None)
    return mod is not None and not getattr(spec, "_initializing", False)


def install_when_imported(module: str, install) -> None:
    """install() now if `module` is imported, else as soon as it is: no
    import of the framework, no cost without it."""
    if _imported(module):
        install()
        return
    with _lock:
        _pending[module] = install
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def install_imported() -> None:
    """Install what is pending for modules imported by now (every loader
    made calls this: NOTE [ Installing the integrations ])."""
    if _pending:
        for module in [m for m in list(_pending) if _imported(m)]:
            _install(module)


def rebind(wrapped) -> None:
    """Point every module-level name that holds the function `wrapped`
    wraps (its __wrapped__, under its own name) at `wrapped`: modules that
    imported it by name before the integration was installed (NOTE
    [ Installing the integrations ])."""
    original, name = wrapped.__wrapped__, wrapped.__name__
    for module in list(sys.modules.values()):
        if isinstance(module, types.ModuleType) and module.__dict__.get(name) is original:
            setattr(module, name, wrapped)
