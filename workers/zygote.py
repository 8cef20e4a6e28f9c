"""The worker zygote (``nebula-flow worker-zygote``, started by ``nebula_flow/spawn.py``): import
what a worker needs once, then fork a worker for each request read from stdin (one JSON line:
args, env, log, parent), answering its pid.

Each request forks twice: the middle process forks the worker, says its pid and exits, so the
worker is re-parented to the deploying process (a child subreaper) and is its child, not ours."""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time
import traceback

import setproctitle

# What a worker imports (a module missing here the worker imports itself: only slower).
PRELOAD = ("torch", "nebula_flow_workers.worker")
REPARENT_WAIT_S = 5.0


def main() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the deployment decides when we go: stdin's end)
    for line in sys.stdin:
        request = json.loads(line)
        read_pid, write_pid = os.pipe()
        try:
            middle = os.fork()
        except OSError:
            middle = -1
        if middle == 0:
            try:
                os.close(read_pid)
                worker = os.fork()
                if worker == 0:
                    os.close(write_pid)
                    _become_worker(request)  # (never returns)
                os.write(write_pid, f"{worker}\n".encode())
            finally:
                os._exit(0)  # (the middle never returns to this loop, whatever happened)
        os.close(write_pid)
        with os.fdopen(read_pid) as pipe:
            worker_pid = pipe.readline().strip()
        if middle > 0:
            os.waitpid(middle, 0)  # (once the middle is reaped, the worker is the deploying process's child)
        sys.stdout.write(f"{worker_pid or -1}\n")
        sys.stdout.flush()


def _become_worker(request: dict) -> None:
    """In the forked worker: become what ``python -m nebula_flow.cli ARGS`` would be with the
    request's environment, in a session of its own, stdout and stderr into its log."""
    code = 1
    try:
        os.setsid()
        # ps shows our own command line, not the zygote's (before the environment changes: the
        # title takes the memory of the arguments and the environment beside them)
        sys.argv = ["nebula-flow", *request["args"]]
        setproctitle.setproctitle(" ".join(sys.argv))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        sys.stdin = open(0, closefd=False)
        sys.stdout.reconfigure(line_buffering=True, write_through=True)  # (PYTHONUNBUFFERED's effect)
        os.environ.clear()
        os.environ.update(request["env"])
        # A worker checks its parent (process.orphaned): wait until the middle process's exit has
        # handed us to the deploying process.
        deadline = time.monotonic() + REPARENT_WAIT_S
        while os.getppid() != request["parent"] and time.monotonic() < deadline:
            time.sleep(0.0005)
        from nebula_flow.cli import main as cli

        cli(request["args"], prog_name="nebula-flow")
        code = 0
    except SystemExit as exc:  # (as the interpreter exits: an int, None for 0, else printed and 1)
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)
