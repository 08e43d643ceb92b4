"""What a worker reports when an error comes: every Failed it sends is
built here (shared/messages.py), worded by one of the templates below for
where the error came from ({w}: the worker's id)."""

from __future__ import annotations

IN_INIT_FN = "in worker_init_fn of worker {w}"
LOADING = "in worker {w}"
FETCHING = "{fetch}, in worker {w}"
COLLATING = "in collate_fn in worker {w}"
PLACING_SAMPLE = "in worker {w}, placing sample {index} in its batch"
PLACING_FETCHED = "in worker {w}, placing sample {shown!r} (returned by __getitems__) in its batch"
PLACING_OUTPUT = "in worker {w}, placing the output of batch {slot}"
OPENING_STREAM = "in iter(dataset), in worker {w}"
ITERATING = "while iterating the dataset, in worker {w}"
PLACING_STREAMED = "in worker {w}, placing a sample in its batch"


class Failures:
    """A worker's reports of errors, sent through its channel."""

    def __init__(self, channel, worker_id: int):
        self.channel, self.me = channel, worker_id

    def __call__(self, where: str, exc: BaseException, run: int, *, batch: int | None = None,
                 pos: int | None = None, index=None, **words) -> None:
        """Report exc, raised where the template `where` says (filled with
        `words` and index); batch, pos, index: what it spoils, where known."""
        self.channel.failed(exc, where.format(w=self.me, index=index, **words), run=run,
                            batch=batch, pos=pos, index=index)
