"""shmq_ring.h is the authority for the layout: it must compile on its own
(no Python), agree with what the extension was built from, and its
algorithm must survive a multi-threaded race in plain C."""

import json
import os
import shutil
import subprocess

import pytest

from shmq import _core

HERE = os.path.dirname(os.path.abspath(__file__))
SHMQ_DIR = os.path.join(os.path.dirname(HERE), "shmq")
CC = shutil.which("gcc") or shutil.which("cc")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def ring_test(tmp_path_factory):
    assert CC, "a C compiler is needed to build shmq; none found on PATH"
    exe = str(tmp_path_factory.mktemp("c") / "ring_test")
    subprocess.run([CC, "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread",
                    "-I", SHMQ_DIR, os.path.join(HERE, "c", "ring_test.c"), "-o", exe],
                   check=True, capture_output=True, text=True)
    return exe


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
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "1 passed, 0 failed"
