"""The shape of the code: one owner for each policy default, the core importing no process
package, modules of a readable size, and a broker process that never loads torch."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from nebula_flow import policy_log
from nebula_flow.cli import main
from nebula_flow.client import Client, NebulaError
from nebula_flow.config import DeployConfig, load_config
from nebula_flow.deploy import free_port
from nebula_flow.options import BrokerOptions, read_options, write_options
from nebula_flow.policy import PolicyConfig, knob_names
from nebula_flow.scheduler import Scheduler
from nebula_flow.sim.scenario import load_scenario

REPO = Path(__file__).resolve().parent.parent
SOURCES = [p for folder in ("nebula_flow", "broker", "workers") for p in (REPO / folder).rglob("*.py")]


def test_every_place_that_exposes_a_policy_knob_has_the_same_default(tmp_path) -> None:  # noqa: ANN001
    one = PolicyConfig()
    deploy = tmp_path / "d.toml"
    deploy.write_text('mode = "pooled"\n[draft]\nmodel = "/m/d"\n[target]\nmodel = "/m/t"\n')
    scenario = tmp_path / "s.toml"
    profile = REPO / "configs" / "profiles" / "qwen3-0.6b-rtx4090.json"
    scenario.write_text(f'[draft]\nprofile = "{profile}"\n[target]\nprofile = "{profile}"\n[kv]\nmovement = "free"\n')
    recorder = policy_log.RecordingScheduler("pooled")
    seen = {
        "Scheduler": Scheduler("pooled").policy,
        "BrokerOptions": BrokerOptions().policy,
        "DeployConfig": DeployConfig().broker.policy,
        "deployment TOML": load_config(deploy).broker.policy,
        "scenario TOML": load_scenario(scenario).policy,
        "policy log": policy_log.policy_of(recorder.records).policy,
        "broker command line": _broker_cli_policy(),
    }
    for where, policy in seen.items():
        assert policy == one, f"{where} has other defaults: {policy} != {one}"
    write_options(BrokerOptions(), tmp_path / "b.json")  # what serve hands its broker
    assert read_options(BrokerOptions, tmp_path / "b.json").policy == one


def _broker_cli_policy() -> PolicyConfig:
    """The policy the `broker` command runs with when given no policy option."""
    result = CliRunner().invoke(main, ["broker", "--print-options"])
    assert result.exit_code == 0, result.output
    return BrokerOptions.from_json(json.loads(result.output)).policy


def test_the_core_imports_neither_process_package() -> None:
    bad = []
    for path in (REPO / "nebula_flow").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{path.relative_to(REPO)}: {n}" for n in names
                    if n.split(".")[0] in ("broker", "workers", "nebula_flow_broker", "nebula_flow_workers")]
    assert not bad, bad


def test_process_packages_are_imported_by_their_installed_names() -> None:
    """broker/ and workers/ install as nebula_flow_broker and nebula_flow_workers: nothing imports
    them as generic top-level `broker` / `workers` packages."""
    bad = []
    for path in [*SOURCES, *(REPO / "tests").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in ("broker", "workers")]
    assert not bad, bad


def test_no_module_is_a_big_room() -> None:
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in SOURCES}
    assert max(sizes.values()) <= 500, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]


def test_the_process_commands_plug_into_the_command_line() -> None:
    out = CliRunner().invoke(main, ["--help"]).output
    for command in ("broker", "worker", "train-draft", "eval-draft", "serve", "bench", "simulate"):
        assert re.search(rf"^\s+{command}\s", out, re.M), f"{command} missing from --help"
    help_text = CliRunner().invoke(main, ["broker", "--help"]).output
    for knob in knob_names():  # every knob is an option, with its default shown
        assert f"--{knob.replace('_', '-')}" in help_text


def test_a_running_broker_has_no_torch_loaded(tiny_pair) -> None:  # noqa: ANN001
    """The broker is the one process that must stay light: it reads the target's tokenizer and
    facts, and torch's libraries are not mapped into it."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nebula_flow.cli", "broker", "--client-port", str(port),
                             "--worker-port", str(free_port()), "--model", str(tiny_pair / "target")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout_s=1.0) as client:
            deadline = time.monotonic() + 60
            while True:
                try:
                    state = client.status()
                    break
                except NebulaError:
                    assert proc.poll() is None and time.monotonic() < deadline, "the broker did not start"
        assert state["max_model_len"] > 0  # it did read the target's facts
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libtorch" not in maps and "/torch/" not in maps
        assert "libzmq" in maps or "zmq" in maps  # (the check can see what a process loaded)
    finally:
        proc.terminate()
        proc.wait(30)
