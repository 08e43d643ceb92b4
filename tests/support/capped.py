"""Programs run under a memory cap, in a fresh interpreter: the scale tier's
billion-sample tests.  RLIMIT_DATA makes an O(n) regression a MemoryError
in the program (its stderr shows where), not a visit from the OOM killer.

    out = run_capped('''
        with ShmLoader(...) as ld:
            ...
        print(json.dumps({...}))
    ''')

The body runs after PREAMBLE, which imports json, os, sys, time and numpy,
sets the cap and defines rss_kb(pid) (a process's resident KiB) and
first_batches(make, count) (a new loader's start: time, batches, growth)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

CAP_BYTES = 3 << 30

PREAMBLE = textwrap.dedent(f"""
    import json, os, resource, sys, time
    import numpy as np
    resource.setrlimit(resource.RLIMIT_DATA, ({CAP_BYTES}, {CAP_BYTES}))

    def rss_kb(pid):
        with open(f"/proc/{{pid}}/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS"))

    def first_batches(make, count):
        # Make a ShmLoader and take its first `count` batches: (seconds to the
        # first, the batches copied, KiB its processes grew by, bytes its
        # run's order file holds).
        base = rss_kb(os.getpid())
        t0 = time.perf_counter()
        with make() as ld:
            it = iter(ld)
            got = [next(it).copy()]
            took = time.perf_counter() - t0
            got += [next(it).copy() for _ in range(count - 1)]
            grown = rss_kb(os.getpid()) - base + sum(rss_kb(p.pid) - base
                                                     for p in ld._session.procs)
            order_fd = ld._session.shared.order_fd(ld._runs.current.id)
            allocated = os.fstat(order_fd).st_blocks * 512
        return took, got, grown, allocated
""")


def run_capped(body: str, timeout: float = 100) -> dict:
    """Run PREAMBLE + body in a fresh interpreter; the JSON object its last
    line of output printed.  A non-zero exit fails with its stderr."""
    out = subprocess.run([sys.executable, "-c", PREAMBLE + textwrap.dedent(body)],
                         capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
