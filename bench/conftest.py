"""pytest-benchmark glue: prints the side-by-side table after the run."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402


def pytest_terminal_summary(terminalreporter):
    if not report.RESULTS:
        return
    terminalreporter.section("shmq vs peers (median of 5 rounds, same run)")
    terminalreporter.write_line(report.machine())
    for line in report.format_table(report.RESULTS):
        terminalreporter.write_line(line)
