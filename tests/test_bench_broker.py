"""`nebula-flow bench-broker`: a real broker under zero-cost workers, its CPU per request-round."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from nebula_flow.cli import main

pytestmark = pytest.mark.slow


def test_bench_broker_measures_rounds_and_broker_cpu(tiny_pair) -> None:  # noqa: ANN001
    res = CliRunner().invoke(main, ["bench-broker", "--modes", "pooled,autoregressive", "--model",
                                    str(tiny_pair / "target"), "--workers", "2", "--requests", "12", "--concurrency",
                                    "6", "--max-new-tokens", "20", "--k", "3", "--json"])
    assert res.exit_code == 0, res.output
    modes = json.loads(res.output.strip().splitlines()[-1])["modes"]
    pooled, ar = modes["pooled"], modes["autoregressive"]
    # every round of zero-cost workers commits the whole draft and a bonus token (the last round: what is left)
    assert pooled["rounds"] == 12 * 5 and pooled["tokens_per_round"] == 4.0
    assert ar["rounds"] == 12 * 20 and ar["tokens_per_round"] == 1.0
    assert all(0 < m["broker_cpu_us_per_round"] < 100_000 and m["round_rate"] > 0 for m in modes.values())
