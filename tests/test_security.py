"""CURVE: off loopback only with keys; without an authorised key nobody connects."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest
import zmq
import zmq.auth
from click.testing import CliRunner

from nebula_flow import protocol
from nebula_flow.cli import main
from nebula_flow.client import Client, RequestError, RequestTimeout
from nebula_flow.deploy import Deployment
from nebula_flow.kv.transport import endpoint_part
from nebula_flow.protocol import KvPull, Register
from nebula_flow.security import (
    CLIENT_KEY_ENV,
    Identity,
    SecurityError,
    add_key,
    generate_keys,
    is_loopback,
    make_client,
    server_key_of,
)
from nebula_flow.supervisor import REFUSED_EXIT
from tests.conftest import deploy_config, gateway_health


def test_loopback_detection() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.3.4.5")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example")


def test_broker_refuses_to_bind_off_loopback_without_keys(tiny_pair) -> None:  # noqa: ANN001
    res = subprocess.run([sys.executable, "-m", "nebula_flow.cli", "broker", "--host", "0.0.0.0", "--client-port", "0",
                          "--worker-port", "0"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "requires CURVE keys" in res.stderr


def _curve_socket(address: str, keys, role: str, name: str, server_key: str | None = None) -> zmq.Socket:  # noqa: ANN001
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        make_client(sock, Identity.load(keys, role, name), server_key)
    sock.connect(address)
    return sock


def _refused(sock: zmq.Socket, msg: protocol.Msg) -> bool:
    """True when ``msg`` gets no answer (a refused CURVE handshake delivers nothing)."""
    sock.send_multipart(protocol.encode(msg))
    answered = sock.poll(1500)
    sock.close()
    return not answered


@pytest.mark.slow
def test_each_socket_accepts_only_its_roles_keys(tiny_pair, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    keys = generate_keys(tmp_path / "keys")
    stranger = generate_keys(tmp_path / "stranger")  # valid keys, but not authorised by this broker
    shutil.copy(keys / "broker.key", stranger / "broker.key")  # it even knows the broker's public key
    monkeypatch.delenv("NEBULA_FLOW_KEYS", raising=False)
    cfg = deploy_config(tiny_pair, "pooled", 1, 1)
    cfg.broker.keys = str(keys)
    cfg.kv_transport = "zmq"
    with Deployment(cfg) as dep:  # each worker joined with a key of its own, made on its first start
        assert sorted(p.name for p in (keys / "authorized" / "workers").iterdir()) == \
            ["draft-0.key", "target-1.key", "worker.key"]
        with Client(dep.address, keys=str(keys)) as c:
            first = c.generate(token_ids=[1, 2], max_new_tokens=5, ignore_eos=True, request_id="req-of-client")
            assert len(first.token_ids) == 5
            state = c.status()
        with Client(dep.address, keys=str(keys)) as c:  # the same key owns the request: it may replay it
            again = c.generate(token_ids=[1, 2], max_new_tokens=5, ignore_eos=True, request_id="req-of-client")
            assert again.token_ids == first.token_ids and c.status()["counters"]["requests_replayed"] == 1
        add_key(keys, "client", "alice")
        monkeypatch.setenv(CLIENT_KEY_ENV, "alice")  # another client's key may not
        with Client(dep.address, keys=str(keys)) as c, pytest.raises(RequestError, match="request_id_taken"):
            c.generate(token_ids=[1, 2], max_new_tokens=5, request_id="req-of-client")
        monkeypatch.delenv(CLIENT_KEY_ENV)
        for folder in (None, str(stranger)):  # no CURVE at all, or an unknown key
            with Client(dep.address, timeout_s=1.5, keys=folder) as c, pytest.raises(RequestTimeout):
                c.generate(token_ids=[1, 2], max_new_tokens=5)
        workers = dep.cfg.broker.worker_address
        # a worker needs a worker key: none, or a client key, cannot register
        assert _refused(_curve_socket(workers, None, "", ""), Register("draft", "intruder", 1, {}))
        assert _refused(_curve_socket(workers, keys, "client", "client"), Register("draft", "intruder", 1, {}))
        # a worker key cannot submit requests on the client socket
        assert _refused(_curve_socket(dep.address, keys, "worker", "worker"), protocol.Status())
        # a KV server reads to worker keys only, and names its key in its endpoint
        kv = next(w["kv_endpoint"] for w in state["workers"] if w["role"] == "target")
        server_key = server_key_of(kv)
        assert server_key == Identity.load(keys, "worker", "target-1").public.decode()
        pull = KvPull(1, [[1, "target", 0, 1]])
        assert _refused(_curve_socket(endpoint_part(kv, "tcp://"), keys, "client", "client", server_key), pull)
        assert not _refused(_curve_socket(endpoint_part(kv, "tcp://"), keys, "worker", "worker", server_key), pull)
        with Client(dep.address, keys=str(keys)) as c:
            assert len(c.status()["workers"]) == 2


@pytest.mark.slow
def test_a_revoked_worker_key_is_dropped_and_refused(tiny_pair, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    keys = generate_keys(tmp_path / "keys")
    monkeypatch.delenv("NEBULA_FLOW_KEYS", raising=False)
    cfg = deploy_config(tiny_pair, "pooled", 2, 1)
    cfg.broker.keys = str(keys)
    cfg.kv_transport = "zmq"
    with Deployment(cfg) as dep:
        revoked_secret = (keys / "workers" / "draft-0.key_secret").read_bytes()
        res = CliRunner().invoke(main, ["keys", str(keys), "revoke", "draft-0"])
        assert res.exit_code == 0 and "revoked worker draft-0" in res.output, res.output
        # the broker drops the registered worker (its tasks go to the others) and tells it to stop
        draft0 = next(p for n, p in dep.procs if n == "draft-0")
        assert draft0.wait(30) == REFUSED_EXIT
        with Client(dep.address, keys=str(keys)) as c:
            state = c.status()
            assert state["counters"]["workers_revoked"] == 1
            assert sorted(w["name"] for w in state["workers"]) == ["draft-1", "target-2"]
            assert len(c.generate(token_ids=[1, 2], max_new_tokens=5, ignore_eos=True).token_ids) == 5
        # and the key no longer connects at all
        old = next((keys / "revoked").glob("*-worker-draft-0")) / "draft-0.key_secret"
        assert old.read_bytes() == revoked_secret
        public, secret = zmq.auth.load_certificate(str(old))
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = zmq.auth.load_certificate(str(keys / "broker.key"))[0]
        sock.connect(dep.cfg.broker.worker_address)
        assert _refused(sock, Register("draft", "draft-0", 1, {}))


def test_keys_cli_adds_and_revokes_and_refuses_bad_names(tmp_path) -> None:  # noqa: ANN001
    folder = tmp_path / "k"
    runner = CliRunner()
    assert runner.invoke(main, ["keys", str(folder)]).exit_code == 0
    broker_key = (folder / "broker.key_secret").read_bytes()
    res = runner.invoke(main, ["keys", str(folder)])  # (again: nothing every peer trusts is replaced, and it says so)
    assert res.exit_code == 0 and res.output.startswith(f"{folder} holds keys already: kept them"), res.output
    assert (folder / "broker.key_secret").read_bytes() == broker_key
    res = runner.invoke(main, ["keys", str(folder), "add-client", "alice"])
    assert res.exit_code == 0 and (folder / "authorized" / "clients" / "alice.key").exists()
    res = runner.invoke(main, ["keys", str(folder), "add-client", "alice"])
    assert res.exit_code != 0 and "exists already" in res.output
    res = runner.invoke(main, ["keys", str(folder), "add-worker", "../evil"])
    assert res.exit_code != 0 and "must be" in res.output
    res = runner.invoke(main, ["keys", str(folder), "revoke", "alice"])
    assert res.exit_code == 0 and not (folder / "authorized" / "clients" / "alice.key").exists()
    res = runner.invoke(main, ["keys", str(folder), "revoke", "alice"])
    assert res.exit_code != 0 and "no authorized key" in res.output
    res = runner.invoke(main, ["keys", str(tmp_path / "nowhere"), "add-worker", "w"])
    assert res.exit_code != 0 and "not a key folder" in res.output
    old = tmp_path / "old"  # the layout before roles: one worker key at the top, accepted everywhere
    old.mkdir()
    for party in ("broker", "worker", "client"):
        zmq.auth.create_certificates(str(old), party)
    with pytest.raises(SecurityError, match="old layout"):
        Identity.load(old, "worker", "draft-0")


def _listening_on(port: int) -> set[str]:
    """The local addresses a TCP socket listens on at ``port`` (from /proc/net/tcp, tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


@pytest.mark.slow
def test_metrics_stay_on_loopback_by_default_and_need_a_token_off_it(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    import urllib.error
    import urllib.request

    from nebula_flow.deploy import free_port

    keys = generate_keys(tmp_path / "keys")
    monkeypatch.delenv("NEBULA_FLOW_KEYS", raising=False)
    base = [sys.executable, "-m", "nebula_flow.cli", "broker", "--client-port", str(free_port()),
            "--worker-port", str(free_port())]
    # off loopback without a token: refused before anything binds
    res = subprocess.run([*base, "--metrics-port", "0", "--metrics-host", "0.0.0.0"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode != 0 and "require a token" in res.stderr
    # a broker bound to every interface (with keys) still serves metrics on loopback only
    port = free_port()
    proc = subprocess.Popen([*base, "--host", "0.0.0.0", "--keys", str(keys), "--metrics-port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _listening_on(port) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _listening_on(port) == {"0100007F"}  # 127.0.0.1 only
    finally:
        proc.terminate()
        proc.wait(30)
    # with a token: a scrape without it gets 401, with it the metrics
    token = tmp_path / "token"
    token.write_text("t0ken-" + "x" * 20 + "\n")
    port = free_port()
    proc = subprocess.Popen([*base, "--metrics-port", str(port), "--metrics-token-file", str(token)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not _listening_on(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port}/metrics"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, timeout=5)
        assert err.value.code == 401
        wrong = urllib.request.Request(url, headers={"Authorization": "Bearer nope"})
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(wrong, timeout=5)
        right = urllib.request.Request(url, headers={"Authorization": "Bearer t0ken-" + "x" * 20})
        assert urllib.request.urlopen(right, timeout=5).status == 200
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.slow
def test_serve_secure_local_puts_curve_on_loopback(tiny_pair, tmp_path, monkeypatch) -> None:  # noqa: ANN001

    monkeypatch.delenv("NEBULA_FLOW_KEYS", raising=False)
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'[draft]\nmodel = "{tiny_pair / "draft"}"\nthreads = 1\n[target]\nmodel = "{tiny_pair / "target"}"\n'
                   'threads = 1\n')
    env = {k: v for k, v in os.environ.items() if k != "NEBULA_FLOW_KEYS"}
    proc = subprocess.Popen([sys.executable, "-m", "nebula_flow.cli", "serve", "--config", str(cfg), "--port",
                             "0", "--log-dir", str(tmp_path / "logs"), "--secure-local"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        address = proc.stdout.readline().strip()
        keys = tmp_path / "logs" / "keys"
        assert address.startswith("tcp://127.0.0.1:") and (keys / "broker.key_secret").exists()
        assert oct(keys.stat().st_mode & 0o777) == "0o700"
        with Client(address, timeout_s=1.5) as c, pytest.raises(RequestTimeout):  # a local user without the keys
            c.status()
        with Client(address, timeout_s=30) as c, pytest.raises(RequestError, match="a broker that uses CURVE keys "
                                                                 r"\(give the client its key folder"):
            c.wait_connected(30)  # (said at the first failed handshake)
        other = tmp_path / "other-keys"
        assert CliRunner().invoke(main, ["keys", str(other)]).exit_code == 0
        with Client(address, timeout_s=30, keys=str(other)) as c, pytest.raises(RequestError, match="a broker whose "
                                                                                "key is not the one in this client's"):
            c.wait_connected(30)
        with Client(address, keys=str(keys)) as c:
            assert len(c.generate(token_ids=[1, 2], max_new_tokens=5, ignore_eos=True).token_ids) == 5
        with gateway_health(address, env) as (port, res):  # a gateway started without the keys says why it is 503
            assert res.status_code == 503 and "a broker that uses CURVE keys" in res.json()["error"]["message"]
            started = time.monotonic()
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 503
            assert time.monotonic() - started < 2
    finally:
        proc.terminate()
        proc.wait(30)
