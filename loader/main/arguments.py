"""ShmLoader's arguments, checked once: every mistake is an ArgumentError
(a ValueError) or ArgumentTypeError (a TypeError) that names the
argument, what it got and what to pass instead, raised before anything
is started.  `check_arguments` returns them normalised (defaults filled
in, num_workers="auto" resolved) as the loader's LoaderSpec
(shared/spec.py), which every part of the loader takes."""

from __future__ import annotations

import functools
import inspect
import secrets

from loader.errors import ArgumentError, ArgumentTypeError
from loader.main.autoscale import cpu_count, default_max_workers
from loader.batcher.slabs import ram_bytes
from loader.shared.optional import imported_torch
from loader.shared.spec import SHM_RULES, LoaderSpec, Rules
from loader.shared.trace import TraceLog

DEFAULT_PREFETCH = 3


def torch_positions(init):
    """ShmLoader.__init__ with a call that passes more arguments by position
    than its positional parameters (torch's first seven, in torch's order)
    refused by an ArgumentTypeError that says what to do.  From the eighth
    on the two signatures differ (torch's eighth is pin_memory, then
    drop_last), so a positional call copied from torch must fail, never
    bind to the wrong parameter; Python's own TypeError would not say why."""
    params = list(inspect.signature(init).parameters.values())[1:]  # (not self)
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY]

    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        if len(args) > len(positional):
            raise ArgumentTypeError(
                f"{type(self).__name__}() takes {len(positional)} arguments by position, "
                f"torch's DataLoader's first ones in its order ({', '.join(positional)}), "
                f"but {len(args)} were given: pass the others by keyword, as "
                f"{keyword_only[0]}=... (every parameter after {positional[-1]} is "
                f"keyword-only: {', '.join(keyword_only)})")
        return init(self, *args, **kwargs)
    return checked


