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

Errors are RemoteError's subclasses (loader/errors.py), raised by the worker that
needed the object, so next() raises them on the batch that needs it.
"""
