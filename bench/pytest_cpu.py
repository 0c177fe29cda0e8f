"""A pytest plugin: the machine's CPU-seconds (all processes, from /proc/stat) around each test, and
its wall time. Meaningful with the tests run one at a time on an otherwise quiet machine (the
suite is CPU-bound on 2 cores: its wall time follows its CPU, not its waits):

    python -m pytest -q -p bench.pytest_cpu -p no:randomly [tests...]

Appends "CPU-s <tab> wall-s <tab> node id" per test to `$PYTEST_CPU_OUT` (default
`pytest-cpu.tsv`) and prints the heaviest 25 at the end.
"""

from __future__ import annotations

import os
import time

import pytest

_OUT = os.environ.get("PYTEST_CPU_OUT", "pytest-cpu.tsv")
_rows: list[tuple[float, float, str]] = []


def _busy_s() -> float:
    """Non-idle CPU-seconds of the whole machine since boot."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _busy_s(), time.monotonic()
    yield
    row = (_busy_s() - cpu, time.monotonic() - wall, item.nodeid)
    _rows.append(row)
    with open(_OUT, "a") as f:
        f.write(f"{row[0]:.1f}\t{row[1]:.1f}\t{row[2]}\n")


def pytest_terminal_summary(terminalreporter):
    if not _rows:
        return
    terminalreporter.section("heaviest tests by CPU-seconds (whole machine)")
    for cpu, wall, nodeid in sorted(_rows, reverse=True)[:25]:
        terminalreporter.write_line(f"{cpu:7.1f} CPU-s {wall:7.1f} s  {nodeid}")
    terminalreporter.write_line(f"{sum(r[0] for r in _rows):7.1f} CPU-s {sum(r[1] for r in _rows):7.1f} s  "
                                f"all {len(_rows)} tests")
