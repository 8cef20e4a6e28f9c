"""Workers on other hosts: the broker and each worker in a network namespace of its own, joined by
virtual links (a bridge in a namespace of their own, 1 ms of added delay where `tc netem` works),
CURVE keys, a non-loopback broker address, and KV that moves over TCP between the "hosts".
Skipped where network namespaces cannot be made (not root, or a sandbox that forbids them).

The target hosts' outgoing links are shaped (`tc tbf`), and the target KV pulls, which all cross
them, are checked against the simulator's link model (``sim.costs.Link``: latency + bytes /
bandwidth), its latency measured on the draft KV pulls, which cross none."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nebula_flow.metrics import render
from nebula_flow.options import BrokerOptions, WorkerOptions, write_options
from nebula_flow.policy import PolicyConfig
from nebula_flow.security import ensure_key, generate_keys
from nebula_flow.sim.costs import Link
from tests.conftest import hf_greedy

pytestmark = pytest.mark.slow
HOSTS = {"broker": "10.77.0.1", "draft-0": "10.77.0.2", "draft-1": "10.77.0.5", "target-1": "10.77.0.3",
         "target-2": "10.77.0.4"}
WORKERS = [host for host in HOSTS if host != "broker"]
# Shaped hosts: with two workers a stage and ``migrate``, each round's KV crosses to the other one, so
# every target pull crosses a shaped link and no draft pull does.
SHAPED = ("target-1", "target-2")
# The shaped rate, bits/s: where every pull is made, a prompt's KV takes about a second; where slow
# pulls are skipped, slow enough that pulling even two positions of the tiny target's KV (2 kB,
# ~17 ms) clearly loses to recomputing them (a forward of a few ms), so each target skips some
# of its rounds' pulls whichever target computed which prompt (at 4 Mbit/s only a prompt's pull,
# which one target may never meet, or a 4-position pull, by a hair, were worth skipping).
ALWAYS_PULL_BITS, SKIP_BITS = 4_000_000, 1_000_000
# What a payload byte costs on the shaped wire: tbf counts whole frames, and a full TCP segment of
# 1,448 payload bytes (timestamps on) is a 1,514-byte Ethernet frame.
FRAME_PER_PAYLOAD = 1514 / 1448


def sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=30)


@pytest.fixture
def hosts(request):  # noqa: ANN001, ANN201
    """One namespace per host, and their bridge; removed afterwards (``request.param``: the
    shaped hosts' rate, bits/s)."""
    shaped_bits = request.param
    tag = f"nf{os.getpid() % 100000}"
    names = {host: f"{tag}h{i}" for i, host in enumerate(HOSTS)}
    bridge = f"{tag}br"
    if shutil.which("ip") is None or sh("ip", "netns", "add", bridge).returncode != 0:
        pytest.skip("network namespaces are not available here (`ip netns add` needs root and a kernel that allows it)")
    shaped = []
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
            # (the delay on the bridge's port: traffic into the host; the shaping on the host's own
            # port: traffic out of it, so both can hold, each as its port's root)
            sh("ip", "netns", "exec", bridge, "tc", "qdisc", "add", "dev", veth, "root", "netem", "delay", "1ms")
            if host in SHAPED:  # (a bucket of 1,600 bytes: a burst of a frame, then the rate)
                shaped.append(sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                                 "rate", f"{shaped_bits}bit", "burst", "1600", "latency", "2s").returncode == 0)
        yield names, all(shaped), shaped_bits
    finally:
        for ns in [*names.values(), bridge]:
            sh("ip", "netns", "del", ns)


CLIENT = """
import json, sys, time
from nebula_flow.client import Client
prompts, workers = json.loads(sys.argv[2]), int(sys.argv[3])
with Client(sys.argv[1], timeout_s=120) as c:
    deadline = time.monotonic() + 120
    while len(c.status()["workers"]) < workers:  # (all registered: each counter below is of this one run)
        assert time.monotonic() < deadline, "the workers did not register"
        time.sleep(0.1)
    t0 = time.perf_counter()
    outs = [c.generate(token_ids=p, max_new_tokens=16).token_ids for p in prompts]
    print(json.dumps({"outputs": outs, "state": c.status(), "elapsed_s": time.perf_counter() - t0}))
"""


@pytest.mark.parametrize(("hosts", "always_pull"), [(ALWAYS_PULL_BITS, True), (SKIP_BITS, False)],
                         ids=["always-pull", "skip-slow-pulls"], indirect=["hosts"])
