"""Broker shards: requests split over several brokers by id, workers serving them all."""

from __future__ import annotations

import asyncio
import threading

import pytest
from click.testing import CliRunner

from nebula_flow.cli import main
from nebula_flow.client import AsyncClient, Completion
from nebula_flow.config import ConfigError, load_config
from nebula_flow.deploy import Deployment, free_ports
from nebula_flow.options import BrokerOptions
from nebula_flow.shards import addresses, merge_states, shard_of
from nebula_flow.supervisor import RestartPolicy
from nebula_flow.tokenizer import TextCodec
from nebula_flow_broker.tokenizing import INLINE_CHARS
from tests.conftest import deploy_config, hf_greedy

PROMPTS = [[3 + i, 4 + 2 * i, 5] for i in range(6)]
IDS = [f"shard-test-{i}" for i in range(6)]
SAMPLED_IDS = [f"sampled-{i}" for i in range(6)]  # (an id is its first client's: a second gets its own)


def test_both_shards_own_some_of_the_test_requests() -> None:
    for ids in (IDS, SAMPLED_IDS):  # (else the tests below would prove nothing)
        assert {shard_of(i, 2) for i in ids} == {0, 1}


def test_a_request_id_always_maps_to_the_same_shard_and_ids_spread() -> None:
    ids = [f"req-{i}" for i in range(4000)]
    assert [shard_of(i, 4) for i in ids] == [shard_of(i, 4) for i in ids]
    counts = [sum(shard_of(i, 4) == s for i in ids) for s in range(4)]
    assert all(800 < c < 1200 for c in counts), counts
    assert shard_of("anything", 1) == 0


def test_addresses_are_split_and_checked() -> None:
    assert addresses("tcp://a:1, tcp://b:2") == ["tcp://a:1", "tcp://b:2"]
    with pytest.raises(ValueError, match="named twice"):
        addresses("tcp://a:1,tcp://a:1")
    with pytest.raises(ValueError, match="address is needed"):
        addresses(" , ")
    with pytest.raises(ValueError, match="shard must be 0..1"):
        BrokerOptions(shard=2, shards=2).check()


