"""What each epoch of a loader loads, drawn from the loader's arguments and
generators: the workers' base seed, the generator states a state records,
the dataset's snapshot of the epoch, and the plan of its run (plan_run,
in order/planning.py, decides the plan itself without side effects; what draws
from generators is here).

A ShmLoader owns one EpochPlanner.  It reads the loader's spec as it
stands now (LiveSpec, shared/spec.py: the dataset, samplers, generator,
seed, ranks, rules, ...), never the loader, and owns what only planning
keeps: the base seeds torch's rules draw ahead, and the states a loaded
state gives the dataset's copies.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from loader.datasets.snapshot import EpochInfo
from loader.datasets.own_state import RunStates, next_pass
from loader.errors import ArgumentError
from loader._native import derived_seeds
from loader.order.planning import Plan, plan_run, run_indices
from loader.shared.optional import imported_torch
from loader.shared.spec import LiveSpec

if TYPE_CHECKING:
    from loader.main.state import LoaderState


def distributed_rank() -> tuple[int, int]:
    """(rank, world size) of this process: from the initialised
    torch.distributed process group, else the RANK and WORLD_SIZE
    environment variables torchrun sets, else (0, 1)."""
    torch = imported_torch()
    dist = None if torch is None else torch.distributed
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        raise ArgumentError(f"distributed=True: RANK and WORLD_SIZE must be integers ({e})") from None
    if not 0 <= rank < world:
        raise ArgumentError(f"distributed=True: RANK={rank} is not in 0..WORLD_SIZE-1 "
                            f"(WORLD_SIZE={world})")
    return rank, world


class EpochPlanner:
    """Plans the epochs of one loader (see the module's docstring)."""

    def __init__(self, live: LiveSpec):
        self.live = live
        self.drawn_base_seed = None  # torch's rules: drawn once with persistent workers
        self.early_base_seed = None  # torch's rules: drawn by iter(), taken by the epoch's plan
        self.own_load = None  # the states a loaded state gives the dataset's copies (next run)

    # --- the loader's shape ------------------------------------------------------------

    def ranks(self) -> tuple[int, int]:
        """(rank, world size) the loader's `distributed` asks for now."""
        distributed = self.live.now.distributed
        if distributed is True:
            return distributed_rank()
        if distributed:
            return distributed
        return 0, 1

    def take_ranks(self) -> None:
        """The loader (re)starts: its ranks are taken now (torchrun may have
        initialised its process group since it was made)."""
        rank, world = self.ranks()
        self.live.update(rank=rank, world=world)

    # --- seeds and generators -------------------------------------------------------------

    def base_seed(self, epoch: int, resumed: int | None = None) -> int:
        """The seed workers take for an epoch (see seed_worker): drawn from
        the generator as torch's DataLoader draws it (once per iterator it
        makes: each epoch, or once with persistent workers), else from the
        seed.  A resumed epoch takes the one its state recorded (`resumed`),
        drawing nothing: the recorded generator states are those after it
        was drawn (NOTE [ Resuming an epoch ])."""
        ld = self.live.now
        early, self.early_base_seed = self.early_base_seed, None
        if resumed is None:
            resumed = early
        if resumed is not None:
            self.drawn_base_seed = resumed
            return resumed
        if ld.torch_rules or ld.generator is not None:
            if self.drawn_base_seed is not None and ld.persistent_workers and ld.num_workers:
                return self.drawn_base_seed
            import torch

            seed = int(torch.empty((), dtype=torch.int64).random_(generator=ld.generator).item())
            self.drawn_base_seed = seed
            return seed
        return int(derived_seeds(ld.seed & ((1 << 64) - 1), epoch, 0, 0)[0])

    def draw_at_iter(self, epoch: int) -> None:
        """torch's rules: the base seed is drawn as the iterator is made."""
        self.early_base_seed = None
        self.early_base_seed = self.base_seed(epoch)

    def rng_states(self) -> dict:
        """The states of the torch generators an epoch's order and base
        seed are drawn from, as bytes (see NOTE [ Resuming an epoch ])."""
        ld = self.live.now
        states = {}
        if ld.generator is not None:
            states["generator"] = ld.generator.get_state().numpy().tobytes()
        elif ld.torch_rules:  # DataLoader draws from torch's global generator
            import torch

            states["global"] = torch.get_rng_state().numpy().tobytes()
        sampler_gen = getattr(ld.sampler, "generator", None)
        if sampler_gen is not None and hasattr(sampler_gen, "get_state"):
            states["sampler"] = sampler_gen.get_state().numpy().tobytes()
        return states

    def set_rng_states(self, states: dict) -> None:
        if not states:  # no torch generator in play: nothing to restore (nor torch to import)
            return
        import torch

        def tensor(b):
            return torch.from_numpy(np.frombuffer(b, np.uint8).copy())

        ld = self.live.now
        if "generator" in states and ld.generator is not None:
            ld.generator.set_state(tensor(states["generator"]))
        if "global" in states:
            torch.set_rng_state(tensor(states["global"]))
        if "sampler" in states:
            ld.sampler.generator.set_state(tensor(states["sampler"]))

    # --- an epoch's plan ------------------------------------------------------------------

    def snapshot(self, epoch: int):
        """The dataset's own view of the epoch starting, or None: see NOTE
        [ Datasets that change with the epoch ] in datasets/snapshot.py."""
        ld = self.live.now
        take = getattr(ld.dataset, "epoch_snapshot", None)
        if not callable(take):
            return None
        return take(EpochInfo(epoch=epoch, seed=ld.seed, rank=ld.rank, world_size=ld.world,
                              batch_size=ld.batch_size, num_workers=ld.num_workers))

    def tell_order(self, plan: Plan) -> None:
        """A dataset that fetches ahead of the workers learns what the run
        loads, in order (NOTE [ Datasets that change with the epoch ])."""
        spec = self.live.now
        tell = getattr(spec.dataset, "epoch_order", None)
        if not callable(tell) or plan.snapshot is None or spec.iterable:
            return
        indices = run_indices(plan, spec.rank, spec.world)
        if indices is not None:
            tell(plan.snapshot, indices)

    def plan(self, epoch: int, resume: LoaderState | None = None, snapshot=None) -> Plan:
        """Decide epoch's run: which indices in which order (see NOTE
        [ Runs ]); with `resume`, only what the state says is left of it
        (NOTE [ Resuming an epoch ])."""
        if snapshot is None:
            snapshot = self.snapshot(epoch)
        if resume is None or "global" not in resume.rng:
            plan = self._drawn(epoch, resume)
        else:
            import torch

            with torch.random.fork_rng(devices=[]):  # the user's global generator is left alone
                plan = self._drawn(epoch, resume)
        return plan._replace(snapshot=snapshot, **self._own_states(plan.progress))

    # --- a dataset that keeps its own state -------------------------------------------

    def _own_states(self, progress) -> dict:
        """A run's book of its dataset copies' states, and what they load first."""
        spec = self.live.now
        if spec.resumes_itself():
            load, self.own_load = self.own_load, None
            return {"pass_start": load[0] if load else next_pass(spec.dataset)}
        if not spec.takes_own_state():
            return {}
        load, self.own_load = self.own_load, None
        book = RunStates(*spec.dataset_copies())
        book.progress = progress if spec.iterable else None
        return {"own": book, "own_load": None if book.shared_by else load}

    def _drawn(self, epoch: int, resume: LoaderState | None) -> Plan:
        spec = self.live.now
        if resume is not None:
            if (resume.rank, resume.world) != (spec.rank, spec.world):
                raise ValueError(f"this state is of rank {resume.rank} of {resume.world}; "
                                 f"this loader is rank {spec.rank} of {spec.world}: each rank "
                                 f"resumes from its own state")
            self.set_rng_states(resume.rng)
        base_seed = self.base_seed(epoch, None if resume is None else resume.base_seed)
        # after the base seed, as torch draws it before the order: these are
        # the states the order is drawn from (NOTE [ Resuming an epoch ])
        rng = self.rng_states()
        return plan_run(self.live.now, epoch=epoch, resume=resume, base_seed=base_seed,
                        rng=rng)
