"""Every process of a deployment runs its ZeroMQ I/O thread on one CPU (``zmq_io_cpu``).

A ZeroMQ message wakes three threads: the sender's I/O thread, the receiver's I/O thread and the
receiving thread. Where those land on different CPUs that were idle, each wake-up goes through an
inter-processor interrupt, and on a virtual machine through the host. With every process's I/O
thread on the same CPU, the hand-over between the two I/O threads of a message is a wake-up on the
CPU that runs them both: on the 2-core KVM guest of ``docs/benchmarks.md`` ("The I/O threads on one
CPU"), a ZeroMQ ping-pong after 20 ms idle with idle CPUs held quick to wake took 143-148 us, and
105-123 us with both processes' I/O threads on CPU 0 (``tools/bench_wakeup.py --idle-ms 20
--wake-latency-us 0 [--io-cpu 0]``); the emulated deployment's hops shortened by ~0.1 ms a round. The I/O threads do little work (they copy messages between
sockets and queues), so they share that CPU with whatever computes there.

Off unless a config asks: the deployment names the CPU in each child's environment (``ENV``) and
each process applies it at start, before its first socket (the setting holds for I/O threads
started after it).
"""

from __future__ import annotations

import logging
import os

import zmq

log = logging.getLogger("nebula_flow.io_threads")

ENV = "NEBULA_FLOW_ZMQ_IO_CPU"


def check(cpu: object) -> int | None:
    """``cpu`` as a config gives it: None (the I/O threads run where the kernel puts them) or a CPU
    this process may run on (``os.sched_getaffinity``)."""
    if cpu is None:
        return None
    usable = sorted(os.sched_getaffinity(0))
    if type(cpu) is not int or cpu not in usable:
        raise ValueError(f"zmq_io_cpu must be one of this host's usable CPUs ({', '.join(map(str, usable))}), got {cpu!r}")
    return cpu


def pin_from_env() -> int | None:
    """Put this process's ZeroMQ I/O thread on the CPU its deployment named (``ENV``), if any: call
    before the process makes its first socket. Returns that CPU."""
    raw = os.environ.get(ENV)
    if not raw:
        return None
    try:
        cpu = check(int(raw))
    except ValueError as exc:  # (a CPU the deployment's host has and this process may not use)
        log.warning("%s=%s: %s; ZeroMQ's I/O thread runs where the kernel puts it", ENV, raw, exc)
        return None
    zmq.Context.instance().set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
    log.info("ZeroMQ's I/O thread runs on CPU %d (zmq_io_cpu)", cpu)
    return cpu
