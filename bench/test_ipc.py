"""W5 and W6 side by side with the peers (pytest-benchmark; not a test of
speed: nothing here asserts a time).

    pytest bench/test_ipc.py --benchmark-group-by=param:workload

prints pytest-benchmark's table and, at the end, msg/s, GB/s and the ratio
of shmq to each peer per workload (bench/conftest.py)."""

import pytest

import ipc
from report import record

W5 = [("W5 64 B", 64, 50_000), ("W5 12 KB", 12_000, 20_000), ("W5 1.2 MB", 1_200_000, 600),
      ("W5 16 MB", 16_000_000, 60)]
W6 = [("W6 12 KB x4", 12_000, 20_000), ("W6 1.2 MB x4", 1_200_000, 600)]


def run_rounds(benchmark, transport_cls, nbytes, count, producers):
    rounds = {}

    def setup():
        if "current" in rounds:
            rounds.pop("current").join()
        t = transport_cls()
        t.open(nbytes, producers)
        rounds.setdefault("transports", []).append(t)
        rounds["current"] = ipc.Round(t, nbytes, count, producers)
        return (), {}

    try:
        benchmark.pedantic(lambda: rounds["current"].run(), setup=setup, rounds=5,
                           warmup_rounds=1, iterations=1)
        rounds.pop("current").join()
    finally:
        for t in rounds.get("transports", []):
            t.close()
    return benchmark.stats.stats.median


@pytest.mark.parametrize("transport_cls", ipc.TRANSPORTS, ids=lambda t: t.name)
@pytest.mark.parametrize("workload,nbytes,count", W5, ids=[w[0] for w in W5])
def test_w5_one_producer(benchmark, workload, nbytes, count, transport_cls):
    benchmark.extra_info["workload"] = workload
    seconds = run_rounds(benchmark, transport_cls, nbytes, count, 1)
    record(workload, transport_cls.name, nbytes, count, seconds)


@pytest.mark.parametrize("transport_cls", [t for t in ipc.TRANSPORTS if t.multi_producer],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("workload,nbytes,count", W6, ids=[w[0] for w in W6])
def test_w6_four_producers(benchmark, workload, nbytes, count, transport_cls):
    benchmark.extra_info["workload"] = workload
    seconds = run_rounds(benchmark, transport_cls, nbytes, count, 4)
    record(workload, transport_cls.name, nbytes, count, seconds)


@pytest.mark.parametrize("workload,nbytes,count", W5, ids=[w[0] for w in W5])
def test_copy_limit(benchmark, workload, nbytes, count):
    benchmark.extra_info["workload"] = workload
    benchmark.pedantic(ipc.copy_limit_seconds, args=(nbytes, count), rounds=5, iterations=1)
    record(workload, "np.copyto (copy limit)", nbytes, count, benchmark.stats.stats.median)
