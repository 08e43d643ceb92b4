"""torch is optional: the loader uses it only when the program has
imported it.  `imported_torch()` is the one way loader code asks."""

from __future__ import annotations

import sys


def imported_torch():
    """torch, if this process has imported it, else None.

    A torch still being imported counts as not imported: another thread of
    the program may be half-way through `import torch` while thread
    workers load samples (or a process forked at that moment keeps the
    half-made module for good); its classes (torch.Tensor) do not exist
    yet, so no sample can hold one, and reading them would raise."""
    torch = sys.modules.get("torch")
    if torch is None or getattr(getattr(torch, "__spec__", None), "_initializing", False):
        return None
    return torch
