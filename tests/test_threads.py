"""How serve shares a host's cores among its workers (``deploy.default_threads``)."""

from __future__ import annotations

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
    import pytest

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
