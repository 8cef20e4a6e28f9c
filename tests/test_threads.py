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
