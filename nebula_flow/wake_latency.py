"""A CPU wake-up latency request (Linux PM QoS) held while a deployment runs.

Every request-round crosses processes four times (client or broker to a worker and back, twice in
pooled mode), and a process that waited a few milliseconds for its next message sleeps on a CPU
that went idle. How long an idle CPU takes to wake is the host's choice: deep C-states on bare
metal, a halted vCPU on a virtual machine. On the 2-core KVM guest the figures in
``docs/benchmarks.md`` come from, a ZeroMQ ping-pong between two processes took 360-375 us after
20 ms idle and 141-205 us with a request of 0 us held (``tools/bench_wakeup.py``; "Idle CPUs and
the emulated overhead"): the idle wake-ups, not the project's code, were most of a round's hops.

Linux lets a process ask for a bound on that latency: write a 32-bit number of microseconds to
``/dev/cpu_dma_latency`` and keep the file open; the kernel keeps idle CPUs in states that wake
within the bound (0: they poll) until the last holder closes it, so a crashed deployment leaves no
setting behind. This is what ``tuned``'s latency-performance profile does (``force_latency``). It
costs power, and on a virtual machine host CPU time, while the deployment idles: it is off unless a
config asks (``cpu_wake_latency_us``), and a host that refuses it (no device, not root) is told in
the log and serves anyway.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from collections.abc import Iterator

log = logging.getLogger("nebula_flow.wake_latency")

PM_QOS_DEVICE = "/dev/cpu_dma_latency"
MAX_US = 2_000_000  # (the kernel's ceiling for this request: PM_QOS_CPU_LATENCY_DEFAULT_VALUE)


def check(us: object) -> int | None:
    """``us`` as a config gives it: None (no request) or whole microseconds in 0..MAX_US."""
    if us is None:
        return None
    if type(us) is not int or not 0 <= us <= MAX_US:
        raise ValueError(f"cpu_wake_latency_us must be a whole number of microseconds in 0..{MAX_US}, got {us!r}")
    return us


def hold(us: int, device: str | None = None) -> int | None:
    """Open ``device`` (default ``PM_QOS_DEVICE``) and ask for ``us``; the open file descriptor
    (the request lasts until it is closed), or None where the host refused (logged with the reason)."""
    device = device or PM_QOS_DEVICE
    try:
        fd = os.open(device, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as exc:
        log.warning("cannot ask for a CPU wake-up latency of %d us (%s: %s): idle CPUs wake as the host decides",
                    us, device, exc.strerror)
        return None
    try:
        os.write(fd, struct.pack("=i", us))
    except OSError as exc:
        os.close(fd)
        log.warning("%s refused a CPU wake-up latency of %d us: %s", device, us, exc.strerror)
        return None
    log.info("holding a CPU wake-up latency request of %d us (%s) while this runs", us, device)
    return fd


@contextlib.contextmanager
def held(us: int | None, device: str | None = None) -> Iterator[bool]:
    """Hold a request of ``us`` (None: nothing) for the ``with`` block; yields whether it is held."""
    fd = hold(us, device) if us is not None else None
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)
