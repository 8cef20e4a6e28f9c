"""Workers forked from the zygote (spawn.py): real processes that are the deploying process's own
children, with the environment, log and exit status a fresh process would have."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from nebula_flow import spawn
from nebula_flow.client import Client
from nebula_flow.deploy import Deployment
from nebula_flow.process import PARENT_ENV
from tests.conftest import deploy_config, hf_greedy


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", **{PARENT_ENV: str(os.getpid())}, **extra)


def test_a_forked_command_is_our_child_with_its_log_and_exit_status(tmp_path: Path) -> None:
    log = tmp_path / "help.log"
    child = spawn.fork_worker(["worker", "--help"], _env(), log)
    assert isinstance(child, spawn.ForkedChild)
    assert child.wait(60) == 0 and child.returncode == 0
    assert "--role" in log.read_text()  # click's help, written to the log, not to our stdout
    bad = spawn.fork_worker(["worker", "--no-such-option"], _env(), log)
    assert bad.wait(60) == 2  # click's usage error, as `nebula-flow worker --no-such-option` exits
    text = log.read_text()
    assert "--role" in text and "No such option" in text  # appended, the first run's log kept


def test_a_dead_zygote_is_started_again(tmp_path: Path) -> None:
    first = spawn.fork_worker(["worker", "--help"], _env(), tmp_path / "a.log")
    assert first.wait(60) == 0
    assert spawn._zygote is not None
    spawn._zygote.proc.kill()
    spawn._zygote.proc.wait()
    again = spawn.fork_worker(["worker", "--help"], _env(), tmp_path / "b.log")
    assert isinstance(again, spawn.ForkedChild) and again.wait(60) == 0


def test_a_deployments_forked_workers_serve_losslessly_and_die_like_processes(tiny_pair, tmp_path: Path) -> None:  # noqa: ANN001
    cfg = deploy_config(tiny_pair, "pooled", 1, 1)
    with Deployment(cfg, log_dir=tmp_path) as dep:
        workers = {n: p for n, p in dep.procs if n.startswith(("draft", "target"))}
        assert workers and all(isinstance(p, spawn.ForkedChild) for p in workers.values())
        assert all(_parent_of(p.pid) == os.getpid() for p in workers.values())  # ours, not the zygote's
        for p in workers.values():  # ps shows each worker's own command line, not the zygote's
            assert Path(f"/proc/{p.pid}/cmdline").read_bytes().startswith(b"nebula-flow worker --options ")
        with Client(dep.address) as client:
            status = client.status()
            assert {w["name"] for w in status["workers"]} == set(workers)
            for prompt in ([5, 40, 7, 300], [9, 2]):
                out = client.generate(token_ids=prompt, max_new_tokens=20)
                assert out.token_ids == hf_greedy(tiny_pair / "target", prompt, 20)
        assert "registered as worker" in (tmp_path / "draft-0.log").read_text()
        draft = workers["draft-0"]
        draft.send_signal(signal.SIGKILL)
        assert draft.wait(30) == -signal.SIGKILL and draft.poll() == -signal.SIGKILL
