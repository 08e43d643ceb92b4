"""R23: the fuzz tier.  Random and targeted corruption of shmq segments --
header fields, attachment slots, avail tags, record headers, array
metadata, tree pickle streams and buffer tables, random bytes anywhere --
written into stopped segments (then a consumer attaches or inherits a
handle) and into live ones (a consumer and producers at work in forked
processes while this process writes the corruption).

Every run must end with: no signal in any child (exit code 0), no hang
(every get and put has a timeout; each child has a deadline), only typed
shmq errors (shmq.ShmqError subclasses, Empty/Full included), and peak RSS
growth of the consumer below fuzzkit.RSS_BOUND_KIB.  One run in ten is a
control run without corruption: there the messages must arrive exactly.

The default run is reduced (about 20 s); `-m stress` runs the full
counts.  Seeded: the seed is printed, SHMQ_FUZZ_SEED replays it (the
corruptions exactly; live timing is the scheduler's).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time

import pytest

import fuzzkit
import shmq
from measure import record

SEED = int(os.environ.get("SHMQ_FUZZ_SEED", random.randrange(1 << 30)))
CHILD_DEADLINE_S = 20.0
LIVE_SECONDS = 0.25


class Campaign:
    def __init__(self, name):
        self.name = name
        self.runs = self.control_runs = self.corruptions = 0
        self.consumer = {}
        self.producer = {}
        self.max_rss_kib = 0
        self.failures = []

    def add(self, who, report):
        into = self.consumer if who == "consumer" else self.producer
        for k, v in report["outcomes"].items():
            into[k] = into.get(k, 0) + v
        if who == "consumer":
            self.max_rss_kib = max(self.max_rss_kib, report["rss_kib"])

    def fail(self, it, what, done):
        self.failures.append(f"SHMQ_FUZZ_SEED={SEED} {self.name} run {it}: {what}; "
                             f"corruptions: {done}")

    def summary(self):
        return (f"{self.name}: {self.runs} runs ({self.control_runs} control), "
                f"{self.corruptions} corruptions; consumer outcomes {dict(sorted(self.consumer.items()))}; "
                f"producer outcomes {dict(sorted(self.producer.items()))}; "
                f"max consumer RSS growth {self.max_rss_kib} KiB (bound {fuzzkit.RSS_BOUND_KIB}); "
                f"failures {len(self.failures)}")


def collect(campaign, it, who, child, conn, done):
    """The child's report, then its exit: a missing report is a hang, a
    negative exit code a signal."""
    report = conn.recv() if conn.poll(CHILD_DEADLINE_S) else None
    child.join(CHILD_DEADLINE_S)
    if report is None or child.exitcode is None:
        campaign.fail(it, f"{who} hung (no report within {CHILD_DEADLINE_S} s)", done)
        return
    if child.exitcode != 0:
        campaign.fail(it, f"{who} ended with exit code {child.exitcode}"
                          + (" (a signal)" if child.exitcode < 0 else ""), done)
    campaign.add(who, report)
    for f in report["failures"]:
        campaign.fail(it, f"{who}: {f}", done)


def stopped_run(procs, campaign, it):
    rng = random.Random(SEED * 1_000_003 + it)
    capacity = rng.choice([4096, 16384, 65536])
    mpsc = rng.random() < 0.5
    control = rng.random() < 0.1
    with shmq.Queue(capacity, multi_producer=mpsc) as q:
        msgs = []
        for _ in range(rng.randrange(1, 7)):
            m = fuzzkit.message(rng, capacity)
            try:
                q.put(m, timeout=0)
            except shmq.Full:
                break
            msgs.append(m)
        seg = fuzzkit.Segment(q.name, capacity, mpsc)
        done = [] if control else [fuzzkit.corrupt(rng, seg) for _ in range(rng.randrange(1, 4))]
        seg.close()
        campaign.runs += 1
        campaign.control_runs += control
        campaign.corruptions += len(done)
        r, w = mp.Pipe(False)
        child = procs.fork(fuzzkit.consume, q, q.name, rng.random() < 0.5, rng.random() < 0.4,
                           len(msgs) + 2, 5.0, 0.05, msgs if control else None, w)
        collect(campaign, it, "consumer", child, r, done)


def live_run(procs, campaign, it):
    rng = random.Random(SEED * 1_000_003 + it)
    capacity = rng.choice([4096, 16384, 65536])
    mpsc = rng.random() < 0.5
    control = rng.random() < 0.1
    with shmq.Queue(capacity, multi_producer=mpsc) as q:
        cr, cw = mp.Pipe(False)
        consumer = procs.fork(fuzzkit.consume, q, q.name, rng.random() < 0.5, rng.random() < 0.4,
                              100_000, LIVE_SECONDS + 0.3, 0.05, "live" if control else None, cw)
        producers = []
        for p in range(rng.choice([1, 2]) if mpsc else 1):
            pr, pw = mp.Pipe(False)
            producers.append((procs.fork(fuzzkit.produce, q, p, LIVE_SECONDS, capacity,
                                         rng.getrandbits(32), pw), pr))
        seg = fuzzkit.Segment(q.name, capacity, mpsc)
        done = []
        if not control:
            for _ in range(rng.randrange(1, 5)):
                time.sleep(rng.uniform(0, LIVE_SECONDS / 4))  # let the children run between writes
                done.append(fuzzkit.corrupt(rng, seg))
        seg.close()
        campaign.runs += 1
        campaign.control_runs += control
        campaign.corruptions += len(done)
        collect(campaign, it, "consumer", consumer, cr, done)
        for child, conn in producers:
            collect(campaign, it, "producer", child, conn, done)


def campaign_of(procs, kind, runs):
    campaign = Campaign(kind)
    body = stopped_run if kind == "stopped" else live_run
    print(f"SHMQ_FUZZ_SEED={SEED}")
    t0 = time.monotonic()
    for it in range(runs):
        body(procs, campaign, it)
    print(f"{campaign.summary()}; {time.monotonic() - t0:.1f} s")
    assert not campaign.failures, "\n".join(campaign.failures[:8]) + "\n" + campaign.summary()
    assert campaign.corruptions >= runs  # the corruptions really happened
    record("R23" if kind == "live" else "R11",
           f"{runs:,} {kind} segments corrupted: typed shmq errors only, no signal, no hang; "
           f"consumer RSS grew at most {campaign.max_rss_kib} KiB", count=campaign.corruptions, what="corruptions")
    return campaign


@pytest.mark.parametrize("runs", [
    pytest.param(120, marks=pytest.mark.timeout(120), id="quick"),
    pytest.param(4000, marks=[pytest.mark.stress, pytest.mark.timeout(3600)], id="full"),
])
def test_r23_corrupted_stopped_segments(procs, runs):
    campaign_of(procs, "stopped", runs)


@pytest.mark.parametrize("runs", [
    pytest.param(24, marks=pytest.mark.timeout(120), id="quick"),
    pytest.param(800, marks=[pytest.mark.stress, pytest.mark.timeout(3600)], id="full"),
])
def test_r23_corrupted_live_segments(procs, runs):
    campaign_of(procs, "live", runs)
