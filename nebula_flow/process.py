"""What a child process of a deployment needs to know about its parent, and what a parent reads of its
children."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

PARENT_ENV = "NEBULA_FLOW_PARENT_PID"
RESTARTS_ENV = "NEBULA_FLOW_RESTARTS"  # how many times the deployment has started this child again


def orphaned() -> bool:
    """True when the process that deployed this one (``NEBULA_FLOW_PARENT_PID``) has died, so
    a broker or worker never outlives a killed ``serve`` / bench / test."""
    parent = os.environ.get(PARENT_ENV)
    return parent is not None and os.getppid() != int(parent)


def restarts() -> int:
    """How many times this process's deployment has restarted it after a death (0: first start);
    the broker's ``status`` reports it for itself and each worker."""
    try:
        return max(0, int(os.environ.get(RESTARTS_ENV, "0")))
    except ValueError:
        return 0


def wake_on_stop_signals(stop: list[int]) -> socket.socket:
    """SIGTERM and SIGINT append to ``stop`` and make the returned socket readable: a poll waiting
    on it returns at once (else stopping waits out the poll's timeout). Read it to empty it."""
    readable, writable = socket.socketpair()
    readable.setblocking(False), writable.setblocking(False)
    signal.set_wakeup_fd(writable.fileno(), warn_on_full_buffer=False)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    _kept.append(writable)  # (closed, it would write nowhere)
    return readable


_kept: list[socket.socket] = []


CPUCLOCK_SCHED = 2  # (Linux: the clock id of a process's CPU time is (~pid << 3) | 2, as clock_getcpuclockid(3) gives)


def cpu_seconds(pid: int) -> float:
    """A process's CPU seconds so far, every thread's (ended ones too), to the nanosecond: its
    CPU-time clock. Where that cannot be read, its user + system time from ``/proc/PID/stat``,
    in 10 ms ticks: a broker that ran ~9 ms over a run could read 0 (a flaky check in CI)."""
    try:
        return time.clock_gettime((~pid << 3) | CPUCLOCK_SCHED)
    except OSError:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