def positive_int(name: str, value, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")


def is_iterable_dataset(dataset) -> bool:
    """As PyTorch decides: a torch IterableDataset is iterable (even with
    __len__); any other object is iterable when it has __iter__ and no
    __getitem__."""
    torch = imported_torch()
    if torch is not None and isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")


def default_memory_cap() -> int:
    return max(1 << 30, ram_bytes() // 4)


def _workers(num_workers, max_workers) -> tuple[int, bool, int]:
    """(workers to start with, auto, max_workers or 0)."""
    auto = num_workers == "auto"
    if auto:
        max_workers = default_max_workers() if max_workers is None else max_workers
        positive_int("max_workers", max_workers)
        num_workers = min(cpu_count(), max_workers)  # where the pool starts (main/autoscale.py)
    elif max_workers is not None:
        raise ArgumentError("max_workers caps num_workers='auto'; with a fixed num_workers, "
                         "leave it out")
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0:
        raise ArgumentError(f"num_workers must be an int >= 0 (0 loads in the main process) or "
                         f"'auto', got {num_workers!r}")
    return num_workers, auto, max_workers or 0


def _check_modes(worker_mode, output, timeout, prefetch, memory_cap_bytes, collate_fn) -> None:
    if worker_mode not in ("process", "thread"):
        raise ArgumentError(f"worker_mode must be 'process' or 'thread', got {worker_mode!r}")
    if output not in ("numpy", "torch", "keep"):
        raise ArgumentError(f"output must be 'numpy', 'torch' or 'keep' (each leaf as the "
                         f"dataset or collate_fn gave it), got {output!r}")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ArgumentError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    if prefetch is not None:
        positive_int("prefetch", prefetch)
    if memory_cap_bytes is not None:
        positive_int("memory_cap_bytes", memory_cap_bytes, 4096)
    if collate_fn is not None and not callable(collate_fn):
        raise ArgumentTypeError(f"collate_fn must be callable, got {type(collate_fn).__name__}")


def _check_start(start_method, worker_mode) -> None:
    if start_method not in ("fork", "spawn"):
        hint = (" ('spawn' starts the processes clean, as forkserver's are)"
                if start_method == "forkserver" else "")
        raise ArgumentError(f"start_method must be 'fork' (the default) or 'spawn' (fresh "
                            f"processes: nothing of this process's threads is copied, for JAX), "
                            f"got {start_method!r}{hint}")
    if start_method == "spawn" and worker_mode == "thread":
        raise ArgumentError("start_method='spawn' starts worker processes; worker_mode='thread' "
                            "starts none: leave start_method out, or use worker_mode='process'")


def _check_order(batch_size, shuffle, sampler, batch_sampler, drop_last, generator) -> None:
    if sampler is not None and shuffle:
        raise ArgumentError("sampler and shuffle=True are exclusive: shuffle inside the sampler")
    if batch_sampler is not None and (batch_size != 1 or shuffle or sampler is not None
                                      or drop_last):
        raise ArgumentError("batch_sampler makes the batches: it is exclusive with batch_size, "
                         "shuffle, sampler and drop_last")
    if generator is not None:
        torch = imported_torch()
        if torch is None or not isinstance(generator, torch.Generator):
            raise ArgumentTypeError(f"generator must be a torch.Generator, got "
                            f"{type(generator).__name__}")


def _check_stream(iterable, auto, shuffle_buffer, collate_fn, batch_size) -> None:
    if auto and iterable:
        raise ArgumentError("num_workers='auto' needs a map-style dataset: an iterable dataset "
                         "is split into one stream per worker, so its workers are fixed")
    if shuffle_buffer is not None:
        positive_int("shuffle_buffer", shuffle_buffer)
        if not iterable:
            raise ArgumentError("shuffle_buffer shuffles a stream (an iterable dataset); a "
                             "map-style dataset is shuffled by shuffle=True")
        if collate_fn is not None or batch_size is None:
            raise ArgumentError("shuffle_buffer places samples in random rows of pending "
                             "batches: it needs the default collate and a batch_size")


def _check_sharding(iterable, distributed, shuffle, sampler, batch_sampler) -> None:
    if iterable and (sampler is not None or batch_sampler is not None or shuffle):
        raise ArgumentError("an iterable dataset orders its own samples: sampler, batch_sampler "
                         "and shuffle apply to map-style datasets (with __getitem__) only")
    if not isinstance(distributed, bool):
        ok = (isinstance(distributed, tuple) and len(distributed) == 2
              and all(isinstance(v, int) for v in distributed)
              and 0 <= distributed[0] < distributed[1])
        if not ok:
            raise ArgumentError(f"distributed must be True, False or (rank, world_size) with "
                             f"0 <= rank < world_size, got {distributed!r}")
    if distributed and (sampler is not None or batch_sampler is not None):
        raise ArgumentError("distributed=True shards the loader's own order across ranks; with "
                         "a sampler, shard in the sampler (torch's DistributedSampler)")


def check_arguments(rules: Rules = SHM_RULES, /, **given) -> LoaderSpec:
    """ShmLoader's arguments (`given`: each by its name, all of them)
    checked, in the order its tests expect the first mistake to be named,
    and normalised into the loader's spec (a bad trace path fails here,
    not at close(): NOTE [ Trace records ] in shared/trace.py)."""
    g = dict(given)
    if g["batch_size"] is not None:
        positive_int("batch_size", g["batch_size"])
    num_workers, auto, max_workers = _workers(g["num_workers"], g["max_workers"])
    _check_modes(g["worker_mode"], g["output"], g["timeout"], g["prefetch"],
                 g["memory_cap_bytes"], g["collate_fn"])
    _check_start(g["start_method"], g["worker_mode"])
    _check_order(g["batch_size"], g["shuffle"], g["sampler"], g["batch_sampler"],
                 g["drop_last"], g["generator"])
    iterable = is_iterable_dataset(g["dataset"])
    _check_stream(iterable, auto, g["shuffle_buffer"], g["collate_fn"], g["batch_size"])
    _check_sharding(iterable, g["distributed"], g["shuffle"], g["sampler"], g["batch_sampler"])
    seed, reproducible = g["seed"], g["reproducible"]
    g.update(
        num_workers=num_workers, auto=auto, max_workers=max_workers,
        prefetch=g["prefetch"] if g["prefetch"] is not None else DEFAULT_PREFETCH,
        seed=seed if seed is not None else secrets.randbits(63), seed_given=seed is not None,
        reproducible=(seed is not None) if reproducible is None else bool(reproducible),
        memory_cap_bytes=g["memory_cap_bytes"] or default_memory_cap(),
        shuffle_buffer=g["shuffle_buffer"] or 0, iterable=iterable,
        trace=None if g["trace"] is None else TraceLog(
            g["trace"], passable=g["start_method"] == "spawn"))
    return LoaderSpec(rules=rules, **g)
