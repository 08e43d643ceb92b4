"""shmq_ring.h is the authority for the layout: it must compile on its own
(no Python), agree with what the extension was built from, and its
algorithm must survive a multi-threaded race in plain C."""

import json
import os
import random
import shutil
import subprocess

import pytest

from shmq import _core

HERE = os.path.dirname(os.path.abspath(__file__))
SHMQ_DIR = os.path.join(os.path.dirname(os.path.dirname(HERE)), "shmq")
CC = shutil.which("gcc") or shutil.which("cc")

pytestmark = pytest.mark.timeout(120)


def build(tmp_path_factory, name, *flags):
    assert CC, "a C compiler is needed to build shmq; none found on PATH"
    exe = str(tmp_path_factory.mktemp("c") / name)
    subprocess.run([CC, "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-pthread", *flags,
                    "-I", SHMQ_DIR, os.path.join(HERE, "c", "ring_test.c"), "-o", exe],
                   check=True, capture_output=True, text=True)
    return exe


@pytest.fixture(scope="module")
def ring_test(tmp_path_factory):
    return build(tmp_path_factory, "ring_test", "-O2")


@pytest.fixture(scope="module")
def ring_test_tsan(tmp_path_factory):
    # -Wno-tsan: GCC warns that ThreadSanitizer does not model the seq_cst
    # fences of the wake-up protocol; the atomics themselves it checks.
    return build(tmp_path_factory, "ring_test_tsan", "-O1", "-g", "-fsanitize=thread", "-Wno-tsan")


def passed(out) -> int:
    """The count from the last line, "<n> passed, 0 failed"; fails otherwise."""
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.splitlines()[-1]
    n, rest = last.split(" passed, ")
    assert rest == "0 failed", out.stdout
    return int(n)


def test_header_offsets_match_the_extension(ring_test):
    from_c = json.loads(subprocess.run([ring_test, "offsets"], check=True, capture_output=True,
                                       text=True).stdout)
    from_extension = _core.layout_offsets()
    for field, value in from_c.items():
        assert from_extension[field] == value, f"{field}: header {value}, extension {from_extension[field]}"
    # The cache-line separation the header promises.
    assert from_c["tail_pos"] % 64 == 0 and from_c["head_pos"] - from_c["tail_pos"] == 64
    assert from_c["slot_bytes"] == 64


@pytest.mark.parametrize("args", [["spsc", "300000"], ["mpsc", "4", "50000"]])
def test_algorithm_in_plain_c(ring_test, args):
    out = subprocess.run([ring_test, *args], capture_output=True, text=True, timeout=100)
    assert passed(out) == 1


@pytest.mark.parametrize("args", [["spsc", "100000"], ["mpsc", "4", "20000"]])
def test_algorithm_under_thread_sanitizer(ring_test_tsan, args):
    out = subprocess.run([ring_test_tsan, *args], capture_output=True, text=True, timeout=100)
    assert "ThreadSanitizer" not in out.stderr, out.stderr[-4000:]
    assert passed(out) == 1


def test_r24_stale_claim_interleavings(ring_test):
    """NOTE [claim announcement]: a producer announces head, a rival's CAS
    wins it, the first one's CAS fails and it finds the ring full; then the
    winner dies (before or after confirming) while the loser withdraws,
    dies, or is stopped with its stale announcement.  Every case ends
    within seconds: the dead claim is skipped and the loser's record
    arrives, or (two deaths inside the unconfirmed windows, different
    sizes) the loss is reported.  The old protocol waited forever in the
    first four."""
    out = subprocess.run([ring_test, "stale-claim"], capture_output=True, text=True, timeout=100)
    assert passed(out) == 7, out.stdout
    assert out.stdout.count(" ok (") == 7


@pytest.mark.parametrize("producers,count,rounds", [
    pytest.param(4, 2000, 20, id="quick"),
    pytest.param(8, 2000, 300, marks=[pytest.mark.stress, pytest.mark.timeout(1800)], id="full"),
])
def test_r24_mpsc_producers_dying_at_every_step(ring_test, producers, count, rounds):
    """Producer processes SIGKILL themselves at random steps of the claim
    protocol (announced, CAS lost, CAS won, claimed, written): the others'
    records all arrive, in order, and the consumer never waits forever."""
    seed = int(os.environ.get("SHMQ_STRESS_SEED", random.randrange(1 << 30)))
    print(f"SHMQ_STRESS_SEED={seed}")
    out = subprocess.run([ring_test, "mpsc-deaths", str(producers), str(count), str(rounds),
                          str(seed)], capture_output=True, text=True, timeout=1700)
    assert passed(out) == rounds, f"seed {seed}: {out.stdout}{out.stderr}"
    killed = int(out.stdout.split(" producers killed")[0].rsplit(" ", 1)[1])
    assert killed >= rounds * producers // 4, out.stdout  # the deaths really happened