def test_a_config_sets_the_number_of_shards_not_a_shard(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "c.toml"
    path.write_text('[broker]\nshard = 1\n[draft]\nmodel = "d"\n[target]\nmodel = "t"\n')
    with pytest.raises(ConfigError, match="set shards = N"):
        load_config(path)


def test_merged_status_reads_as_one_broker() -> None:
    def state(shard: int, rounds: int, tasks: int) -> dict:
        return {"shard": shard, "pid": 100 + shard, "pool": 2, "draining": False, "mode": "pooled",
                "counters": {"rounds": rounds, "requests_submitted": 1}, "errors": {"malformed": shard},
                "topics": {"draft": 1, "verify": 0}, "accepted_by_position": [rounds, 1],
                "round_times": {"rounds": {"rounds": rounds, "tokens": 2 * rounds, "seconds": {"total": 0.5}}},
                "workers": [{"name": "draft-0", "tasks": tasks, "batches": {"draft": tasks}},
                            {"name": "target-1", "tasks": tasks, "batches": {"verify": tasks}}],
                "restarts": {"broker": shard, "workers": 1}, "worker_address": f"tcp://h:{6000 + shard}"}

    one = state(0, 5, 3)
    assert merge_states([one]) is one
    merged = merge_states([state(0, 5, 3), state(1, 7, 4)])
    assert merged["counters"] == {"rounds": 12, "requests_submitted": 2}
    assert merged["errors"] == {"malformed": 1} and merged["topics"] == {"draft": 2, "verify": 0}
    assert merged["pool"] == 4 and merged["accepted_by_position"] == [12, 2] and merged["mode"] == "pooled"
    assert merged["round_times"]["rounds"] == {"rounds": 12, "tokens": 24, "seconds": {"total": 1.0}}
    assert [(w["name"], w["tasks"], w["batches"]) for w in merged["workers"]] == [
        ("draft-0", 7, {"draft": 7}), ("target-1", 7, {"verify": 7})]
    assert merged["restarts"] == {"broker": 1, "workers": 1}
    assert merged["worker_address"] == "tcp://h:6000,tcp://h:6001"  # (a worker given it serves every shard)
    assert [(s["shard"], s["pid"], s["rounds"], s["workers"]) for s in merged["by_shard"]] == [(0, 100, 5, 2), (1, 101, 7, 2)]


def _sharded(tiny_pair, shards: int, max_batch: int = 8):  # noqa: ANN001, ANN202
    cfg = deploy_config(tiny_pair, "pooled", 1, 1, max_batch=max_batch)
    cfg.broker.shards = shards
    return cfg


async def _outputs(address: str, ids: list[str], **params) -> list[list[int]]:  # noqa: ANN003
    async with AsyncClient(address, timeout_s=120) as c:
        done = await asyncio.gather(*(c.generate(token_ids=p, request_id=i, **params) for p, i in zip(PROMPTS, ids)))
    return [d.token_ids for d in done]


def test_shards_given_free_ports_each_get_their_own(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """Ports picked one after another can repeat (a closed pick is free again: a CI run once gave two
    shards one client port, and the second shard's readiness check was answered by the first)."""
    dep = Deployment(_sharded(tiny_pair, 4), log_dir=tmp_path)
    ports = [port for o in dep.shards for port in (o.client_port, o.worker_port)]
    assert len(set(ports)) == 8 and addresses(dep.address) == [o.client_address for o in dep.shards]
    moved = free_ports(8, avoid=set(ports))  # (a shard that must move avoids the others' ports)
    assert len(set(moved)) == 8 and not set(moved) & set(ports)


def test_two_shards_are_lossless_and_sampled_output_does_not_depend_on_them(tiny_pair) -> None:  # noqa: ANN001
    sampled = {"max_new_tokens": 16, "temperature": 0.9, "seed": 7}
    with Deployment(_sharded(tiny_pair, 1)) as dep:
        one_shard = asyncio.run(_outputs(dep.address, SAMPLED_IDS, **sampled))
    # (batches of 2: each shard may send a worker 2 tasks at once, so its batch leaves some for the next)
    with Deployment(_sharded(tiny_pair, 2, max_batch=2)) as dep:
        assert len(dep.address.split(",")) == 2
        greedy = asyncio.run(_outputs(dep.address, IDS, max_new_tokens=24))
        two_shards = asyncio.run(_outputs(dep.address, SAMPLED_IDS, **sampled))
        from nebula_flow.client import Client

        with Client(dep.address) as c:
            # a prompt long enough to be tokenized off the dispatch thread (broker/tokenizing.py)
            long_text = "return " * (INLINE_CHARS // 6)
            by_text = c.generate(long_text, max_new_tokens=8, ignore_eos=True)
            by_ids = c.generate(token_ids=TextCodec(str(tiny_pair / "target")).encode(long_text), max_new_tokens=8,
                                ignore_eos=True)
            assert by_text.token_ids == by_ids.token_ids and len(by_text.token_ids) == 8
            state = c.status()
        text = CliRunner().invoke(main, ["status", "--broker", dep.address]).output
    assert greedy == [hf_greedy(tiny_pair / "target", p, 24) for p in PROMPTS]
    assert two_shards == one_shard
    # each shard ran its own requests' rounds, on the same two workers
    assert all(s["rounds"] > 0 and s["workers"] == 2 for s in state["by_shard"]), state["by_shard"]
    assert state["counters"]["requests_submitted"] == 2 * len(PROMPTS) + 2 and len(state["workers"]) == 2
    assert "shard 0: pid" in text and "shard 1: pid" in text and text.count("  worker ") == 2, text


def test_a_killed_shard_loses_no_request_of_the_others(tiny_pair) -> None:  # noqa: ANN001
    """kill -9 of one shard mid-run: the other shard's requests run on untouched; the killed one
    is started again and the client library sends its requests again, which complete unchanged."""
    refs = [hf_greedy(tiny_pair / "target", p, 200) for p in PROMPTS]
    cfg = _sharded(tiny_pair, 2)
    cfg.supervise = RestartPolicy(max_restarts=3, backoff_s=0.2)
    with Deployment(cfg) as dep:
        pids = {name: proc.pid for name, proc in dep.procs}
        stop, events = threading.Event(), []
        watcher = threading.Thread(target=dep.watch, args=(stop, events.append))
        watcher.start()
        try:
            async def run() -> list[tuple[Completion, list[int]]]:
                async with AsyncClient(dep.address, timeout_s=120) as c:
                    tokens_from_shard_1 = asyncio.Event()

                    async def one(prompt: list[int], req_id: str) -> tuple[Completion, list[int]]:
                        streamed = []
                        async for item in c.stream(token_ids=prompt, max_new_tokens=200, request_id=req_id):
                            if isinstance(item, Completion):
                                return item, streamed
                            streamed.extend(item.token_ids)
                            if shard_of(req_id, 2) == 1:
                                tokens_from_shard_1.set()
                        raise AssertionError("no result")

                    async def kill() -> None:
                        await tokens_from_shard_1.wait()
                        dep.kill("broker-1")

                    *results, _ = await asyncio.gather(*(one(p, i) for p, i in zip(PROMPTS, IDS)), kill())
                    state = await c.status()
                    assert [s["restarts"] for s in state["by_shard"]] == [0, 1], state["by_shard"]
                    return results

            results = asyncio.run(run())
        finally:
            stop.set()
            watcher.join()
        now = {name: proc.pid for name, proc in dep.procs}
    assert [r[0].token_ids for r in results] == refs and [r[1] for r in results] == refs  # none lost, none twice
    assert now["broker-0"] == pids["broker-0"] and now["broker-1"] != pids["broker-1"]
    assert any("broker-1 was killed by SIGKILL; starting it again" in e for e in events), events


def test_shards_with_curve_keys_behind_the_http_api(tiny_pair, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Every shard takes the deployment's keys; the gateway speaks to all shards, and its /metrics
    carries the broker families summed over them."""
    import time

    import httpx

    from nebula_flow.client import Client
    from nebula_flow.security import generate_keys

    monkeypatch.delenv("NEBULA_FLOW_KEYS", raising=False)
    cfg = _sharded(tiny_pair, 2)
    cfg.broker.keys = str(generate_keys(tmp_path / "keys"))
    with Deployment(cfg) as dep:
        url = dep.start_api("127.0.0.1", 0, model_name="tiny")
        for i in range(8):
            body = {"model": "tiny", "prompt": f"def f{i}(x):", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 6, reply.text
        with Client(dep.address, keys=cfg.broker.keys) as c:
            state = c.status()
        assert len(state["by_shard"]) == 2 and state["counters"]["requests_submitted"] == 8
        deadline, rounds = time.monotonic() + 10, None
        while rounds != state["counters"]["rounds"] and time.monotonic() < deadline:  # (the gateway caches 0.5 s)
            text = httpx.get(url + "/metrics").text
            rounds = next(float(line.split()[1]) for line in text.splitlines() if line.startswith("nebula_rounds_total "))
        assert rounds == state["counters"]["rounds"]


def test_a_workers_registered_model_facts_are_kept_only_where_well_formed() -> None:
    from nebula_flow_broker.stats import served

    facts = {"path": "/m/" + "x" * 500, "device": "cuda:0", "vocab_size": 151936, "max_model_len": True,
             "secret": "no", "device_count": 8}
    assert served(facts) == {"path": ("/m/" + "x" * 500)[:200], "device": "cuda:0", "vocab_size": 151936}
    assert served({"device": 3, "vocab_size": "many"}) == {}


def test_status_text_names_each_shard_and_a_workers_kv_pull_failures_and_skipped_pulls() -> None:
    from nebula_flow.cli.status_text import status_lines

    worker = {"id": 1, "role": "target", "slot": 0, "name": "target-1", "tasks": 9, "busy_s": 1.5, "restarts": 0,
              "kv": {"pulls": 4, "pull_failures": 2}, "batches": {}, "model": {"device": "cuda:1"}}
    state = {"mode": "pooled", "uptime_s": 12, "pool": 3, "topics": {"draft": 1}, "roles": ["target"],
             "workers": [worker, dict(worker, id=2, name="target-2", kv={"pulls": 4}, model={}),
                         dict(worker, id=3, name="target-3", kv={"pulls": 4, "pulls_skipped": 5, "links": {
                             "tcp://10.0.0.2:5000": {"latency_ms": 1.5, "mbit_s": 3.8},
                             "tcp://10.0.0.3:5000": {"latency_ms": 1.25, "mbit_s": None}}})],
             "by_shard": [{"shard": 0, "pid": 10, "pool": 1, "workers": 2, "rounds": 5, "restarts": 0},
                          {"shard": 1, "pid": 11, "pool": 2, "workers": 2, "rounds": 7, "restarts": 1}],
             "counters": {"rounds": 12}, "errors": {}, "restarts": {"broker": 1, "workers": 0}}
    lines = status_lines(state)
    assert "  shard 0: pid 10, 1 in the pool, 2 workers, 5 rounds" in lines
    assert "  shard 1: pid 11, 2 in the pool, 2 workers, 7 rounds, restarts 1" in lines
    workers = [line for line in lines if line.startswith("  worker")]
    assert workers[0].endswith("KV pull failures 2 (recomputed; see its log)") and "KV" not in workers[1]
    assert workers[2].endswith("KV pulls skipped 5 (recomputed: quicker than the link)")
    assert lines[lines.index(workers[2]) + 1] == ("      KV links: tcp://10.0.0.2:5000 3.8 Mbit/s 1.5 ms, "
                                                  "tcp://10.0.0.3:5000 rate not shown yet 1.25 ms")
    assert " on cuda:1 " in workers[0] and " on ? " in workers[1]  # (its device from its registration, or unknown)
    assert lines[-1] == "counters {'rounds': 12}"
    assert lines[0] == "mode pooled, up 12 s, 3 requests in the pool, topics {'draft': 1}"
    # new requests waiting for one computing their prompt's start (wait_for_prefix) are named where there are some
    assert status_lines(dict(state, waiting_for_prefix=2))[0] == ("mode pooled, up 12 s, 3 requests in the pool "
                                                                  "(2 waiting for a shared prompt start), topics {'draft': 1}")
    assert status_lines(dict(state, draining=True))[0] == ("mode pooled, up 12 s, 3 requests in the pool, topics "
                                                           "{'draft': 1}, draining: stopping, refuses new requests "
                                                           "while those in flight finish")


def test_status_text_counts_an_elastic_workers_whole_rounds_and_keeps_its_columns_in_line() -> None:
    """An elastic worker's batches by kind, whole rounds included (it ran 69 rounds and the line
    said "0 draft, 0 verify"); a verifier's numerics do not push its later columns out of line."""
    from nebula_flow.cli.status_text import status_lines

    any_worker = {"id": 1, "role": "any", "slot": 0, "name": "any-0", "tasks": 9, "busy_s": 1.5, "kv": {},
                  "batches": {"round": 69, "target": 2}, "model": {"device": "cpu", "numerics": "float32 on cpu"}}
    state = {"mode": "elastic", "uptime_s": 12, "pool": 0, "topics": {}, "roles": ["any"], "counters": {}, "errors": {},
             "workers": [any_worker, dict(any_worker, id=2, role="draft", name="draft-1", model={"device": "cpu"})]}
    workers = [line for line in status_lines(state) if line.startswith("  worker")]
    assert "(batches: 69 round, 0 draft, 2 verify)" in workers[0]
    assert " on cpu (float32) tasks" in workers[0] and " on cpu           tasks" in workers[1]
    with_ahead = dict(state, workers=[dict(any_worker, batches={"round": 1, "ahead": 4})])
    assert "(batches: 1 round, 0 draft, 0 verify, 4 pre-draft)" in status_lines(with_ahead)[-2]


def test_requests_sharing_a_prompt_cache_key_go_to_one_shard_where_a_chats_next_turn_finds_its_kv(tiny_pair) -> None:  # noqa: ANN001
    """OpenAI's ``prompt_cache_key``: requests that share one go to the shard it hashes to, whatever
    their ids (the client library, and the real ``openai`` client through the HTTP API), so a chat's
    next turn is placed by the shard that placed its last turn, and starts from that turn's KV."""
    import openai

    from nebula_flow.client import Client

    key, ids = "chat-a", ["turn-1", "turn-3", "turn-4"]
    mine = shard_of(key, 2)
    turn1 = [(13 * j) % 400 + 20 for j in range(120)]
    with Deployment(_sharded(tiny_pair, 2)) as dep:
        with Client(dep.address) as c:
            first = c.generate(token_ids=turn1, max_new_tokens=8, ignore_eos=True, request_id=ids[0],
                               prompt_cache_key=key)
            turn2 = turn1 + first.token_ids + [5, 6, 7]
            nexts = [c.generate(token_ids=turn2, max_new_tokens=8, ignore_eos=True, request_id=i, prompt_cache_key=key)
                     for i in ids[1:]]
            with pytest.raises(ValueError, match="prompt_cache_key must be a string"):
                c.generate(token_ids=turn1, max_new_tokens=2, prompt_cache_key=7)
            by_client = c.status()["by_shard"]
        url = dep.start_api("127.0.0.1", 0, model_name="tiny")
        api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        for i in range(4):
            api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"def f{i}(x):"}],
                                        max_tokens=4, temperature=0, prompt_cache_key=key, safety_identifier="u-1")
        with pytest.raises(openai.BadRequestError, match="prompt_cache_key must be a string"):
            api.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"prompt_cache_key": 7})
        with Client(dep.address) as c:
            by_api = c.status()["by_shard"]
    assert {shard_of(i, 2) for i in ids} == {0, 1}  # (by id they would have gone to both shards)
    assert by_client[mine]["rounds"] > 0 and by_client[1 - mine]["rounds"] == 0, by_client
    assert by_api[1 - mine]["rounds"] == 0 and by_api[mine]["rounds"] > by_client[mine]["rounds"], by_api
    for done in nexts:  # (placed where turn 1's KV is, and started from it)
        assert done.stats["cached_tokens"] >= len(turn1) + len(first.token_ids) - 1, done.stats
        assert done.token_ids == hf_greedy(tiny_pair / "target", turn2, 8)


def test_a_responses_conversation_stays_on_the_shard_of_its_first_turn(tiny_pair) -> None:  # noqa: ANN001
    """A Responses API conversation chained by previous_response_id, without a prompt_cache_key: the
    gateway routes each turn as the first turn ran (its request id as the key), so one shard places
    them all and each starts from the turn before it."""
    import openai

    from nebula_flow.client import Client

    with Deployment(_sharded(tiny_pair, 2)) as dep:
        url = dep.start_api("127.0.0.1", 0, model_name="tiny")
        api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        turn = api.responses.create(model="tiny", input="def fibonacci(n):", max_output_tokens=6, temperature=0)
        cached = []
        for question in ("and the next one?", "now in C", "add a test", "in Rust", "shorter", "explain it"):
            turn = api.responses.create(model="tiny", input=question, previous_response_id=turn.id,
                                        max_output_tokens=6, temperature=0)
            cached.append(turn.usage.input_tokens_details.cached_tokens)
        with Client(dep.address) as c:
            rounds = [s["rounds"] for s in c.status()["by_shard"]]
    assert sorted(rounds)[0] == 0 and sorted(rounds)[1] > 0, rounds  # (all seven turns on one shard; by id: 1 in 64)
    assert all(n > 0 for n in cached), cached
