"""How serve shares a host's cores among its workers: each its share (``deploy.default_threads``),
and more while others idle (``nebula_flow.cores``)."""

from __future__ import annotations

import pytest

from nebula_flow.config import DeployConfig, PoolConfig
from nebula_flow.deploy import default_threads


def plan(mode: str, m: int, n: int) -> list:
    return DeployConfig(mode=mode, draft=PoolConfig("/d", m), target=PoolConfig("/t", n)).worker_plan()


def test_the_target_shares_the_cores_and_a_draft_takes_its_share_of_all_workers() -> None:
    bundled = plan("pooled", 1, 1)  # the bundled 1+1 on 2 cores: the target on both, the draft on one
    assert [default_threads(role, bundled, cores=2) for role, _ in bundled] == [1, 2]
    big = plan("pooled", 2, 2)
    assert [default_threads(role, big, cores=16) for role, _ in big] == [4, 4, 8, 8]
    for mode in ("colocated", "autoregressive"):  # every worker runs the target: an equal share
        p = plan(mode, 1, 1)
        assert [default_threads(role, p, cores=2) for role, _ in p] == [1, 1]
    assert default_threads("target", plan("pooled", 1, 4), cores=2) == 1  # (never none)


def test_gpu_workers_get_a_device_each_unless_the_config_shares_one() -> None:
    """``deploy.place_devices``: plain "cuda" gives each worker its own GPU (too few is an error that
    says how to share); a pool's ``devices`` places its workers as listed, round-robin."""
    from nebula_flow.config import ConfigError, DeployConfig, PoolConfig
    from nebula_flow.deploy import place_devices

    def plan(mode: str, draft: PoolConfig, target: PoolConfig) -> list:
        return DeployConfig(mode=mode, draft=draft, target=target).worker_plan()

    two_two = plan("pooled", PoolConfig("d", 2, device="cuda"), PoolConfig("t", 2, device="cuda"))
    assert place_devices(two_two, gpus=4) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    with pytest.raises(ConfigError, match="4 workers want a GPU of their own .* 2 are free of the 2 visible"):
        place_devices(two_two, gpus=2)
    # drafts share GPU 0 (configured); the targets get the GPUs nobody listed
    shared = plan("pooled", PoolConfig("d", 2, device="cuda", devices=["cuda:0"]), PoolConfig("t", 2, device="cuda"))
    assert place_devices(shared, gpus=3) == ["cuda:0", "cuda:0", "cuda:1", "cuda:2"]
    # colocated runs M + N workers on the [target] pool: its list covers them all
    colo = plan("colocated", PoolConfig("d", 1), PoolConfig("t", 2, device="cuda", devices=["cuda:1", "cuda:0", "cuda:1"]))
    assert place_devices(colo, gpus=0) == ["cuda:1", "cuda:0", "cuda:1"]
    assert place_devices(plan("pooled", PoolConfig("d", 1), PoolConfig("t", 1)), gpus=0) == ["cpu", "cpu"]
    bad = DeployConfig(draft=PoolConfig("d", 1), target=PoolConfig("t", 1, device="cuda", devices=["gpu0"]))
    with pytest.raises(ConfigError, match="devices must be a list"):
        bad.validate()


def test_a_worker_borrows_only_the_cores_of_workers_idle_a_while() -> None:
    """``cores.lease_threads``: a peer computing keeps what it uses, a peer idle under the grace
    keeps its share, one idle longer lends it; never below the worker's own share."""
    from nebula_flow.cores import GRACE_S, Peer, lease_threads

    now = 100.0
    long_idle, just_done, busy, busy_wide = Peer(1, 0, 0.0), Peer(1, 0, now - GRACE_S / 2), Peer(1, 1, 0.0), Peer(1, 2, 0.0)
    assert lease_threads(1, 2, [long_idle], now) == 2  # single stream: both cores
    assert lease_threads(1, 2, [just_done], now) == 1  # a worker between batches keeps its core
    assert lease_threads(1, 2, [busy], now) == 1
    assert lease_threads(1, 2, [busy_wide], now) == 1  # (it borrowed ours: we take our share all the same)
    assert lease_threads(2, 8, [long_idle, busy, Peer(2, 0, now)], now) == 5
    assert lease_threads(2, 8, [long_idle] * 3, now, most=2) == 2  # a worker kept to its share


