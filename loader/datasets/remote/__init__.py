"""Data in an object store (S3 first; gs://, az://, http(s):// through the
same client): a local cache that fills, rotates and is shared.

NOTE [ Remote data ]
====================

    FileDataset("s3://bucket/sims/**/*.npy", cache_dir="/nvme/cache",
                cache_limit_bytes=200 << 30, train_on="all")

The processes, and what each may do:

  main (the training loop)   never touches the network, never waits for it:
                             its dataset object reads the latest listing the
                             fetcher finished (a memfd of arrays) as an epoch
                             starts, and hands the epoch's order to the
                             fetcher (a memfd, passed over a socket).
  the fetcher                a fresh interpreter started with subprocess (no
                             fork: network clients are not fork-safe, and a
                             program may have used one before it made the
                             loader).  It lists the store (paginated, in the
                             background), downloads objects into the cache
                             ahead of the workers in the epoch's order, and
                             evicts.  The only process that writes the cache.
  the workers                read each object from the cache with the local
                             path (a .npy straight into its row of the slab);
                             an object not there yet is waited for on the
                             board's bell, not polled.

What they share (all unnamed, nothing to leak; the fetcher gets the fds at
its start, the workers inherit them at the fork):

  the board     a memfd made by the dataset: per object of the two latest
                listings (by parity, as runs are) its state (absent,
                complete, failed, wanted by a worker), error records, the
                counters behind stats(), and two bells (objects arrived; the
                fetcher's work arrived).
  the cache     cache_dir on the local disk, shared by every loader, rank and
                job of the node: NOTE [ The object cache ] in cache.py.

How far the fetcher reads ahead: with train_on="all" every object in the
cache is trained again each epoch, so room made for an object further ahead
by evicting one the epoch has still to train is a miss later.  The fetcher
makes such room only for objects at most `requests_in_flight` places past
what the workers have trained, and at most a quarter of the objects the
cache holds (or one a worker asks for); further ahead it
waits for the room that objects trained free, and an epoch's objects still
to be trained are never evicted for the next epoch's.  An epoch so loses
about `requests_in_flight` hits, whatever the cache's size (a cache of a
fraction f of the data serves 0.95 f or more once it holds some 20 times
that many objects: tests/remote_layer/test_remote_files.py).

With train_on="cached" an epoch's objects are local as it starts, and stay
so: the objects fetched for the epochs to come get their room only from
objects no live epoch still needs (its set is pinned until trained, and
with a run started ahead two epochs' sets are pinned at once).  Making that
room from an epoch's set sent its workers to wait for the network and, with
both sets waiting and the cache full, hung the fetcher.

Errors are RemoteError's subclasses (loader/errors.py), raised by the worker that
needed the object, so next() raises them on the batch that needs it.
"""
