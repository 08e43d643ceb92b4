"""Epochs as lists of rows, and an epoch cut after k batches with the
loader's state then: what the resume tests of datasets that keep their own
state (test_own_state.py, test_resumes_itself.py) compare."""

import numpy as np


def rows(batch) -> list:
    return [tuple(r) for r in np.asarray(batch).tolist()]


def epochs(loader, n: int) -> list:
    """n whole epochs, each the list of its rows in delivery order."""
    return [[r for b in loader for r in rows(b)] for _ in range(n)]


def cut(loader, epoch: int, batches: int):
    """Run `epoch` whole epochs, then `batches` of the next: (what those
    batches held, the state then)."""
    epochs(loader, epoch)
    it = iter(loader)
    got = [r for _ in range(batches) for r in rows(next(it))]
    return got, loader.state_dict()