def test_workers_of_one_lease_file_see_each_other(tmp_path) -> None:  # noqa: ANN001
    """``cores.CoreLease`` over a real file: what one worker's forward claims, the other sees; an
    owner whose batch starts while a borrower computes on its share waits out that forward (never
    computes beside it), and the borrower gives the share back at its next forward; a dead
    worker's slot lends everything."""
    import fcntl
    import subprocess
    import sys
    import threading

    import numpy as np

    from nebula_flow.cores import SLOT, CoreLease, make_lease_file

    path = tmp_path / "cores"
    make_lease_file(path, 4)
    set_a, set_b = [], []
    a, b = CoreLease(str(path), 0, 1, 2, set_a.append), CoreLease(str(path), 1, 1, 2, set_b.append)
    events: list[str] = []

    def b_batch() -> None:
        with b.batch():
            events.append("b computes")
            assert b.claim() == 1  # its own share (already 1: not set)

    with a.batch():
        assert a.claim() == 2 and set_a == [2]  # b never computed: a takes both cores
        owner = threading.Thread(target=b_batch)
        owner.start()
        while b.mine["used"][0] == 0:  # (b says it computes, then waits for its share's lock)
            owner.join(0.001)
        assert events == []  # b waits while a's forward runs on b's core
        events.append("a's next forward")
        assert a.claim() == 1 and set_a == [2, 1]  # a gives b's core back; b computes
        owner.join(10)
        assert not owner.is_alive() and events == ["a's next forward", "b computes"]
    assert a.waited_s == 0  # (b's wait, if its thread reached the lock before a gave it back: below)
    assert b.status() == {"threads": 1, "borrowed_forwards": 0, "lease_wait_s": round(b.waited_s, 3), "lease_overruns": 0}
    with b.batch():
        assert b.claim() == 1  # a finished just now: it keeps its core
    assert (a.borrowed, b.borrowed) == (1, 0)
    with a.batch():  # a share whose lock another worker holds is not borrowed, whatever its slot says
        b.mine["released"] = 0.0
        b.mine["used"] = 0
        held = open(f"{path}.1.lock", "a+b")  # noqa: SIM115
        fcntl.flock(held, fcntl.LOCK_EX)
        assert a.claim() == 1
        fcntl.flock(held, fcntl.LOCK_UN)
        assert a.claim() == 2
    # an owner whose share a stuck borrower holds computes beside it after MOST_WAIT_S, counted
    import nebula_flow.cores as cores

    fcntl.flock(held, fcntl.LOCK_EX)
    most, cores.MOST_WAIT_S = cores.MOST_WAIT_S, 0.05
    try:
        with b.batch():
            assert b.claim() == 1 and b.overruns == 1 and b.waited_s >= 0.05
    finally:
        cores.MOST_WAIT_S = most
        fcntl.flock(held, fcntl.LOCK_UN)
    # a third worker that died mid-batch (its slot says computing on both) is not waited for
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    slots = np.memmap(path, dtype=SLOT, mode="r+")
    slots[2] = (dead.pid, 1, 2, 0.0)
    slots.flush()
    c = CoreLease(str(path), 3, 1, 3)
    b.mine["released"] = a.mine["released"] = 0.0  # (both long idle)
    with c.batch():
        assert c.claim() == 3


