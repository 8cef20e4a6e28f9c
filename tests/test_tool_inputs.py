"""What the tool commands and the config files take is checked before any work, each a one-line
error naming the option or key: `eval-draft --ks 2,x`, `profile --tokens abc` and `--contexts -5`
ended in tracebacks (a ValueError from int(), an IndexError deep in a forward), `--ks 0` printed
`{}`; `--device gpu` and `--device cuda` where torch sees no GPU, `--broker garbage`,
`train-draft` shapes the runtime cannot build, a corpus too small, and config values of the
wrong kind were tracebacks too, or were run."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from nebula_flow.cli import main
from nebula_flow.config import ConfigError, load_config
from nebula_flow.options import check_device
from nebula_flow.shards import addresses

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("args", "option", "said"), [
    (["eval-draft", "--target", "{t}", "--draft", "{d}", "--ks", "2,x"], "--ks", "'2,x' is not comma-separated"),
    (["eval-draft", "--target", "{t}", "--draft", "{d}", "--ks", "0"], "--ks", "integers >= 1"),
    (["eval-draft", "--target", "{t}", "--draft", "{d}", "--target-dtype", "banana"], "--target-dtype",
     "'banana' is not one of auto, float32"),
    (["profile", "--model", "{t}", "--tokens", "abc"], "--tokens", "'abc' is not comma-separated"),
    (["profile", "--model", "{t}", "--contexts", "64,-5"], "--contexts", "integers >= 1"),
    (["profile", "--model", "{t}", "--batches", ""], "--batches", "'' is not comma-separated"),
    (["profile", "--ops", "--device", "emulated"], "--device", "a real model's work: cpu, cuda or cuda:N"),
    (["profile", "--ops", "--device", "cuda:99"], "--device", "sees"),
    (["bench-broker", "--shards", "1,0"], "--shards", "'1,0' is not comma-separated"),
    (["simulate", "configs/sim/paper-2d2t.toml", "--sweep", "--sweep-targets", "1,a"], "--sweep-targets", "'1,a'"),
    (["status", "--broker", "garbage"], "--broker", "'garbage' is not a broker address"),
    (["generate", "--broker", "tcp://127.0.0.1", "hi"], "--broker", "'tcp://127.0.0.1' is not a broker address"),
    (["api", "--broker", "tcp://127.0.0.1:5555,nowhere"], "--broker", "'nowhere' is not a broker address"),
    (["worker", "--role", "target", "--model", "{t}", "--broker", "127.0.0.1:5556"], "--broker", "not a broker"),
])
def test_a_bad_list_device_or_address_is_a_usage_error_naming_its_option(tiny_pair, args: list[str], option: str,
                                                                         said: str) -> None:  # noqa: ANN001
    args = [a.format(t=tiny_pair / "target", d=tiny_pair / "draft") for a in args]
    started = time.monotonic()
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and option in res.output and said in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)  # (no traceback)
    assert time.monotonic() - started < 10  # (said before any model ran)


def test_a_worker_on_a_device_that_is_not_there_says_so_before_it_connects(tiny_pair) -> None:  # noqa: ANN001
    for device, said in (("gpu", "device must be cpu, cuda, cuda:N or emulated, got 'gpu'"),
                         ("cuda:99", "device cuda:99: torch ")):
        res = CliRunner().invoke(main, ["worker", "--role", "target", "--model", str(tiny_pair / "target"),
                                        "--device", device, "--broker", "tcp://127.0.0.1:9"])
        assert res.exit_code == 1 and said in res.output, res.output
    check_device("cuda:0")  # (the name alone is fine anywhere: a config may be written for another host)
    with pytest.raises(ValueError, match="got 'cuda0'"):
        check_device("cuda0")


def test_a_config_pool_on_an_unknown_device_is_refused_by_name(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "c.toml"
    path.write_text('[draft]\nmodel = "d"\n[target]\nmodel = "t"\ndevice = "gpu"\n')
    with pytest.raises(ConfigError, match=r"\[target\] device must be cpu, cuda, cuda:N or emulated, got 'gpu'"):
        load_config(path).validate()


def test_broker_addresses_take_zeromq_endpoints_only() -> None:
    assert addresses("tcp://10.0.0.2:5555, tcp://[::1]:5556,ipc:///tmp/b") == [
        "tcp://10.0.0.2:5555", "tcp://[::1]:5556", "ipc:///tmp/b"]
    for bad in ("localhost:5555", "tcp://host", "tcp://host:port", "http://127.0.0.1:5555"):
        with pytest.raises(ValueError, match="is not a broker address"):
            addresses(bad)


def test_profile_past_the_models_positions_and_tiny_pair_to_an_unwritable_place_are_one_line(tiny_pair,
                                                                                            tmp_path) -> None:  # noqa: ANN001
    res = CliRunner().invoke(main, ["profile", "--model", str(tiny_pair / "target"), "--contexts", "100000",
                                    "--batches", "1", "--tokens", "1"])
    assert res.exit_code == 1 and "a context of 100000 and 1 new tokens is past the model's" in res.output, res.output
    blocker = tmp_path / "file"
    blocker.write_text("")
    res = CliRunner().invoke(main, ["tiny-pair", str(blocker / "pair")])
    assert res.exit_code == 1 and "Error: cannot write the pair there:" in res.output, res.output


@pytest.mark.parametrize(("args", "said"), [
    (["--kv-heads", "3"], "heads (4) must be a multiple of kv_heads (3)"),
    (["--hidden-size", "36", "--heads", "4"], "hidden_size 36 must split into 4 heads of an even size"),
    (["--hidden-size", "128"], "hidden_size 128 is wider than the target's (64)"),
    (["--hidden-size", "32", "--teacher-dtype", "fp8"], "teacher_dtype must be one of float32, bfloat16, float16"),
    (["--hidden-size", "32", "--seq-len", "5000"], "seq_len 5000 is past the target's 1024 positions"),
    (["--hidden-size", "32", "--max-tokens", "300", "--seq-len", "64"], "training needs 8 or more"),
])
def test_train_draft_refuses_a_shape_it_cannot_build_before_the_teacher_runs(tiny_pair, tmp_path, monkeypatch,
                                                                            args: list[str], said: str) -> None:  # noqa: ANN001
    monkeypatch.setenv("NEBULA_FLOW_CACHE", str(tmp_path / "cache"))
    res = CliRunner().invoke(main, ["train-draft", "--target", str(tiny_pair / "target"), "--out",
                                    str(tmp_path / "out"), "--steps", "1", *args])
    assert res.exit_code == 1 and said in res.output, res.output
    assert not (tmp_path / "cache" / "teacher").exists()  # (nothing was computed)


BASE = '[draft]\nmodel = "d"\n[target]\nmodel = "t"\n'


@pytest.mark.parametrize(("extra", "said"), [
    ('workers = "2"', "[target]: workers must be a whole number, got '2'"),
    ("max_batch = 1.5", "[target]: max_batch must be a whole number, got 1.5"),
    ('max_kv_gb = "big"', "[target]: max_kv_gb must be a number, got 'big'"),
    ("cuda_graphs = 1", "[target]: cuda_graphs must be true or false, got 1"),
    ("name = 5", "[target]: name must be text, got 5"),
    ('devices = ["cuda:0", 1]', "[target]: devices must be a list of text, got ['cuda:0', 1]"),
    ("threads = 0", "[target] workers must be >= 0, max_batch >= 1 and threads >= 1"),
    ('[broker]\nclient_port = "x"', "[broker]: client_port must be a whole number, got 'x'"),
    ('[supervise]\nwindow_s = "long"', "[supervise]: window_s must be a number, got 'long'"),
])
def test_a_deployment_config_value_of_the_wrong_kind_is_refused_by_name(tmp_path, extra: str, said: str) -> None:  # noqa: ANN001
    """`workers = "2"` and `max_kv_gb = "big"` were TypeError tracebacks; `max_batch = 1.5` started a
    deployment whose target the broker then refused; `threads = 0` meant "a share of the cores"."""
    path = tmp_path / "c.toml"
    path.write_text(BASE + extra + "\n")
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_config(path).validate()
    path.write_text(BASE + "workers = 2\nmax_kv_gb = 1\nthreads = 1\n")
    cfg = load_config(path)
    cfg.validate()
    assert (cfg.target.workers, cfg.target.max_kv_gb) == (2, 1)


@pytest.mark.parametrize(("change", "said"), [
    (("workers = 2", 'workers = "2"'), "[draft]: workers and max_batch must be whole numbers >= 1, got '2' and 64"),
    (("max_batch = 16", "max_batch = 1.5"), "got 2 and 1.5"),
    (("requests = 512", 'requests = "lots"'), "[workload]: requests must be a whole number, got 'lots'"),
    (("output_tokens = 128", "output_tokens = 12.5"), "output_tokens must be a whole number, got 12.5"),
    (("prompt_tokens = [96, 144]", 'prompt_tokens = ["a", 96]'), "prompt_tokens must be N or [LO, HI]"),
    (("message_latency_us = 50", "message_latency_us = -50"), "[host]: message_latency_us must be >= 0"),
    (("message_latency_us = 50", "bogus = 1"), "[host]: unknown keys ['bogus']"),
    (("seed = 0", 'seed = "x"'), "seed must be a whole number and name text, got 'x'"),
    (('modes = ["pooled", "paired", "colocated", "autoregressive", "elastic"]', 'modes = "pooled"'),
     "modes must be a list"),
    (('movement = "link"', 'movement = "link"\nbandwidth_gbps = "x"'), "[kv]: bandwidth_gbps must be a number > 0"),
    (('movement = "link"', 'movement = "lnk"'), '[kv]: movement must be "link" or "free"'),
    (("movement = ", "moves = "), "[kv]: unknown keys ['moves']"),
    (("draft_workers = [1, 2", 'draft_workers = ["a", 2'), "[sweep]: draft_workers must be a list of whole numbers"),
    (("scale_workload = true", "scale_workoad = true"), "[sweep]: unknown keys ['scale_workoad']"),
    (("rate = 0.75", 'rate = [0.9, "x"]'), "[acceptance]: float() argument"),
])
def test_a_scenario_value_of_the_wrong_kind_is_refused_by_name(tmp_path, change: tuple[str, str], said: str) -> None:  # noqa: ANN001
    """`requests = "lots"` was a TypeError traceback; `max_batch = 1.5` and a negative message
    latency were simulated."""
    from nebula_flow.sim.scenario import load_scenario

    text = (REPO / "configs" / "sim" / "paper-2d2t.toml").read_text()
    assert change[0] in text
    path = tmp_path / "s.toml"
    path.write_text(text.replace(change[0], change[1]))
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_scenario(path)


@pytest.mark.parametrize(("command", "text", "said"), [
    ("worker", '{"role": "target", "broker": "tcp://127.0.0.1:9", "model": 5}', "model must be text, got 5"),
    ("worker", '{"role": "target", "broker": "tcp://127.0.0.1:9", "capacity": "8"}', "capacity must be a whole number"),
    ("broker", '{"client_port": "x"}', "client_port must be a whole number, got 'x'"),
    ("broker", '{"client_port": 5555,', "cannot read BrokerOptions"),
])
def test_an_options_file_of_the_wrong_kinds_is_one_line_naming_the_file(tmp_path, command: str, text: str,
                                                                        said: str) -> None:  # noqa: ANN001
    """`--options FILE` (what `serve` writes; a user may write one): a model of 5 was a TypeError
    from pathlib, a client port of "x" one from a comparison, a capacity of "8" reached the broker."""
    path = tmp_path / "o.json"
    path.write_text(text)
    res = CliRunner().invoke(main, [command, "--options", str(path)])
    assert res.exit_code == 1 and f"Error: cannot read {command.title()}Options from {path}" in res.output, res.output
    assert said in res.output


def test_a_workers_kv_server_listens_where_its_host_reaches_the_broker() -> None:
    """--kv-host used to default to 127.0.0.1 whatever the broker's address: a worker on another host
    advertised a KV endpoint its peers could not reach, and every pull from it failed after seconds
    and was recomputed. Left out, it is the interface that routes to the broker (tests/test_hosts.py
    shows it between network namespaces); 0.0.0.0 binds but is no address to advertise."""
    from nebula_flow.listen import route_to
    from nebula_flow.options import WorkerOptions

    assert route_to(["tcp://127.0.0.1:5556", "ipc:///tmp/x", "tcp://localhost:5558"]) == "127.0.0.1"
    with pytest.raises(ValueError, match=r"cannot tell which interface reaches the broker at tcp://no-such\.invalid:5556: "
                                      r".*; give --kv-host"):
        route_to(["tcp://no-such.invalid:5556"])
    with pytest.raises(ValueError, match="give --kv-host"):  # (IPv6: the KV servers listen on IPv4; or no route there)
        route_to(["tcp://[2001:db8::1]:5556"])
    res = CliRunner().invoke(main, ["worker", "--role", "target", "--model", "x", "--kv-host", "0.0.0.0"])
    assert res.exit_code == 1 and "--kv-host '0.0.0.0' is no address peers can reach" in res.output, res.output
    assert WorkerOptions(role="draft", broker="tcp://127.0.0.1:5556").kv_host is None
