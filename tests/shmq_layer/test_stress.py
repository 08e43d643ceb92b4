"""R12/R13 race stress.  The default run uses reduced counts; the full
counts of docs/reliability.md run with `-m stress`.  Seeded: the seed is printed
(and shown on failure); set SHMQ_STRESS_SEED to replay one."""

import os
import random

import pytest

import payload
import shmq
from measure import record
from test_multiprocess import drain

SEED = int(os.environ.get("SHMQ_STRESS_SEED", random.randrange(1 << 30)))


def produce_sizes(q, producer, count, max_bytes, seed):
    sizes = payload.sizes(seed * 100 + producer, count, max_bytes)
    for s in range(count):
        q.put(payload.make(producer, s, int(sizes[s])))
    q.close()


@pytest.mark.parametrize("capacity", [4096, 1 << 16, 8 << 20])
@pytest.mark.parametrize("count", [
    pytest.param(20_000, marks=pytest.mark.timeout(180), id="quick"),
    pytest.param(1_000_000, marks=[pytest.mark.stress, pytest.mark.timeout(3600)], id="full"),
])
def test_r12_mpsc_eight_producers_exactly_once_in_order(procs, capacity, count):
    print(f"SHMQ_STRESS_SEED={SEED}")
    max_bytes = min(1 << 20, capacity - 256)  # the largest message that fits the ring
    with shmq.Queue(capacity, multi_producer=True) as q:
        for p in range(8):
            procs.fork(produce_sizes, q, p, count, max_bytes, SEED)
        tally, _ = drain(q, 8, timeout=60)
        assert tally.next_seq == [count] * 8, f"seed {SEED}"
        assert q.stats()["skipped_records"] == 0
    record("R12", f"8 producers x {count:,} messages, {capacity:,} B ring: exactly once, "
           f"per-producer order", count=8 * count, what="messages")


@pytest.mark.parametrize("count", [
    pytest.param(1_000_000, marks=pytest.mark.timeout(180), id="quick"),
    pytest.param(10_000_000, marks=[pytest.mark.stress, pytest.mark.timeout(3600)], id="full"),
])
def test_r13_spsc_constant_wraparound_exactly_once_in_order(procs, count):
    print(f"SHMQ_STRESS_SEED={SEED}")
    with shmq.Queue(4096) as q:  # every ~30 messages wrap the ring
        procs.fork(produce_sizes, q, 0, count, 300, SEED)
        tally, _ = drain(q, 1, timeout=60)
        assert tally.next_seq == [count], f"seed {SEED}"
    record("R13", f"{count:,} messages through a 4 KiB ring: exactly once, in order",
           count=count, what="messages")
