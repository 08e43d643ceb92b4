"""The object store, as the fetcher sees it: a URL pattern, a client
(obstore: one Rust client for s3://, gs://, az://, http(s)://), listing and
downloading with every failure mapped to a RemoteError subclass.

Only the fetcher process imports this module's client (NOTE [ Remote
data ]): obstore's runtime must never be used in a forked process.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

from loader.datasets.files import _closure, _step
from loader.errors import (AccessDenied, EndpointUnreachable, ObjectChanged, ObjectNotFound,
                           RemoteError, Throttled, TruncatedObject)

SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss", "http", "https")
_WILD = re.compile(r"[*?\[]")


class StorePattern(NamedTuple):
    """s3://bucket/sims/**/*.npy as: root "s3://bucket", prefix "sims/"
    (what is listed), parts ["**", "*.npy"] (what keys must match after it)."""
    url: str
    root: str
    prefix: str
    parts: tuple


def is_remote(pattern) -> bool:
    return isinstance(pattern, str) and pattern.split("://", 1)[0].lower() in SCHEMES and \
        "://" in pattern


def parse(url: str) -> StorePattern:
    scheme, rest = url.split("://", 1)
    if scheme.lower() in ("http", "https"):
        host, _, path = rest.partition("/")
        root, keys = f"{scheme}://{host}", path
    elif scheme.lower() in ("az", "abfs", "abfss"):
        account, _, path = rest.partition("/")
        container, _, keys = path.partition("/")
        root = f"{scheme}://{account}/{container}"
    else:
        bucket, _, keys = rest.partition("/")
        root = f"{scheme}://{bucket}"
    if not root.split("://", 1)[1].strip("/"):
        raise ValueError(f"{url!r}: no bucket (s3://bucket/prefix/**/*.npy)")
    parts = [p for p in keys.split("/") if p]
    fixed = 0
    while fixed < len(parts) - 1 and not _WILD.search(parts[fixed]):
        fixed += 1
    if parts and not _WILD.search(parts[-1]) and fixed == len(parts) - 1:
        fixed = len(parts) - 1  # no wildcard at all: the key itself
    prefix = "/".join(parts[:fixed]) + ("/" if fixed else "")
    return StorePattern(url, root, prefix, tuple(parts[fixed:]))


def matches(pattern: StorePattern, key: str) -> bool:
    """Whether a listed key matches the pattern's parts, as the local glob
    would match a path (`**` any number of directories, names starting
    with '.' only where the pattern says '.')."""
    if not key.startswith(pattern.prefix):
        return False
    parts, states = list(pattern.parts), _closure(list(pattern.parts), {0})
    for name in key[len(pattern.prefix):].split("/"):
        states = _step(parts, states, name)
        if not states:
            return False
    return len(parts) in states


def open_store(pattern: StorePattern, storage_options: dict | None, deadline_s: float):
    """An obstore store for the pattern's root.  Configuration comes from the
    standard environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...,
    AWS_ALLOW_HTTP) and storage_options, which override it.  Requests are
    retried with backoff for at most deadline_s (errors that a retry cannot
    cure, 403 and 404, are not retried)."""
    from obstore.store import from_url

    options = dict(storage_options or {})
    client = {k: options.pop(k) for k in list(options) if k in _CLIENT_KEYS}
    client.setdefault("connect_timeout", f"{int(min(deadline_s, 10) * 1000)}ms")
    client.setdefault("timeout", f"{int(deadline_s * 1000)}ms")   # a stalled body too
    # (client options given replace the ones obstore reads from the
    # environment: AWS_ALLOW_HTTP's among them)
    allow_http = os.environ.get("AWS_ALLOW_HTTP", os.environ.get("ALLOW_HTTP", ""))
    client.setdefault("allow_http", allow_http.strip().lower() in ("1", "true", "yes", "on"))
    retry = {"max_retries": 10, "retry_timeout": _timedelta(deadline_s),
             "backoff": {"init_backoff": _timedelta(0.1), "max_backoff": _timedelta(5),
                         "base": 2}}
    return from_url(pattern.root, config=options or None, client_options=client,
                    retry_config=retry)


_CLIENT_KEYS = {"allow_http", "allow_invalid_certificates", "connect_timeout", "timeout",
                "pool_idle_timeout", "pool_max_idle_per_host", "user_agent", "http1_only",
                "http2_only", "proxy_url"}


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def endpoint_of(pattern: StorePattern, storage_options: dict | None) -> str:
    options = storage_options or {}
    for key in ("endpoint", "aws_endpoint", "endpoint_url", "aws_endpoint_url"):
        if options.get(key):
            return str(options[key])
    if pattern.root.startswith(("s3://", "s3a://")):
        return os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT") or \
            "the AWS endpoint of the bucket's region"
    return pattern.root


class Listed(NamedTuple):
    keys: list      # sorted
    sizes: list
    etags: list


def list_objects(store, pattern: StorePattern, endpoint: str) -> Listed:
    """Every object matching the pattern, sorted by key (pages listed in
    turn; a refusal raised as its RemoteError)."""
    import obstore

    found = []
    try:
        for page in obstore.list(store, prefix=pattern.prefix or None, chunk_size=1000):
            for meta in page:
                key = meta["path"]
                if matches(pattern, key):
                    found.append((key, meta["size"], meta.get("e_tag") or meta.get("version")
                                  or str(meta["last_modified"])))
    except Exception as e:
        raise classify(e, f"{pattern.root}/{pattern.prefix}", endpoint, "listing") from e
    found.sort()
    return Listed([k for k, _, _ in found], [s for _, s, _ in found], [t for _, _, t in found])


CHUNK_BYTES = 4 << 20   # what a fetcher thread holds of an object's body at most


def download(store, key: str, etag: str, size: int, path: str, url: str, endpoint: str,
             attempts: int = 3) -> None:
    """Write object `key` (exactly `size` bytes of version `etag`) to the new
    file `path`; raises its RemoteError (the file may then hold a part).
    The ETag is checked by the server (If-Match: a changed object is a 412),
    the length here."""
    import obstore

    for attempt in range(attempts):
        got, disk_error = 0, None   # disk_error: the cache's disk (ENOSPC...), not the store's
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            result = obstore.get(store, key, options={"if_match": etag})
            # An object of one chunk is read whole: streaming it cost twice
            # the time of bytes() (bench/remote.md); larger ones are streamed so
            # that each thread holds at most a chunk
            chunks = [result.bytes()] if size <= CHUNK_BYTES else \
                result.stream(min_chunk_size=CHUNK_BYTES)
            for chunk in chunks:
                disk_error = _write_all(fd, memoryview(chunk))
                if disk_error is not None:
                    break
                got += len(chunk)
        except Exception as e:
            err = classify(e, url, endpoint, "download")
            if isinstance(err, TruncatedObject) and attempt + 1 < attempts:
                continue
            raise err from e
        finally:
            os.close(fd)
        if disk_error is not None:
            raise disk_error   # the fetcher's to handle (it evicts, or lowers the limit)
        if got == size:
            return
        if got > size:
            raise ObjectChanged(f"{url} has {got} bytes where the listing said {size}",
                                url=url, endpoint=endpoint)
        if attempt + 1 == attempts:
            raise TruncatedObject(f"the body of {url} ended after {got} of its {size} bytes, "
                                  f"{attempts} times", url=url, endpoint=endpoint)


def _write_all(fd: int, view: memoryview) -> OSError | None:
    """Write all of view; the OSError of the disk if it failed."""
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as e:
        return e
    return None


_STATUS = re.compile(r"status code: (\d{3})")


def classify(exc: BaseException, url: str, endpoint: str, doing: str) -> RemoteError:
    """The RemoteError for what the client raised."""
    if isinstance(exc, RemoteError):
        return exc
    from obstore import exceptions as oe

    text = str(exc)
    found = _STATUS.search(text)
    status = int(found.group(1)) if found else None
    first = text.split("\n", 1)[0][:300]
    if isinstance(exc, (FileNotFoundError, oe.NotFoundError)) or status == 404:
        return ObjectNotFound(f"{doing} {url}: not found", url=url, endpoint=endpoint, status=404)
    if isinstance(exc, oe.PreconditionError) or status == 412:
        return ObjectChanged(f"{doing} {url}: its ETag is no longer the listed one",
                             url=url, endpoint=endpoint, status=412)
    if isinstance(exc, (oe.PermissionDeniedError, oe.UnauthenticatedError, PermissionError)) \
            or status in (401, 403):
        return AccessDenied(f"{doing} {url}: the store refused the request ({first})",
                            url=url, endpoint=endpoint, status=status)
    if status in (429, 503):
        return Throttled(f"{doing} {url}: still throttled after backing off ({first})",
                         url=url, endpoint=endpoint, status=status)
    lowered = text.lower()
    if "body error" in lowered or "incomplete" in lowered or "decoding response body" in lowered:
        return TruncatedObject(f"{doing} {url}: the body was cut, also when tried again ({first})",
                               url=url, endpoint=endpoint, status=status)
    if isinstance(exc, (ConnectionError, TimeoutError)) or status is None and any(
            w in lowered for w in ("error sending request", "connect", "timed out", "timeout",
                                   "dns", "unreachable", "refused")):
        return EndpointUnreachable(f"{doing} {url}: no answer before the deadline ({first})",
                                   url=url, endpoint=endpoint)
    return RemoteError(f"{doing} {url}: {first}", url=url, endpoint=endpoint, status=status)
