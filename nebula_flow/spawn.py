"""How a deployment starts its children: brokers and gateways as fresh processes, workers
forked from a zygote that has already imported torch and the worker code.

A worker's imports take ~3 s of CPU (torch alone ~2.8 s on the CI machine), paid again by every
worker and by every restart of one: on a 2-core host a 2+2 deployment spent ~6 s of its ~8.5 s
start importing. The zygote (``nebula-flow worker-zygote``, workers/zygote.py: one per deploying
process, started with its first worker) imports once; each worker is then a ``fork`` of it that
starts in a fraction of a second. The zygote never computes, so no OpenMP or BLAS pool is busy
when it forks, and never touches CUDA (a forked worker initialises its own device).

While it asks for a worker the deploying process is a child subreaper (Linux ``prctl``) and the
zygote forks twice, so each worker becomes the deploying process's own child: ``ForkedChild``
waits for it, reads its exit status and signals it as ``subprocess.Popen`` does, and a worker
whose deployment dies is orphaned as before. Where the subreaper is unavailable, workers start
as fresh processes."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37
# set by the zygote's child from the request, not inherited from the zygote
_PER_WORKER = {"OMP_NUM_THREADS", "NEBULA_FLOW_RESTARTS"}


class ForkedChild:
    """A worker forked by the zygote (our child through the subreaper), seen through
    ``subprocess.Popen``'s interface."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()  # (two threads reaping one child would lose its status)

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while (code := self.poll()) is None:  # (as Popen.wait with a timeout does: a short backoff)
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(["worker", str(self.pid)], timeout or 0.0)
            delay = min(delay * 2, left, 0.05)
            time.sleep(delay)
        return code

    def _reap(self, flags: int) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, flags)
                except ChildProcessError:  # (reaped elsewhere: its status is gone)
                    self.returncode = 255
                else:
                    if pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Child = subprocess.Popen | ForkedChild  # (what a deployment holds for each of its children)


class _Zygote:
    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "nebula_flow.cli", "worker-zygote"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True)

    def fork(self, request: dict) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()  # (the first waits out the zygote's imports)
        if not line:
            raise OSError(f"the worker zygote exited with code {self.proc.wait()}")
        pid = int(line)
        if pid < 0:
            raise OSError("the worker zygote could not fork")
        return pid


_zygote: _Zygote | None = None
_zygote_lock = threading.Lock()


@contextlib.contextmanager
def _subreaper() -> Iterator[bool]:
    """While inside, this process adopts the orphans of its descendants (Linux); yields whether it
    could. Only for the fork: other orphans go to init as always (nobody here would reap them)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        before = ctypes.c_int(0)
        ok = libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(before), 0, 0, 0) == 0 and \
            libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        yield False
        return
    try:
        yield ok
    finally:
        if ok and not before.value:
            libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def fork_worker(args: list[str], env: dict[str, str], log_path: Path) -> ForkedChild | None:
    """Run ``nebula-flow ARGS`` as ``Popen`` would with ``env`` (a session of its own, stdout and
    stderr appended to ``log_path``), forked from the zygote; None where no zygote can serve (the
    caller then starts a fresh process)."""
    global _zygote
    request = {"args": args, "env": env, "log": str(log_path), "parent": os.getpid()}
    with _zygote_lock, _subreaper() as adopting:
        for _ in range(2 if adopting else 0):  # (a zygote that died is started again, once)
            if _zygote is None or _zygote.proc.poll() is not None:
                # the zygote starts with the workers' environment: what libraries read once at
                # start (glibc's MALLOC_*_ settings) a fork inherits from it
                _zygote = _Zygote({k: v for k, v in env.items() if k not in _PER_WORKER})
            try:
                # (the zygote answers once the worker is re-parented to us: inside the subreaper)
                return ForkedChild(_zygote.fork(request))
            except OSError:
                _zygote = None
    return None
