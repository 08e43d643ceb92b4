"""freeze_state() / thaw_state(): the state a training loop has while a
wrapper between it and the loader pulls batches ahead of it.

NOTE [ A state through a look-ahead wrapper ]
=============================================

state_dict() counts every batch the loader handed out (NOTE [ Resuming an
epoch ] in order/progress.py): right for a loop that iterates the loader, one
batch too many for a loop that iterates a wrapper pulling ahead.  Ray
Train's device-move wrapper (_WrappedDataLoader) calls next() on the loader
once at iter() and once more inside each of its own __next__, before it
returns the batch it already had:

    the loop received:       b0          b1          b2
    the loader handed out:   b0 b1       b2          b3
                                ^ a state taken while the loop holds b0
                                  counts b1, which the loop never had:
                                  the resumed epoch skips it

(Lightning looks ahead only for a loader without len(); there too a
batch would be skipped.)

The rule, for any wrapper: the state of a run is the loader's state as it
was when the training loop received its last batch.  Neither the loader
nor its iterator can tell a look-ahead from the loop's own next(), so the
wrapper says so: freeze_state() just before each batch it pulls ahead of
the loop, thaw_state() when nothing pulled is held back any more (its
pass ended).  While frozen, state_dict() answers the state as it was at
freeze_state(); a new iter() of the loader thaws it (an iter() that is
not the wrapper's own is a loop iterating the loader itself).
load_state_dict() freezes the state it loads, by the same rule: until
the resumed pass begins, the loop has received exactly what that state
says (a checkpoint taken right after a restore keeps the position).  Ray's wrapper is replaced by one that does
this (loader/torch/integrations/ray.py); a user's own prefetcher can do the
same.  Cost: one state_dict() per batch, a few numbers (docs/benchmarks.md,
RAY).
"""

from __future__ import annotations

import copy


class FrozenState:
    """freeze_state()/thaw_state() for a loader whose state_dict() starts
    with `frozen = self._frozen_state_copy()` and returns it if not None."""

    _frozen_state: dict | None = None

    def freeze_state(self) -> None:
        """From now on state_dict() is the state as it is now, until
        thaw_state(), iter() or load_state_dict() (NOTE [ A state through a
        look-ahead wrapper ]).  For a wrapper about to pull a batch its
        training loop has not asked for yet."""
        self._frozen_state = None
        self._frozen_state = self.state_dict()

    def thaw_state(self) -> None:
        """state_dict() counts every batch handed out again."""
        self._frozen_state = None

    def _freeze_loaded(self, state: dict) -> None:
        """load_state_dict(): until the resumed pass begins, the state is the loaded one."""
        self._frozen_state = copy.deepcopy(state)

    def _frozen_state_copy(self) -> dict | None:
        # a copy: the caller may change what it gets (a checkpoint's extras)
        return None if self._frozen_state is None else copy.deepcopy(self._frozen_state)
