"""What can go wrong with data in an object store, as exceptions that say
what, where (the object's URL, the endpoint, the HTTP status) and what to
do.  Raised by the worker that needed the object, so next() raises them on
the batch that needed it (and at construction, for the listing)."""

from __future__ import annotations


class RemoteError(OSError):
    """Base of every object-store error (loader.RemoteError)."""

    kind = "remote"
    advice = "check the URL, the endpoint and the credentials"

    def __init__(self, what: str, *, url: str = "", endpoint: str = "", status: int | None = None):
        where = ", ".join(p for p in (f"url {url}" if url else "",
                                      f"endpoint {endpoint}" if endpoint else "",
                                      f"HTTP {status}" if status is not None else "") if p)
        super().__init__(f"{what}" + (f" ({where})" if where else "") + f": {self.advice}")
        self.url, self.endpoint, self.status = url, endpoint, status

    def __reduce__(self):
        return (_remake, (type(self).__name__, self.args[0], self.url, self.endpoint,
                          self.status))


class ObjectNotFound(RemoteError, FileNotFoundError):
    """The object is not in the store (404): removed after it was listed."""
    kind = "not_found"
    advice = ("it was listed, then removed from the store; it is dropped from the next epoch's "
              "listing")


class ObjectChanged(RemoteError):
    """The object changed after it was listed (its ETag differs; 412)."""
    kind = "changed"
    advice = ("it was replaced in the store after it was listed; the next epoch's listing has "
              "the new version")


class TruncatedObject(RemoteError):
    """The body ended before the object's length, also after retries."""
    kind = "truncated"
    advice = "the connection was cut repeatedly; check the network or the endpoint"


class AccessDenied(RemoteError, PermissionError):
    """The store refused the credentials (401, 403)."""
    kind = "denied"
    advice = ("set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), or pass "
              "storage_options, with read and list access to this bucket")


class EndpointUnreachable(RemoteError, ConnectionError):
    """No answer from the endpoint before the deadline."""
    kind = "unreachable"
    advice = ("check AWS_ENDPOINT_URL (AWS_ALLOW_HTTP=true for a plain-http endpoint), the "
              "network and the server")


class Throttled(RemoteError):
    """The store kept answering 503 (slow down) after backing off."""
    kind = "throttled"
    advice = "the store is throttling requests: use fewer fetchers or requests in flight"


class CacheFull(RemoteError):
    """The cache's disk is full (ENOSPC) and nothing in the cache can be
    evicted: every object in it is still needed by a live job."""
    kind = "cache_full"
    advice = ("free space on the cache's disk, lower cache_limit_bytes to what the disk holds, "
              "or point cache_dir at a larger disk")


class FetcherDied(RemoteError):
    """The fetcher process ended without being asked to."""
    kind = "fetcher_died"
    advice = "its last words are above; the loader must be made again"


KINDS = {cls.kind: cls for cls in (RemoteError, ObjectNotFound, ObjectChanged, TruncatedObject,
                                   AccessDenied, EndpointUnreachable, Throttled, CacheFull,
                                   FetcherDied)}


def _remake(name: str, text: str, url: str, endpoint: str, status):
    cls = next(c for c in KINDS.values() if c.__name__ == name)
    err = cls.__new__(cls)
    OSError.__init__(err, text)
    err.url, err.endpoint, err.status = url, endpoint, status
    return err