def test_a_worker_whose_invariant_bits_change_with_threads_keeps_to_its_share(tiny_pair, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """``cores.join_lease`` probes each batch-invariant model (``invariant.same_bits_across_threads``)
    and borrows only where the bits hold at every thread count it could compute on."""
    import torch

    import nebula_flow.models.invariant as invariant
    from nebula_flow.cores import join_lease, make_lease_file
    from nebula_flow.models.loader import load_model

    model = load_model(tiny_pair / "target", dtype="float32", batch_invariant=True)
    threads = torch.get_num_threads()
    try:
        assert invariant.same_bits_across_threads(model, [1, 1])  # (the probe itself: same count, same bits)
        assert torch.get_num_threads() == 1  # (it leaves torch at the last count probed)
    finally:
        torch.set_num_threads(threads)

    class Runner:
        def __init__(self) -> None:
            self.model, self.before_forward = model, None

    make_lease_file(tmp_path / "cores", 2)
    probed_with_every_core: list[bool] = []

    def probe(m, counts, same: bool) -> bool:  # noqa: ANN001
        probed_with_every_core.append(all(not lock_free(tmp_path / f"cores.{i}.lock") for i in range(2)))
        return same

    monkeypatch.setattr("nebula_flow.cores.usable_cores", lambda: 4)
    monkeypatch.setenv("NEBULA_FLOW_PROBE_CACHE", "0")  # (each answer below probed, not remembered)
    for same, most in ((True, 4), (False, 1)):
        monkeypatch.setattr(invariant, "same_bits_across_threads", lambda m, counts, same=same: probe(m, counts, same))
        runner = Runner()
        lease = join_lease(str(tmp_path / "cores"), 0, 1, [runner], lambda n: None)
        assert lease.most == most and runner.before_forward == lease.claim
    assert probed_with_every_core == [True, True]  # (the probe computes on every core: no one else does meanwhile)
    assert all(lock_free(tmp_path / f"cores.{i}.lock") for i in range(2))
    # kept (``models/probe_cache.py``): the next worker of this model's shape on these kernels probes no more
    monkeypatch.setenv("NEBULA_FLOW_PROBE_CACHE", "1")
    monkeypatch.setenv("NEBULA_FLOW_CACHE", str(tmp_path / "cache"))
    for _ in range(2):
        assert join_lease(str(tmp_path / "cores"), 0, 1, [Runner()], lambda n: None).most == 1
    assert len(probed_with_every_core) == 3


def lock_free(path) -> bool:  # noqa: ANN001
    """Whether no one holds the ``flock`` on ``path`` (tried from a descriptor of its own)."""
    import fcntl

    with open(path, "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def test_start_up_probes_of_workers_starting_together_take_turns_on_every_core(tmp_path) -> None:  # noqa: ANN001
    """``CoreLease.every_core`` (``join_lease``'s probe): it holds every share's lock, so a second
    worker's probe waits for the first instead of both computing on all cores at once, and a worker
    already running borrows nothing meanwhile."""
    import threading

    from nebula_flow.cores import CoreLease, make_lease_file

    path = tmp_path / "cores"
    make_lease_file(path, 3)
    a, b, c = (CoreLease(str(path), i, 1, 3) for i in range(3))
    order: list[str] = []

    def b_probes() -> None:
        with b.every_core():
            order.append("b probes")

    with a.every_core():
        assert not any(lock_free(f"{path}.{i}.lock") for i in range(3)) and a.mine["used"][0] == 3
        second = threading.Thread(target=b_probes)
        second.start()
        assert c.claim() == 1 and not c.held  # (a running worker borrows no share while a probe computes on all)
        order.append("a probed")
    second.join(10)
    assert not second.is_alive() and order == ["a probed", "b probes"]
    assert all(lock_free(f"{path}.{i}.lock") for i in range(3)) and a.mine["used"][0] == b.mine["used"][0] == 0


@pytest.mark.slow
def test_a_single_stream_computes_on_the_cores_the_idle_worker_lends(tiny_pair) -> None:  # noqa: ANN001
    """Real processes: `autoregressive` with `lend_cores` and two CPU target workers and no configured
    thread count (one core each on a 2-core host). One request at a time runs on all cores (the other worker
    lends its core), and greedy output stays HF transformers' own."""
    from nebula_flow.client import Client
    from nebula_flow.cores import usable_cores
    from nebula_flow.deploy import Deployment
    from tests.conftest import deploy_config, hf_greedy

    if usable_cores() < 2:
        pytest.skip("one usable core: nothing to lend")
    cfg = deploy_config(tiny_pair, "autoregressive", 1, 1)
    cfg.draft.threads = cfg.target.threads = None  # (serve's default: a share of the cores)
    cfg.lend_cores = True
    prompts = [[5, 40, 7, 300], [9, 3, 11]]
    with Deployment(cfg) as dep, Client(dep.address) as client:
        outs = [client.generate(token_ids=p, max_new_tokens=24) for p in prompts]
        workers = client.status()["workers"]
    assert [o.token_ids for o in outs] == [hf_greedy(tiny_pair / "target", p, 24) for p in prompts]
    devices = [w["device"] for w in workers if w["device"]]  # (a worker that never computed reports nothing)
    assert devices and all(d["threads"] >= 1 for d in devices)
    assert sum(d["borrowed_forwards"] for d in devices) > 0  # forwards ran on more than one core's share


def test_lending_cores_is_a_deployment_switch_on_by_default(tmp_path) -> None:  # noqa: ANN001
    from nebula_flow.config import ConfigError, load_config

    base = "[draft]\nmodel = 'd'\n[target]\nmodel = 't'\n"
    for text, want in (("", True), ("lend_cores = false\n", False)):
        (tmp_path / "c.toml").write_text(text + base)
        assert load_config(tmp_path / "c.toml").lend_cores is want
    (tmp_path / "c.toml").write_text("lend_cores = 'yes'\n" + base)
    with pytest.raises(ConfigError, match="lend_cores must be true or false"):
        load_config(tmp_path / "c.toml").validate()  # (checked as every deployment starts)
