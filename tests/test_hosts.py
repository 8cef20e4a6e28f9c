"""Workers on other hosts: the broker and each worker in a network namespace of its own, joined by
virtual links (a bridge in a namespace of their own, 1 ms of added delay where `tc netem` works),
CURVE keys, a non-loopback broker address, and KV that moves over TCP between the "hosts".
Skipped where network namespaces cannot be made (not root, or a sandbox that forbids them)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nebula_flow.options import BrokerOptions, WorkerOptions, write_options
from nebula_flow.policy import PolicyConfig
from nebula_flow.security import ensure_key, generate_keys
from tests.conftest import hf_greedy

pytestmark = pytest.mark.slow
HOSTS = {"broker": "10.77.0.1", "draft-0": "10.77.0.2", "target-1": "10.77.0.3", "target-2": "10.77.0.4"}


def sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=30)


@pytest.fixture
def hosts():  # noqa: ANN201
    """One namespace per host, and their bridge; removed afterwards."""
    tag = f"nf{os.getpid() % 100000}"
    names = {host: f"{tag}h{i}" for i, host in enumerate(HOSTS)}
    bridge = f"{tag}br"
    if shutil.which("ip") is None or sh("ip", "netns", "add", bridge).returncode != 0:
        pytest.skip("network namespaces are not available here (`ip netns add` needs root and a kernel that allows it)")
    try:
        assert sh("ip", "-n", bridge, "link", "add", "br0", "type", "bridge").returncode == 0
        sh("ip", "-n", bridge, "link", "set", "br0", "up")
        for i, (host, ns) in enumerate(names.items()):
            assert sh("ip", "netns", "add", ns).returncode == 0
            veth = f"p{i}"
            assert sh("ip", "-n", bridge, "link", "add", veth, "type", "veth", "peer", "name", "eth0",
                      "netns", ns).returncode == 0
            sh("ip", "-n", bridge, "link", "set", veth, "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{HOSTS[host]}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay", "1ms")
        yield names
    finally:
        for ns in [*names.values(), bridge]:
            sh("ip", "netns", "del", ns)


CLIENT = """
import json, sys
from nebula_flow.client import Client
prompts = json.loads(sys.argv[2])
with Client(sys.argv[1], timeout_s=120) as c:
    outs = [c.generate(token_ids=p, max_new_tokens=16).token_ids for p in prompts]
    print(json.dumps({"outputs": outs, "state": c.status()}))
"""


def test_workers_on_other_hosts_with_keys_and_kv_over_tcp(hosts, tiny_pair, tmp_path) -> None:  # noqa: ANN001
    keys = generate_keys(tmp_path / "keys")
    for name in ("draft-0", "target-1", "target-2"):
        ensure_key(keys, "worker", name)
    broker = BrokerOptions(mode="pooled", host=HOSTS["broker"], client_port=5555, worker_port=5556,
                           model=str(tiny_pair / "target"), keys=str(keys),
                           policy=PolicyConfig(k=3, migrate=True))  # (migrate: each round's KV moves to another host)
    write_options(broker, tmp_path / "broker.json")
    procs = []

    def start(host: str, args: list[str]) -> None:
        log = open(tmp_path / f"{host}.log", "wb")
        procs.append(subprocess.Popen(["ip", "netns", "exec", hosts[host], sys.executable, "-m", "nebula_flow.cli",
                                       *args], stdout=log, stderr=subprocess.STDOUT,
                                      env=dict(os.environ, OMP_NUM_THREADS="1")))

    try:
        start("broker", ["broker", "--options", str(tmp_path / "broker.json")])
        for name in ("draft-0", "target-1", "target-2"):
            role = name.split("-")[0]
            opts = WorkerOptions(role=role, broker=f"tcp://{HOSTS['broker']}:5556", name=name, capacity=4,
                                 model=str(tiny_pair / role), keys=str(keys), kv_host=HOSTS[name])
            write_options(opts, tmp_path / f"{name}.json")
            start(name, ["worker", "--options", str(tmp_path / f"{name}.json")])
        prompts = [[3, 4, 5, 6], [9, 8, 7], [11, 12, 13, 14, 15]]
        deadline, out = time.monotonic() + 120, None
        while out is None and time.monotonic() < deadline:
            res = subprocess.run(["ip", "netns", "exec", hosts["broker"], sys.executable, "-c", CLIENT,
                                  f"tcp://{HOSTS['broker']}:5555", json.dumps(prompts)], capture_output=True,
                                 text=True, timeout=180, env=dict(os.environ, NEBULA_FLOW_KEYS=str(keys)))
            if res.returncode == 0 and len(json.loads(res.stdout)["state"]["workers"]) == 3:
                out = json.loads(res.stdout)
            else:
                time.sleep(1)
        assert out is not None, "".join(Path(tmp_path / f"{h}.log").read_text()[-1500:] for h in HOSTS)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    assert out["outputs"] == [hf_greedy(tiny_pair / "target", p, 16) for p in prompts]  # lossless
    kv = [w["kv"] for w in out["state"]["workers"] if w["role"] == "target"]
    assert all(k["transport"] == "tcp" for k in kv) and sum(k["bytes_pulled"] for k in kv) > 0  # (ZeroMQ over TCP)