def test_workers_on_other_hosts_with_keys_and_kv_over_tcp(hosts, tiny_pair, tmp_path, always_pull: bool) -> None:  # noqa: ANN001
    """``always_pull``: every KV pull is made (``--kv-always-pull``), and their times are checked
    against the link model; else the workers recompute where the shaped link is measured slower
    (``kv/link_fit.py``; the tiny target computes a prompt in about a millisecond)."""
    hosts, shaped, shaped_bits = hosts
    keys = generate_keys(tmp_path / "keys")
    for name in WORKERS:
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
        for name in WORKERS:
            role = name.split("-")[0]
            # (the drafts name no kv_host: their KV server listens where their host reaches the broker)
            opts = WorkerOptions(role=role, broker=f"tcp://{HOSTS['broker']}:5556", name=name, capacity=4,
                                 model=str(tiny_pair / role), keys=str(keys), kv_host=HOSTS[name] if role == "target" else None,
                                 kv_skip_slow_pulls=not always_pull)
            write_options(opts, tmp_path / f"{name}.json")
            start(name, ["worker", "--options", str(tmp_path / f"{name}.json")])
        # (prompts of a few hundred tokens: the pull of a prompt's KV takes a second over the shaped
        # link, a round's few positions tens of milliseconds, so the check sees both ends of the model;
        # longer and longer, so a link's rate is measured before it carries a prompt that takes longer
        # than a pull is waited for before (``PULL_TIMEOUT_S``))
        prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((4, 40, 160, 240, 320))]
        res = subprocess.run(["ip", "netns", "exec", hosts["broker"], sys.executable, "-c", CLIENT,
                              f"tcp://{HOSTS['broker']}:5555", json.dumps(prompts), str(len(WORKERS))],
                             capture_output=True, text=True, timeout=300, env=dict(os.environ, NEBULA_FLOW_KEYS=str(keys)))
        assert res.returncode == 0, res.stderr[-1500:] + "".join(Path(tmp_path / f"{h}.log").read_text()[-1500:]
                                                                 for h in HOSTS)
        out = json.loads(res.stdout)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    assert out["outputs"] == [hf_greedy(tiny_pair / "target", p, 16) for p in prompts]  # lossless
    kv = {w["name"]: w["kv"] for w in out["state"]["workers"]}
    assert all(w["kv_endpoint"].startswith(f"tcp://{HOSTS[w['name']]}:") for w in out["state"]["workers"])
    print(f"the client's {len(prompts)} requests, one after another, took {out['elapsed_s']:.3f} s")
    assert all(k["transport"] == "tcp" for k in kv.values()) and all(k["bytes_pulled"] > 0 for k in kv.values())
    if not shaped:
        pytest.skip("lossless over TCP between hosts; the link model is not checked: `tc qdisc ... tbf` is not available")
    assert sum(kv[n]["pull_failures"] for n in kv) == 0
    if not always_pull:  # pulls over the shaped links were measured slower than recomputing: some were not made
        print("pulls made, skipped:", {n: (kv[n]["pulls"], kv[n]["pulls_skipped"]) for n in kv})
        assert all(kv[n]["pulls_skipped"] > 0 for n in SHAPED), {n: kv[n]["pulls_skipped"] for n in kv}
        metrics = render(out["state"])  # (what /metrics serves from this status)
        assert all(f'nebula_kv_pulls_skipped_total{{role="target",worker="{n}"}} {float(kv[n]["pulls_skipped"])}'
                   in metrics for n in SHAPED), metrics
        return
    # The simulator's link model against the pulls that crossed the shaped links (the targets'): its
    # latency is what a pull that crossed none took (the drafts'), its bandwidth the shaped rate's payload.
    def total(names: tuple[str, ...]) -> dict[str, float]:
        return {key: sum(kv[n][key] for n in names) for key in ("transfers", "bytes_pulled", "pull_s")}

    fast, slow = total(("draft-0", "draft-1")), total(SHAPED)
    assert all(kv[n]["pulls_skipped"] == 0 for n in kv)
    link = Link(bandwidth=shaped_bits / 8 / FRAME_PER_PAYLOAD, latency_s=fast["pull_s"] / fast["transfers"])
    predicted = link.transfers_s(slow["transfers"], slow["bytes_pulled"])
    print(f"link model: {slow['transfers']} pulls of {slow['bytes_pulled']} bytes over {shaped_bits / 1e6:g} Mbit/s "
          f"took {slow['pull_s']:.3f} s, predicted {predicted:.3f} s (latency {link.latency_s * 1e3:.2f} ms from "
          f"{fast['transfers']} pulls of {fast['bytes_pulled']} bytes in {fast['pull_s']:.3f} s)")
    assert slow["pull_s"] == pytest.approx(predicted, rel=0.2)
    # and what the workers learned of their links (status): the targets', the shaped rate's payload
    for name in SHAPED:
        rates = [fit["mbit_s"] for fit in kv[name]["links"].values()]
        print(f"{name} measured its links at {rates} Mbit/s")
        assert rates and all(r == pytest.approx(link.bandwidth * 8e-6, rel=0.25) for r in rates)
