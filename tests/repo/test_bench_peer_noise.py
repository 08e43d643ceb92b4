"""The headline demo keeps the peers' noise out of its output (issue 29,
item 5): what Grain's worker processes log about JAX's profiler is counted
and left out, and everything else they write still reaches stderr."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench_module(name: str):
    """A module of bench/, loaded by its path: bench/ must not go on sys.path,
    where its conftest.py would shadow the tests' for every process this
    session spawns."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


peer_noise = _bench_module("peer_noise")
PeerStderr, QuietStart = peer_noise.PeerStderr, peer_noise.QuietStart

NOISE = "WARNING:absl:Failed to load jax profiler: No module named 'jax'"


def _child_writes(*lines: str) -> None:
    """A process started now, as a peer's worker is: it inherits fd 2."""
    code = "import sys\nfor line in sys.argv[1:]:\n    print(line, file=sys.stderr)\n"
    subprocess.run([sys.executable, "-c", code, *lines], check=True, timeout=60)


def test_the_peers_noise_is_counted_and_left_out_and_the_rest_kept(capfd):
    caught = PeerStderr()
    with caught.catching():
        _child_writes(NOISE, "a real error of the peer's", NOISE)
    _child_writes("after the block: straight to stderr")
    assert capfd.readouterr().err == "after the block: straight to stderr\n"
    said = caught.report()
    assert capfd.readouterr().err == "a real error of the peer's\n"
    assert said.startswith("(Left out of this output: 2 lines \"WARNING:absl:Failed to load")


def test_nothing_caught_says_nothing(capfd):
    assert PeerStderr().report() is None
    assert capfd.readouterr().err == ""


def test_a_quiet_start_catches_what_the_loaders_processes_write_as_they_start(capfd):
    class Peer:                      # starts a process at its first batch, as Grain does
        def __iter__(self):
            _child_writes(NOISE)
            yield from range(3)

        def close(self):
            return "closed"

    caught = PeerStderr()
    loader = QuietStart(Peer(), caught)
    assert list(loader) == [0, 1, 2] and list(loader) == [0, 1, 2]
    assert loader.close() == "closed"            # the peer's own methods pass through
    assert capfd.readouterr().err == ""
    assert "2 lines" in caught.report()
