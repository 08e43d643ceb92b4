"""Side-by-side IPC transports for workloads W5 (1 producer) and W6 (4
producers) of docs/benchmarks.md.

Every transport moves the same numpy array from forked producer processes
to the consumer (this process) and is timed the same way: producers are
started first and wait on an event; the clock runs from the event to the
consumer holding the last message.  Used by bench/test_ipc.py
(pytest-benchmark) and bench/demo.py (docs/benchmarks.md, W5).
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import time
from multiprocessing import shared_memory

import numpy as np

import shmq

_fork = mp.get_context("fork")


def message(nbytes: int) -> np.ndarray:
    """The payload: float64 when the size allows it (1.2 MB = (1000, 150))."""
    if nbytes % 8 == 0:
        a = np.arange(nbytes // 8, dtype=np.float64)
        return a.reshape(1000, 150) if a.size == 150_000 else a
    return np.arange(nbytes, dtype=np.uint8)


class Transport:
    """One way of moving arrays between processes.  Subclasses implement
    open/send/receive_all/close; `producers` > 1 only if `multi_producer`."""

    name = "?"
    multi_producer = True

    def open(self, nbytes: int, producers: int) -> None: ...

    def send(self, arr: np.ndarray, count: int) -> None: ...

    def receive_all(self, count: int) -> None: ...

    def finish_producer(self) -> None: ...

    def close(self) -> None: ...


class ShmqCopy(Transport):
    """shmq with get(): the consumer receives an owned copy."""

    name = "shmq get"

    def open(self, nbytes, producers):
        # Room for several messages in flight so neither side waits on the other.
        self.q = shmq.Queue(max(RING_FOOTPRINT_BYTES, 8 * (nbytes + 4096)),
                            multi_producer=producers > 1)

    def send(self, arr, count):
        put = self.q.put
        for _ in range(count):
            put(arr)

    def finish_producer(self):
        self.q.close()

    def receive_all(self, count):
        get = self.q.get
        for _ in range(count):
            get()

    def close(self):
        self.q.close()


class ShmqSmallRing(ShmqCopy):
    """shmq get() with an 8 MiB ring, which stays in this machine's L3: the
    consumer then reads what the producer just wrote from cache.  Shows what
    the ring size costs; the default is 64 MiB."""

    name = "shmq get, 8 MiB ring"

    def open(self, nbytes, producers):
        self.q = shmq.Queue(max(8 << 20, 2 * (nbytes + 4096)), multi_producer=producers > 1)


class ShmqView(ShmqCopy):
    """shmq with get_view(): the consumer reads the ring in place."""

    name = "shmq get_view"

    def receive_all(self, count):
        view = self.q.get_view
        for _ in range(count):
            with view():
                pass


class MpQueue(Transport):
    name = "multiprocessing.Queue"

    def open(self, nbytes, producers):
        self.q = _fork.Queue()

    def send(self, arr, count):
        for _ in range(count):
            self.q.put(arr)

    def finish_producer(self):
        self.q.close()
        self.q.join_thread()

    def receive_all(self, count):
        for _ in range(count):
            self.q.get()

    def close(self):
        self.q.close()
        self.q.join_thread()


class FasterFifo(Transport):
    name = "faster-fifo"

    def open(self, nbytes, producers):
        import faster_fifo

        self.q = faster_fifo.Queue(max_size_bytes=max(1 << 20, 4 * (nbytes + 4096)))

    def send(self, arr, count):
        for _ in range(count):
            self.q.put(arr, timeout=60)

    def receive_all(self, count):
        for _ in range(count):
            self.q.get(timeout=60)

    def close(self):
        self.q.close()


class PickleSharedMemory(Transport):
    """Pickle each array into slots of one multiprocessing.shared_memory
    block (the array is pickled in-band, copied in, and unpickled out),
    with semaphores for free/full slots.  Single producer."""

    name = "pickle + shared_memory"
    multi_producer = False
    SLOTS = 4

    def open(self, nbytes, producers):
        self.slot_bytes = len(pickle.dumps(message(nbytes), protocol=5)) + 8
        self.block = shared_memory.SharedMemory(create=True, size=self.SLOTS * self.slot_bytes)
        self.free = _fork.Semaphore(self.SLOTS)
        self.full = _fork.Semaphore(0)

    def send(self, arr, count):
        buf = self.block.buf
        for i in range(count):
            data = pickle.dumps(arr, protocol=5)
            off = (i % self.SLOTS) * self.slot_bytes
            self.free.acquire()
            buf[off:off + 8] = len(data).to_bytes(8, "little")
            buf[off + 8:off + 8 + len(data)] = data
            self.full.release()

    def receive_all(self, count):
        buf = self.block.buf
        for i in range(count):
            off = (i % self.SLOTS) * self.slot_bytes
            self.full.acquire()
            n = int.from_bytes(buf[off:off + 8], "little")
            pickle.loads(buf[off + 8:off + 8 + n])
            self.free.release()

    def finish_producer(self):
        self.block.close()

    def close(self):
        self.block.close()
        self.block.unlink()


TRANSPORTS = [ShmqCopy, ShmqView, ShmqSmallRing, MpQueue, FasterFifo, PickleSharedMemory]


def _producer(transport, go, arr, count):
    go.wait()
    transport.send(arr, count)
    transport.finish_producer()


class Round:
    """Producers forked and waiting; run() times one transfer of `count`
    messages in total."""

    def __init__(self, transport: Transport, nbytes: int, count: int, producers: int):
        self.transport, self.count = transport, count
        self.go = _fork.Event()
        arr = message(nbytes)
        per = [count // producers + (i < count % producers) for i in range(producers)]
        self.children = [_fork.Process(target=_producer, args=(transport, self.go, arr, n))
                         for n in per]
        for c in self.children:
            c.start()

    def run(self) -> float:
        t0 = time.perf_counter()
        self.go.set()
        self.transport.receive_all(self.count)
        return time.perf_counter() - t0

    def join(self):
        for c in self.children:
            c.join(60)
            if c.exitcode is None:
                c.kill()
                c.join()
                raise RuntimeError(f"{self.transport.name}: producer pid {c.pid} hung")
            if c.exitcode != 0:
                raise RuntimeError(f"{self.transport.name}: producer exited with {c.exitcode}")


RING_FOOTPRINT_BYTES = 64 << 20  # shmq's default capacity, used by ShmqCopy


def copy_limit_seconds(nbytes: int, count: int) -> float:
    """np.copyto of the same array into already-touched memory, in process:
    the ceiling for any transport that copies once.  The destinations rotate
    through as much memory as the ring spans, so the copy pays the same
    cache misses (copying into one cache-resident buffer would measure the
    L2 cache, not memory)."""
    src = message(nbytes)
    dst = [np.empty_like(src) for _ in range(max(1, RING_FOOTPRINT_BYTES // max(1, nbytes)))]
    for d in dst:
        np.copyto(d, src)
    t0 = time.perf_counter()
    for i in range(count):
        np.copyto(dst[i % len(dst)], src)
    return time.perf_counter() - t0


def timed(transport_cls, nbytes: int, count: int, producers: int = 1, repeats: int = 3) -> float:
    """Median seconds to move `count` messages, after one warm-up round."""
    times = []
    for i in range(repeats + 1):
        t = transport_cls()
        t.open(nbytes, producers)
        try:
            r = Round(t, nbytes, count, producers)
            elapsed = r.run()
            r.join()
        finally:
            t.close()
        if i:
            times.append(elapsed)
    return float(np.median(times))
