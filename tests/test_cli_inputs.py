"""Numbers out of range are one clear error from the command that took them, before anything starts:
a port past 65535 was taken modulo 65536 (the HTTP API served on another port than the one
printed), `bench --requests 0` and `--repeats 0` ended in tracebacks, a negative admission limit
was accepted. A broker bound to port 0 logs the ports it got."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from nebula_flow.cli import main
from nebula_flow.client import Client
from nebula_flow.deploy import free_port
from nebula_flow.options import BrokerOptions
from tests.conftest import tiny_config_file


@pytest.mark.parametrize(("args", "option"), [
    (["serve", "--http-port", "99999"], "--http-port"),
    (["serve", "--port", "-1"], "--port"),
    (["api", "--port", "70000"], "--port"),
    (["broker", "--client-port", "99999"], "--client-port"),
    (["broker", "--max-pending", "-1"], "--max-pending"),
    (["broker", "--metrics-port", "70000"], "--metrics-port"),
    (["bench", "--requests", "0"], "--requests"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["bench", "--temperature", "-1"], "--temperature"),
    (["bench-broker", "--workers", "0"], "--workers"),
    (["generate", "--top-p", "0", "hi"], "--top-p"),
    (["generate", "--seed", "-1", "hi"], "--seed"),
    (["worker", "--max-batch", "0"], "--max-batch"),
    (["simulate", "configs/sim/paper-2d2t.toml", "--draft-workers", "0"], "--draft-workers"),
])
def test_a_number_out_of_range_is_a_usage_error_naming_its_option(args: list[str], option: str) -> None:
    started = time.monotonic()
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and f"Invalid value for '{option}'" in res.output, res.output
    assert time.monotonic() - started < 5  # (said before anything started)


def test_broker_options_out_of_range_are_refused_by_name() -> None:
    for settings, message in (({"client_port": 65536}, "client_port must be a port from 0 to 65535"),
                              ({"max_pending": 0}, "max_pending must be >= 1, got 0"),
                              ({"proposal_top_k": 0}, "proposal_top_k must be >= 1"),
                              ({"drain_s": -1.0}, "drain_s must be >= 0")):
        with pytest.raises(ValueError, match=message):
            BrokerOptions(**settings).check()
    BrokerOptions(client_port=0, worker_port=0, metrics_port=0).check()


def test_generate_names_a_parameter_the_broker_would_refuse_before_it_asks_any_broker() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"  # (nobody there: the check comes before the connection's wait)
    started = time.monotonic()
    res = CliRunner().invoke(main, ["generate", "--broker", address, "--max-new-tokens", "4", "--min-tokens", "9", "hi"])
    assert res.exit_code == 1 and time.monotonic() - started < 5, res.output
    assert res.output.strip() == "Error: min_tokens must be an integer from 0 to max_new_tokens, got 9"
    res = CliRunner().invoke(main, ["generate", "--broker", address, "--stop=", "hi"])
    assert res.output.strip() == "Error: stop must be a string or a list of non-empty strings", res.output


def test_a_broker_on_port_zero_says_its_ports_and_a_worker_named_as_a_config_names_it_joins(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """The broker logs the ports it was given; `status` says where workers join; a worker started by
    hand with the model as a config names it (cache:NAME) joins there and serves."""
    log = tmp_path / "broker.log"
    env = dict(os.environ, NEBULA_FLOW_CACHE=str(tiny_pair.parent))
    model = f"cache:{tiny_pair.name}/target"
    with log.open("w") as out:
        broker = subprocess.Popen([sys.executable, "-m", "nebula_flow.cli", "broker", "--client-port", "0",
                                   "--worker-port", "0", "--mode", "autoregressive", "--model", model],
                                  stdout=out, stderr=subprocess.STDOUT, env=env)
    worker = None
    try:
        deadline = time.monotonic() + 30
        while not (found := re.search(r"clients at (tcp://127\.0\.0\.1:(\d+)), workers at (tcp://127\.0\.0\.1:(\d+))",
                                      log.read_text())):
            assert broker.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        address, client_port, worker_address, worker_port = found.groups()
        assert int(client_port) > 0 and int(worker_port) > 0 and client_port != worker_port
        with Client(address, timeout_s=10) as c:  # (the logged address is the broker's)
            state = c.status()
        assert state["worker_address"] == worker_address and state["model"] == model
        res = CliRunner().invoke(main, ["status", "--broker", address])
        assert f"workers join at {worker_address} (nebula-flow worker --broker {worker_address}" in res.output
        worker = subprocess.Popen([sys.executable, "-m", "nebula_flow.cli", "worker", "--role", "target", "--model",
                                   model, "--broker", worker_address, "--name", "by-hand"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
        with Client(address, timeout_s=60) as c:
            out = c.generate(token_ids=[5, 6, 7], max_new_tokens=6, ignore_eos=True)
            assert len(out.token_ids) == 6 and [w["name"] for w in c.status()["workers"]] == ["by-hand"]
    finally:
        for proc in (worker, broker):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)


def test_simulate_given_a_deployment_config_says_what_it_takes_instead() -> None:
    res = CliRunner().invoke(main, ["simulate", "configs/tiny.toml"])
    assert res.exit_code == 1 and res.output.startswith(
        "Error: configs/tiny.toml is a deployment config, not a scenario: simulate takes a scenario"), res.output


def test_the_http_api_with_no_broker_answers_503_saying_why(tmp_path) -> None:  # noqa: ANN001
    import httpx

    broker = f"tcp://127.0.0.1:{free_port()}"  # (nobody there)
    log = tmp_path / "api.log"
    with log.open("w") as out:
        api = subprocess.Popen([sys.executable, "-m", "nebula_flow.cli", "api", "--broker", broker, "--port", "0"],
                               stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not (found := re.search(r"HTTP API on (http://127\.0\.0\.1:\d+)/v1", log.read_text())):
            assert api.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        res = httpx.get(found.group(1) + "/v1/models", timeout=30)
        assert res.status_code == 503 and res.headers["retry-after"] == "5", res.text
        assert res.json()["error"]["message"] == f"the broker at {broker} does not answer: no answer within 5 s"
    finally:
        api.terminate()
        api.wait(timeout=30)


def test_a_log_folder_that_cannot_be_one_is_said_before_anything_starts(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """serve --log-dir naming a file, or a folder under one, was a FileExistsError traceback."""
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'mode = "pooled"\n[draft]\nmodel = "{tiny_pair / "draft"}"\n[target]\nmodel = "{tiny_pair / "target"}"\n')
    (tmp_path / "a-file").write_text("")
    for log_dir, why in ((tmp_path / "a-file", "it is a file, not a folder"), (tmp_path / "a-file" / "logs", "Not a directory")):
        res = CliRunner().invoke(main, ["serve", "--config", str(cfg), "--port", "0", "--log-dir", str(log_dir)])
        assert res.exit_code == 1 and f"Error: cannot keep the logs in {log_dir}: {why}" in res.output, res.output
        assert "starting" not in res.output


def test_max_model_len_bounds_what_a_deployment_serves_and_beyond_the_model_is_refused(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """vLLM's --max-model-len: the broker refuses a request longer than it (too_long; 400 over HTTP),
    /v1/models says it; one beyond the target's own context stops serve at start with why (the
    broker exits 2: restarting it cannot help)."""
    import httpx

    from nebula_flow.client import RequestError
    from nebula_flow.deploy import Deployment
    from tests.conftest import deploy_config

    cfg = deploy_config(tiny_pair, "pooled", 1, 1)
    cfg.broker.max_model_len = 48
    with Deployment(cfg) as dep:
        url = dep.start_api("127.0.0.1", 0)
        assert httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"] == 48
        too_long = httpx.post(url + "/v1/completions", json={"model": cfg.target.model, "prompt": [5] * 8, "max_tokens": 41})
        assert too_long.status_code == 400 and "exceeds the context (48)" in too_long.json()["error"]["message"]
        with Client(dep.address) as c:
            assert len(c.generate(token_ids=[5] * 8, max_new_tokens=40, ignore_eos=True).token_ids) == 40
            with pytest.raises(RequestError) as refused:
                c.generate(token_ids=[5] * 8, max_new_tokens=41)
            assert refused.value.code == "too_long"
    config = tiny_config_file(tiny_pair, tmp_path)
    res = CliRunner().invoke(main, ["serve", "--config", str(config), "--port", "0", "--max-model-len", "2048",
                                    "--log-dir", str(tmp_path / "logs")])
    assert res.exit_code == 1, res.output
    assert "max_model_len 2048 exceeds the model's context (1024 positions" in res.output


@pytest.mark.parametrize(("table", "key", "meant"), [
    ("broker", "max_model_lenght = 64", "max_model_lenght: did you mean max_model_len?"),
    ("target", "max_batchs = 8", "max_batchs: did you mean max_batch?"),
    ("policy", "adaptive_kk = true", "adaptive_kk: did you mean adaptive_k?"),
])
def test_a_misspelled_config_key_is_named_with_the_one_meant(tmp_path, table: str, key: str, meant: str) -> None:  # noqa: ANN001
    from nebula_flow.config import ConfigError, load_config

    path = tmp_path / "cfg.toml"
    path.write_text(f'mode = "pooled"\n[{table}]\n{key}\n')
    with pytest.raises(ConfigError, match=rf"\[{table}\]: unknown (keys|knobs) .* \({re.escape(meant)}\) \(known: "):
        load_config(path)


def test_a_max_model_len_under_two_is_refused() -> None:
    with pytest.raises(ValueError, match="max_model_len must be >= 2, got 1"):
        BrokerOptions(max_model_len=1).check()


def test_bench_unseeded_needs_sampled_requests() -> None:
    res = CliRunner().invoke(main, ["bench", "--unseeded"])
    assert res.exit_code == 2 and "Invalid value for --unseeded: seeds are for sampled requests" in res.output, res.output
