"""The prefix cache: a request starts from the longest prefix of its tokens that another request's
KV on the same worker holds (live, or finished and kept), copied instead of computed.

The copy must be exact (KV at a position depends only on the tokens up to it), so output stays
the target's own greedy output and a seeded sample stays a function of the request, whatever
the placement and whether the cache is on.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from nebula_flow import policy_log
from nebula_flow.client import AsyncClient, Client
from nebula_flow.deploy import Deployment
from nebula_flow.kv.store import KEEP_FINISHED, MIN_SHARED, KVStore
from nebula_flow.models.loader import load_model
from nebula_flow.params import SamplingParams
from nebula_flow.policy import PolicyConfig
from nebula_flow.prefixes import BLOCK, EVERY, PrefixRoutes
from nebula_flow.request import Request
from nebula_flow.scheduler import Scheduler
from tests.conftest import deploy_config, hf_greedy

SHARED = list(range(40, 140))  # a 100-token "system prompt" every request below starts with
MAX_NEW = 12


def test_a_request_copies_another_requests_prefix_and_gets_the_same_logits(tiny_pair) -> None:  # noqa: ANN001
    """Bit-equal logits from a copied prefix and from a prefill of the whole prompt (batch
    invariance on: the claim holds whatever the chunking of the prefill)."""
    model = load_model(tiny_pair / "target", batch_invariant=True)
    first, second = np.array(SHARED + [7, 8, 9]), np.array(SHARED + [300, 301, 302, 303])
    store = KVStore(model, prefix_cache=True)
    cache = store.prepare(1, first)
    model([cache], [first[cache.length:].tolist()], [1])
    copied = store.prepare(2, second)
    assert copied.length == len(SHARED) and copied.tokens == SHARED
    assert (store.stats.prefix_hits, store.stats.prefix_reused) == (1, len(SHARED))
    assert store.stats.computed == (len(first) - 1) + (len(second) - 1 - len(SHARED))
    got = model([copied], [second[copied.length:].tolist()], [4])[0]
    alone = KVStore(model)  # (no prefix cache: the whole prompt computed)
    fresh = alone.prepare(2, second)
    assert fresh.length == 0
    want = model([fresh], [second.tolist()], [4])[0]
    assert torch.equal(got, want)
    assert torch.equal(copied.buf[:len(second)], fresh.buf[:len(second)])


def test_finished_requests_are_kept_for_their_prefixes_and_go_before_live_ones(tiny_pair) -> None:  # noqa: ANN001
    model = load_model(tiny_pair / "target")
    store = KVStore(model, prefix_cache=True)
    done = store.prepare(1, np.array(SHARED + [5]))
    model([done], [SHARED], [1])
    store.free([1])
    assert 1 not in store.caches and len(store.finished) == 1
    turn2 = np.array(SHARED + [5, 6, 7])  # (a chat's next turn: the last one's tokens, then more)
    assert store.prepare(2, turn2).length == len(SHARED)
    # too short a shared prefix is not worth it, and a request's own KV is not counted twice
    assert store.prepare(3, np.array(SHARED[:MIN_SHARED - 1] + [9] * 30)).length == 0
    assert store.prepare(2, turn2).length == len(SHARED) and store.stats.prefix_hits == 1
    # a request with a cache_salt shares only with requests of its salt
    assert store.held(7, turn2, "alice") == 0 and store.prepare(7, turn2, "alice").length == 0
    salted = store.prepare(8, np.array(SHARED + [4]), "alice")
    model([salted], [SHARED], [1])
    assert store.held(9, turn2, "alice") == len(SHARED) and store.prepare(9, turn2, "alice").length == len(SHARED)
    assert store.prepare(10, turn2, "bob").length == 0
    store.free([7, 8, 9, 10], keep=False)
    # a cache the prefetch thread may be changing (pinned) is not read
    store.free([2])
    store.finished.clear()
    live = store.prepare(4, np.array(SHARED + [1]))
    model([live], [SHARED], [1])
    store.pinned.add(4)
    assert store.prepare(5, np.array(SHARED + [2])).length == 0
    store.pinned.clear()
    assert store.prepare(6, np.array(SHARED + [2])).length == len(SHARED)
    # over the budget the finished ones go first, then the least recently used live ones
    store.free([4])
    assert len(store.finished) == 1
    store.max_bytes = sum(c.allocated_bytes for c in store.caches.values())
    store.evict(protect=set())
    assert not store.finished and set(store.caches) == {3, 5, 6}
    # a request freed without ``keep`` (a warm-up's) is not kept; nor more than KEEP_FINISHED
    store.max_bytes = 4 << 30
    store.free([5], keep=False)
    assert not store.finished
    for rid in range(10, 10 + KEEP_FINISHED + 3):
        c = store.prepare(rid, np.array(SHARED + [rid]))
        model([c], [np.array(SHARED + [rid])[c.length:].tolist()], [1])
        store.free([rid])
    assert len(store.finished) == KEEP_FINISHED


def test_without_the_prefix_cache_nothing_is_kept_or_copied(tiny_pair) -> None:  # noqa: ANN001
    model = load_model(tiny_pair / "target")
    store = KVStore(model)
    cache = store.prepare(1, np.array(SHARED + [5]))
    model([cache], [SHARED], [1])
    assert store.prepare(2, np.array(SHARED + [6])).length == 0
    store.free([1, 2])
    assert not store.finished and store.stats.prefix_hits == 0


async def _at_once(address: str, prompts: list[list[int]]) -> list[list[int]]:
    async with AsyncClient(address) as client:
        outs = await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=MAX_NEW, ignore_eos=True)
                                      for p in prompts))
    return [o.token_ids for o in outs]


def _prompts() -> list[list[int]]:
    return [SHARED + [200 + i, 201 + i, 202 + i] for i in range(3)]


@pytest.mark.parametrize("mode", ["pooled", "colocated", "elastic", "autoregressive"])
def test_greedy_output_with_shared_prefixes_is_the_targets_own(tiny_pair, mode: str) -> None:  # noqa: ANN001
    """Requests with a shared system prompt, one after another and at once, and a chat's second
    turn: each output is HF's greedy output of the target alone, and the workers reused prefixes."""
    prompts = _prompts()
    cfg = deploy_config(tiny_pair, mode, 0 if mode in ("colocated", "autoregressive") else 1, 1)
    with Deployment(cfg) as dep, Client(dep.address) as client:
        done = [client.generate(token_ids=p, max_new_tokens=MAX_NEW, ignore_eos=True) for p in prompts]
        outs = [o.token_ids for o in done]
        together = asyncio.run(_at_once(dep.address, prompts))
        turn2 = prompts[0] + outs[0] + [9, 10, 11]
        follow_up = client.generate(token_ids=turn2, max_new_tokens=MAX_NEW, ignore_eos=True)
        second = follow_up.token_ids
        salted = client.generate(token_ids=prompts[1], max_new_tokens=MAX_NEW, ignore_eos=True, cache_salt="other")
        kv = [w["kv"] or {} for w in client.status()["workers"]]
    for p, out in zip(prompts, outs):
        ref = hf_greedy(tiny_pair / "target", p, MAX_NEW)
        assert out[:len(ref)] == ref, mode
    ref2 = hf_greedy(tiny_pair / "target", turn2, MAX_NEW)
    assert second[:len(ref2)] == ref2, mode
    assert together == outs
    # every worker holding the target reused: the 2nd and 3rd requests' system prompt, the 2nd turn
    assert sum(k.get("prefix_hits", 0) for k in kv) >= 3, kv
    assert sum(k.get("prefix_reused", 0) for k in kv) >= 2 * len(SHARED) + len(prompts[0]) + MAX_NEW - 1, kv
    # each request's usage says how much of its prompt the target's prefix cache held
    assert [o.stats["cached_tokens"] for o in done] == [0, len(SHARED), len(SHARED)]
    assert follow_up.stats["cached_tokens"] == len(prompts[0]) + MAX_NEW - 1  # (the last turn's KV, all but its last)
    assert salted.token_ids == outs[1] and salted.stats["cached_tokens"] == 0  # (another salt: nothing shared)


@pytest.mark.slow
def test_the_openai_client_reads_cached_prompt_tokens(tiny_pair) -> None:  # noqa: ANN001
    import openai

    system = "You review Python code. " + "def f(x):\n    return x * 2\n" * 20
    with Deployment(deploy_config(tiny_pair, "pooled", 1, 1)) as dep:
        dep.start_api("127.0.0.1", 0, model_name="tiny")
        api = openai.OpenAI(base_url=dep.http_url + "/v1", api_key="none", max_retries=0, timeout=60)
        asked = [api.chat.completions.create(model="tiny", max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}],
            **({"extra_body": {"cache_salt": salt}} if salt else {}))
            for question, salt in (("What does f do?", None), ("Is f pure?", None), ("Is f slow?", "tenant-b"),
                                   ("Is f fast?", "tenant-b"))]
        with pytest.raises(openai.BadRequestError) as err:
            api.chat.completions.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                        extra_body={"cache_salt": ""})
        assert err.value.body["param"] == "cache_salt"
    cached = [a.usage.prompt_tokens_details.cached_tokens for a in asked]
    # the second shares the first's system prompt; the third, salted, shares nothing; the fourth, the third's
    assert cached[0] == cached[2] == 0 and all(100 < cached[i] < asked[i].usage.prompt_tokens for i in (1, 3)), cached


@pytest.mark.slow
def test_seeded_samples_do_not_depend_on_the_prefix_cache_or_placement(tiny_pair) -> None:  # noqa: ANN001
    outs = {}
    prompts = _prompts()
    for mode, m, n, on in (("pooled", 1, 1, False), ("pooled", 1, 1, True), ("pooled", 2, 2, True),
                           ("elastic", 2, 2, True)):
        cfg = deploy_config(tiny_pair, mode, m, n)
        cfg.draft.prefix_cache = cfg.target.prefix_cache = on
        with Deployment(cfg) as dep, Client(dep.address) as client:
            outs[(mode, m, n, on)] = [client.generate(token_ids=p, max_new_tokens=MAX_NEW, ignore_eos=True,
                                                      temperature=0.8, seed=3 + i).token_ids
                                      for i, p in enumerate(prompts * 2)]
            hits = sum((w["kv"] or {}).get("prefix_hits", 0) for w in client.status()["workers"])
        assert (hits > 0) == on, (mode, m, n, on, hits)
    first = next(iter(outs.values()))
    assert len({tuple(t) for t in first[:3]}) == 3
    assert all(o == first for o in outs.values()), outs


def test_a_bench_mode_turns_the_prefix_cache_off_and_prompts_share_a_prefix(tiny_pair) -> None:  # noqa: ANN001
    import click

    from nebula_flow.bench import with_context
    from nebula_flow.cli.common import pool_settings
    from nebula_flow.config import ConfigError

    cfg = deploy_config(tiny_pair, "pooled")
    assert cfg.draft.prefix_cache and cfg.target.prefix_cache  # (on by default)
    assert pool_settings(cfg, ["prefix_cache=false", "k=3"], "pooled@prefix_cache=false@k=3") == ["k=3"]
    assert not cfg.draft.prefix_cache and not cfg.target.prefix_cache
    with pytest.raises(click.BadParameter, match="true or false"):
        pool_settings(cfg, ["prefix_cache=0"], "m")
    cfg.target.prefix_cache = "yes"
    with pytest.raises(ConfigError, match="prefix_cache must be true or false"):
        cfg.validate()
    shared = with_context(["a", "b"], 50, tiny_pair / "target", shared=True)
    apart = with_context(["a", "b"], 50, tiny_pair / "target")
    assert shared[0][:-1] == shared[1][:-1] and shared[0] != shared[1]
    assert apart[0][:-1] != apart[1][:-1]
    other = with_context(["a", "b"], 50, tiny_pair / "target", shared=True, stretch=1)  # (another document)
    assert other[0][:-1] == other[1][:-1] and other[0][:-1] != shared[0][:-1]


def test_bench_with_a_fresh_shared_start_each_repeat_measures_what_waiting_for_it_saves(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """``nebula-flow bench --shared-prefix N --fresh-prefix``: each repeat's requests arrive together on a
    document the deployment has not seen, so in each repeat one computes it and the others start from its
    KV (two of three prompts mostly cached: ``wait_for_prefix``); without ``--fresh-prefix`` the warm-up
    has computed the shared start already and every request finds it (more than two thirds cached)."""
    import json

    from click.testing import CliRunner

    from nebula_flow.cli import main
    from tests.conftest import tiny_config_file

    config = tiny_config_file(tiny_pair, tmp_path)
    args = ["bench", "--config", str(config), "--shared-prefix", "120", "--concurrency", "3", "--requests", "3",
            "--max-new-tokens", "6", "--repeats", "2", "--json", "--modes", "pooled"]
    cached = {}
    for fresh in (["--fresh-prefix"], []):
        res = CliRunner().invoke(main, [*args, *fresh])
        assert res.exit_code == 0, res.output
        cached[bool(fresh)] = [r["prompt_cached"] for r in json.loads(res.output.strip().splitlines()[-1])["modes"]
                               ["pooled"]["repeats"]]
    assert all(0.5 < c < 2 / 3 for c in cached[True]) and all(c > 2 / 3 for c in cached[False]), cached
    bad = CliRunner().invoke(main, [*args[:3], "--fresh-prefix", "--modes", "pooled"])
    assert bad.exit_code != 0 and "needs --shared-prefix" in bad.output


# -- placement: where a new request's prompt start is likely held (nebula_flow/prefixes.py) ------------
def _request(rid: int, prompt: list[int], max_new: int = 8, salt: str | None = None) -> Request:
    return Request(rid, str(rid), list(prompt), SamplingParams(max_new_tokens=max_new, cache_salt=salt), seed=rid)


def _ended(tokens: list[int], holders: dict[str, tuple[int, int]], salt: str | None = None, rid: int = 0) -> Request:
    """A request (``rid``) that ended holding ``tokens``' KV with these holders."""
    req = _request(rid, tokens, salt=salt)
    req.holders = holders
    return req


def test_prefix_routes_find_the_worker_that_held_the_longest_prefix() -> None:
    routes = PrefixRoutes()
    doc = list(range(1000, 1300))
    routes.learn(_ended(doc[:100], {"target": (7, 100), "draft": (3, 40)}, rid=10))
    routes.learn(_ended(doc[:40] + [5] * 60, {"target": (8, 100)}, rid=11))  # (shares 2 blocks, learnt later)
    # (the worker, the prefix's positions, the request whose KV it was and its prompt's length: a worker
    # without it pulls it from there)
    assert routes.find(_request(1, doc + [1]), alive={3, 7, 8}) == {"target": (7, 96, 10, 100), "draft": (3, 32, 10, 100)}
    assert routes.find(_request(1, doc[:40] + [5] * 60 + [1]), alive={7, 8}) == {"target": (8, 96, 11, 100)}
    assert routes.find(_request(1, doc + [1]), alive={8}) == {"target": (8, 32, 11, 100)}  # (a worker gone: the next best)
    assert routes.find(_request(1, doc[:16]), alive={7, 8}) == {}  # (all but the last token: less than a block)
    assert routes.find(_request(1, list(range(50))), alive={7, 8}) == {}
    # a cache_salt keeps requests apart: only those of the same salt look alike
    routes.learn(_ended(doc[:100], {"target": (9, 100)}, salt="alice", rid=12))
    assert routes.find(_request(1, doc + [1], salt="alice"), alive={7, 8, 9}) == {"target": (9, 96, 12, 100)}
    assert routes.find(_request(1, doc + [1], salt="bob"), alive={7, 8, 9}) == {}
    assert routes.find(_request(1, doc + [1]), alive={7, 8, 9})["target"] == (7, 96, 10, 100)
    # a long shared start is known to within EVERY blocks, not only at 1, 2, 4, ... blocks
    system = list(range(2000, 3500))  # (1,500 tokens: 93 whole blocks)
    routes.learn(_ended(system + [7] * 40, {"target": (7, 1540)}, rid=13))
    found = routes.find(_request(1, system + [9] * 30), alive={7})["target"]
    assert found == (7, (93 // EVERY) * EVERY * BLOCK, 13, 1540) and found[1] == 1408  # (was 1,024: 64 blocks)
    few = PrefixRoutes(max_keys=4)
    for i in range(10):
        few.learn(_ended([i] * 200, {"target": (1, 200)}))
    assert len(few.where) == 4 and few.find(_request(1, [9] * 201), {1}) and not few.find(_request(1, [0] * 201), {1})


def test_elastic_binds_a_request_where_its_prefix_is_unless_that_worker_is_busier_than_the_prefix_saves() -> None:
    def elastic(prefixes: bool, **knobs: float) -> Scheduler:
        s = Scheduler("elastic", PolicyConfig(k=4, **knobs))
        s.register(1, "any", 4)
        s.register(2, "any", 4)
        if prefixes:
            s.prefixes = PrefixRoutes()
            s.prefixes.learn(_ended(doc, {"target": (1, 400), "draft": (1, 400)}))  # (worker 1: slot 0)
        return s

    def bound(s: Scheduler, *prompts: tuple[list[int], int]) -> list[int | None]:
        reqs = [_request(i, p, max_new) for i, (p, max_new) in enumerate(prompts)]
        for r in reqs:
            s.admit(r)
        return [r.slot for r in reqs]

    doc = list(range(1000, 1400))
    small, plain = (list(range(4)), 2), (list(range(20)), 8)  # (3 and 13 tokens' work)
    near, big = (doc + [1, 2], 8), (list(range(5000, 5010)), 400)
    # without prefix pulls: slot 0 holds more work already, but less than the prefill (400 x PROMPT_WEIGHT) its
    # prefix saves there and nowhere else
    assert bound(elastic(True, prefix_pulls=False), plain, near) == [0, 0]
    assert bound(elastic(True), plain, near) == [0, 0]  # (prefix_pull_cost 1: a pull counted as dear as computing)
    # counted at 0.1 of computing it (10 tokens' work here), the request stays with its prefix where slot 0's extra
    # work is less than that, else goes to the other slot, whose worker pulls it
    assert bound(elastic(True, prefix_pull_cost=0.1), small, near) == [0, 0]
    assert bound(elastic(True, prefix_pull_cost=0.1), plain, near) == [0, 1]
    assert bound(elastic(False), small, near) == [0, 1]  # (no prefixes known: load alone)
    # slot 0 holds much more work than the prefix saves: the request goes to the idle slot and computes its prefix
    assert bound(elastic(True, prefix_pulls=False), big, near) == [0, 1]


def test_a_next_turn_still_waiting_where_its_chat_is_counts_as_bound_when_the_pool_is_counted_again() -> None:
    """Chats a and c were computed on worker 1 (slot 0), b and d on worker 2 (slot 1); their next turns
    come together. d's is bound to slot 1 and still waits, c's runs on slot 0; then b's comes. Counted
    again over the pool, d's turn weighs what it brings slot 1 (its prefill less its chat's KV held
    there), as it did when it was bound, not its whole prompt: b's turn goes where its chat is."""
    s = Scheduler("elastic", PolicyConfig(k=4))
    s.prefixes = PrefixRoutes()
    s.register(1, "any", 4)
    s.register(2, "any", 4)
    chats = {name: list(range(1000 + 200 * i, 1200 + 200 * i)) for i, name in enumerate("abcd")}
    for name, chat in chats.items():
        s.prefixes.learn(_ended(chat, {"target": (1 if name in "ac" else 2, 200)}))
    turn = {name: _request(i, chat + [1, 2, 3]) for i, (name, chat) in enumerate(chats.items())}
    s.admit(turn["d"])
    s.admit(turn["c"])
    assert (turn["d"].slot, turn["c"].slot) == (1, 0)
    turn["c"].holders, turn["c"].output = {"target": (1, 202)}, [5]  # (c's turn runs: its prompt is held)
    s.admit(turn["b"])
    assert turn["b"].slot == 1


def test_a_busy_pooled_worker_leaves_a_request_to_the_worker_holding_its_prefix_an_idle_one_does_not() -> None:
    def pooled() -> Scheduler:
        s = Scheduler("pooled", PolicyConfig(k=4))
        s.prefixes = PrefixRoutes()
        for wid in (1, 2):
            s.register(wid, "draft", 4)
        s.register(3, "target", 4)
        s.prefixes.learn(_ended(doc, {"draft": (2, 300)}))
        s.admit(_request(1, doc + [1]))
        return s

    doc = list(range(2000, 2300))
    s = pooled()
    s.pull(1, 4, idle=False, now=0.0)  # busy: it prefetches behind a running batch
    assert s.dispatch() == []
    s.pull(2, 4, idle=False, now=1.0)
    assert [(wid, [r.rid for r in batch]) for wid, batch in s.dispatch()] == [(2, [1])]
    s = pooled()
    s.pull(1, 4, idle=True, now=0.0)  # idle: a task never waits for a particular worker
    assert [(wid, [r.rid for r in batch]) for wid, batch in s.dispatch()] == [(1, [1])]


def test_a_running_requests_prompt_is_found_once_its_first_tokens_are_committed() -> None:
    """Requests that start alike while the first still runs (a shared system prompt, questions about
    one document arriving together) are placed by its KV once its prompt is held: from its first
    committed tokens, not only once it ends."""
    s = Scheduler("autoregressive", PolicyConfig(k=0))
    s.prefixes = PrefixRoutes()
    s.register(1, "target", 4)
    doc = list(range(3000, 3200))
    first = _request(1, doc + [1], max_new=32)
    s.admit(first)
    assert s.prefixes.find(_request(2, doc + [2]), {1}) == {}  # (nothing held yet)
    s.pull(1, 4, idle=True, now=0.0)
    [(_, [running])] = s.dispatch()
    s.end_round(running, 1, [7])
    assert running.rid in s.requests and running.output == [7]  # (still running)
    assert s.prefixes.find(_request(2, doc + [2]), {1})["target"] == (1, 192, 1, len(first.prompt))


def _recording_elastic() -> policy_log.RecordingScheduler:
    """A recorded elastic policy with placement by prefix, and two workers."""
    s = policy_log.RecordingScheduler("elastic", PolicyConfig(k=2))
    s.prefixes = PrefixRoutes()
    for wid in (1, 2):
        s.register(wid, "any", 4)
    return s


def test_a_policy_log_replays_placement_by_prefix() -> None:
    s = _recording_elastic()
    doc = list(range(3000, 3200))
    s.prefixes.learn(_ended(doc, {"target": (2, 200)}))
    for rid in range(4):
        s.admit(_request(rid, doc + [rid] if rid % 2 else list(range(rid * 10, rid * 10 + 30))))
    for wid in (1, 2):
        s.pull(wid, 4, idle=True, now=float(wid))
        s.dispatch()
    assert [r[6] for r in s.records if r[0] == "admit"] == [{}, {"target": [2, 192]}, {}, {"target": [2, 192]}]
    assert policy_log.replay(s.records, Scheduler("elastic", PolicyConfig(k=2))).identical
    # the check can fail: without the recorded placement the same events are decided otherwise
    blind = [r[:6] if r[0] == "admit" else r for r in s.records]
    assert not policy_log.replay(blind, Scheduler("elastic", PolicyConfig(k=2))).identical


@pytest.mark.parametrize("mode", ["elastic", "colocated"])
def test_a_chats_next_turns_go_where_their_last_turns_kv_is(tiny_pair, mode: str) -> None:  # noqa: ANN001
    """Four conversations at once on two workers, then their next turns at once: each next turn is
    bound to the worker that holds its conversation so far, and starts from that KV (they come in
    the other order: bound by load alone, they would go to the other worker). The chats are long
    enough that the prefill their KV saves, even over pulling it to the other worker at 0.1 of computing
    it (``prefix_pull_cost``; 640 prompt positions at ``PROMPT_WEIGHT``: 16 tokens' work), outweighs how
    far the other turns have got (at most their 12 tokens), which is timing. An elastic request's tasks
    go to its home unless the other worker is idle, which takes them anyway (locality never waits) and
    pulls the conversation's KV from the home (whole 16-token blocks, ``prefixes.BLOCK``): an elastic
    turn starts from its conversation's KV, copied or pulled; a colocated turn's tasks run where it is
    bound, which copies all of it."""
    firsts = [np.random.default_rng(i).integers(5, 500, 640).tolist() for i in range(4)]
    with Deployment(deploy_config(tiny_pair, mode, *((1, 1) if mode == "elastic" else (0, 2)))) as dep:
        turns = asyncio.run(_at_once(dep.address, firsts))
        nexts = [p + out + [7, 8, 9] for p, out in zip(firsts, turns)]
        async def follow_ups() -> list:  # noqa: ANN001
            async with AsyncClient(dep.address) as client:
                return await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=MAX_NEW, ignore_eos=True)
                                              for p in reversed(nexts)))
        done = asyncio.run(follow_ups())[::-1]
        with Client(dep.address) as client:
            workers = [w for w in client.status()["workers"] if w["tasks"]]
    assert len(workers) == 2  # (both workers served)
    for p, out, d in zip(firsts, turns, done):
        held = len(p) + len(out) - 1  # (the last turn's KV, all but its last token)
        want = held if mode == "colocated" else held // BLOCK * BLOCK
        assert want <= d.stats["cached_tokens"] <= held, [x.stats["cached_tokens"] for x in done]


@pytest.mark.parametrize("mode", ["elastic", "pooled"])
def test_a_request_that_starts_like_a_running_one_starts_from_its_kv(tiny_pair, mode: str) -> None:  # noqa: ANN001
    """A long request runs on one of two workers; a second that starts with the same 100 tokens
    comes once the first has streamed its first tokens, and ends while the first still runs: it
    starts from the first's KV (copied where it is bound beside it, pulled where it is bound to the
    other worker), not from nothing, and its output is HF's greedy output of the target alone."""
    first, second = SHARED + [7, 8, 9], SHARED + [300, 301, 302]

    async def second_while_first_runs(address: str) -> tuple:  # noqa: ANN001
        async with AsyncClient(address) as client:
            later, order = None, []
            async for _ in client.stream(token_ids=first, max_new_tokens=400, ignore_eos=True):
                if later is None:  # (its first tokens are out: its prompt's KV is held)
                    later = await client.generate(token_ids=second, max_new_tokens=MAX_NEW, ignore_eos=True)
                    order.append("second")
            order.append("first")
            return later, order

    cfg = deploy_config(tiny_pair, mode, *((1, 1) if mode == "elastic" else (1, 2)))
    with Deployment(cfg, worker_changes={"kv_skip_slow_pulls": False}) as dep:
        later, order = asyncio.run(second_while_first_runs(dep.address))
    assert order == ["second", "first"]  # (the second ended while the first ran)
    ref = hf_greedy(tiny_pair / "target", second, MAX_NEW)
    assert later.token_ids[:len(ref)] == ref
    assert later.stats["cached_tokens"] >= len(SHARED) - len(SHARED) % 16, later.stats  # (placement keys whole 16-token blocks)


def test_the_wire_refuses_a_malformed_cached_count() -> None:
    from nebula_flow import protocol
    from nebula_flow.protocol import Rejected, Result, TaskResult

    for bad, why in ((-1, "position count"), (True, "wrong type"), ("3", "wrong type")):
        sent = Result([TaskResult(1, "verify", 1, 1, committed=[5], cached=bad)], 0.0, {}, None, None)
        [got] = protocol.decode(protocol.encode(sent)).results
        assert isinstance(got, Rejected) and why in str(got.error)
    sent = Result([TaskResult(1, "verify", 1, 1, committed=[5], cached=40)], 0.0, {}, None, None)
    assert protocol.decode(protocol.encode(sent)).results[0].cached == 40


@pytest.mark.parametrize("api", [False, True])
def test_a_bench_conversation_sends_each_turn_with_the_turns_before_it(tiny_pair, api: bool) -> None:  # noqa: ANN001
    """``bench --turns``: each turn is the chat so far, answered as the target alone answers it, and
    its prompt is mostly cached (the earlier turns' KV), through either front door."""
    from nebula_flow.bench import FOLLOW_UPS, BenchWorkload, run_once
    from nebula_flow.tokenizer import TextCodec

    wl = BenchWorkload(["def fibonacci(n):"], max_new_tokens=6, chat=True, turns=3)
    with Deployment(deploy_config(tiny_pair, "elastic")) as dep:
        url = None
        if api:
            dep.start_api("127.0.0.1", 0, model_name="tiny")
            url = dep.http_url
        res = run_once(dep.address, wl, url)
        with Client(dep.address) as client:  # (the conversation again, turn by turn, to check each answer)
            history, codec = [], TextCodec(tiny_pair / "target")
            for turn, question in enumerate(["def fibonacci(n):", *FOLLOW_UPS[:2]]):
                history.append({"role": "user", "content": question})
                out = client.generate(messages=list(history), max_new_tokens=6, seed=turn, ignore_eos=True)
                ref = hf_greedy(tiny_pair / "target", codec.encode_chat(history), 6)
                assert out.token_ids[:len(ref)] == ref
                history.append({"role": "assistant", "content": out.text})
    assert res["requests"] == 3 and res["tokens"] == 18
    assert res["prompt_cached"] > 0.4, res["prompt_cached"]  # (turns 2 and 3: the chat so far, less the new question)


# -- prefix pulls: a prompt's start another worker's KV holds (Holder.source) --------------------------
@pytest.mark.parametrize("transport", ["zmq", "shm+zmq"])
def test_a_peer_pulls_a_prompt_start_from_a_finished_requests_kv(tiny_pair, transport: str) -> None:  # noqa: ANN001
    """A holder keeps a finished request's KV for prefixes and serves it by that request's id; a puller
    pulls a new request's prompt start from it into the new request's cache (counted as a prefix pull
    and as cached positions), the rows equal to the holder's; a source it no longer holds reads as
    missing (the puller computes those positions)."""
    from nebula_flow.kv.transport import make_transport

    model = load_model(tiny_pair / "target")
    holder, puller = KVStore(model, prefix_cache=True), KVStore(model, prefix_cache=True)
    server, client = make_transport(transport), make_transport(transport)
    endpoint = server.serve("127.0.0.1", lambda rid, role, s, e: holder.snapshot(rid, s, e))
    if transport == "shm+zmq":
        holder.share_into(server.share_folder, "target")
    done = np.array(SHARED + [7, 8, 9], dtype=np.int64)
    try:
        model([holder.prepare(1, done)], [done[:-1].tolist()], [1])
        holder.publish([1])
        holder.free([1])  # (finished: kept for prefixes, under its request's id for peers)
        assert 1 not in holder.caches and holder.snapshot(1, 0, 96) is not None
        new = np.array(SHARED + [200, 201], dtype=np.int64)
        puller.fetch_many("target", [(5, new, 96, 1, None)], endpoint, client)
        assert puller.caches[5].length == 96 and torch.equal(puller.caches[5].buf[:96], holder.finished[1].buf[:96])
        assert (puller.stats.prefix_pulls, puller.stats.prefix_pulled, puller.take_copied(5)) == (1, 96, 96)
        assert puller.prepare(5, new).length == 96  # (kept: only the rest is computed)
        puller.fetch_many("target", [(6, new, 96, 3, None)], endpoint, client)  # (no request 3 there)
        assert puller.caches[6].length == 0 and puller.stats.pull_failures == 1 and puller.stats.prefix_pulls == 1
    finally:
        server.close()
        client.close()


def test_a_request_that_moves_pulls_only_what_its_new_workers_prefix_cache_lacks(tiny_pair) -> None:  # noqa: ANN001
    """A request's own KV that follows it to a worker whose prefix cache holds its prompt's start (a
    finished request on the same document) travels from the end of that start on: the start is
    copied there, the rows equal to the holder's, counted as ``pull_saved`` and not as the request's
    cached prompt tokens (it computed its prompt where it began); a request of another
    ``cache_salt`` is pulled whole (batch invariance on: rows of a prefill do not depend on its length)."""
    from nebula_flow.kv.transport import make_transport

    model = load_model(tiny_pair / "target", batch_invariant=True)
    holder, puller = KVStore(model, prefix_cache=True), KVStore(model, prefix_cache=True)
    server, client = make_transport("zmq"), make_transport("zmq")
    endpoint = server.serve("127.0.0.1", lambda rid, role, s, e: holder.snapshot(rid, s, e))
    moving = np.array(SHARED + [200, 201, 202, 203, 204, 205], dtype=np.int64)
    try:
        for rid in (5, 6):  # (the same request's tokens, one without and one with a salt)
            model([holder.prepare(rid, moving)], [moving[:-1].tolist()], [1])
        done = np.array(SHARED + [7, 8, 9], dtype=np.int64)
        model([puller.prepare(1, done)], [done[:-1].tolist()], [1])
        puller.free([1])  # (finished here: kept for prefixes)
        puller.fetch_many("target", [(5, moving, 105, 5, None), (6, moving, 105, 6, "tenant-b")], endpoint, client)
        for rid in (5, 6):
            assert puller.caches[rid].length == 105
            assert torch.equal(puller.caches[rid].buf[:105], holder.caches[rid].buf[:105])
        assert puller.stats.pull_saved == 100  # (the document's 100 positions, request 5 alone)
        assert puller.stats.pulled == 5 + 105 and puller.stats.pulls == 2
        assert puller.stats.bytes_pulled == (5 + 105) * puller.caches[5].row_bytes
        assert (puller.take_copied(5), puller.take_copied(6), puller.stats.prefix_pulls) == (0, 0, 0)
    finally:
        server.close()
        client.close()


def test_a_new_requests_task_elsewhere_names_where_its_prompt_start_is() -> None:
    """The broker's tasks (``broker/tasks.py``): a new request's task that goes to another worker than
    the one whose KV likely holds its prompt's start names that worker and request; on that worker,
    or with ``prefix_pulls`` off, or once the request's own KV is held somewhere, it names none."""
    from types import SimpleNamespace

    from nebula_flow_broker.tasks import task_specs

    for pulls in (True, False):
        sched = Scheduler("pooled", PolicyConfig(k=2, prefix_pulls=pulls))
        for wid, role in ((3, "draft"), (1, "target"), (2, "target")):
            sched.register(wid, role, 4)
        req = _request(9, SHARED + [5])
        sched.admit(req)
        req.affinity = {"target": (1, 96, 4)}  # (worker 1 held it, as request 4's KV)
        req.phase = "verify"
        workers = {w: SimpleNamespace(kv_endpoint=f"tcp://w{w}") for w in (1, 2, 3)}
        [elsewhere] = task_specs(sched, 2, [req], workers)
        [there] = task_specs(sched, 1, [req], workers)
        want = (1, 96, "tcp://w1", 4) if pulls else (0, 0, None, None)
        h = elsewhere.holder
        assert (h.worker, h.valid, h.endpoint, h.source) == want and there.holder.source is None
        req.holders["target"] = (1, 104)
        [later] = task_specs(sched, 2, [req], workers)
        assert (later.holder.worker, later.holder.valid, later.holder.source) == (1, 104, None)


def test_a_colocated_request_bound_elsewhere_names_the_colocated_worker_holding_its_prompt_start() -> None:
    """A colocated round names the other colocated worker whose KV likely holds its prompt's start as
    its one holder (both models' KV are there, under that request's id); on that worker, none."""
    from types import SimpleNamespace

    from nebula_flow_broker.tasks import task_specs

    sched = Scheduler("colocated", PolicyConfig(k=2))
    for wid in (1, 2):
        sched.register(wid, "colocated", 4)
    req = _request(9, SHARED + [5])
    sched.admit(req)
    req.affinity = {"colocated": (1, 96, 4)}
    workers = {w: SimpleNamespace(kv_endpoint=f"tcp://w{w}") for w in (1, 2)}
    [elsewhere] = task_specs(sched, 2, [req], workers)
    [there] = task_specs(sched, 1, [req], workers)
    h = elsewhere.holder
    assert (h.worker, h.valid, h.endpoint, h.source) == (1, 96, "tcp://w1", 4) and elsewhere.target_holder is None
    assert there.holder.valid == 0 and there.holder.source is None


@pytest.mark.slow
@pytest.mark.parametrize("pulls", [True, False])
def test_a_colocated_worker_pulls_a_prompt_start_the_other_colocated_worker_holds(tiny_pair, pulls: bool) -> None:  # noqa: ANN001
    """Two colocated workers of one request at a time; the first request leaves the shared system
    prompt's KV on one; of the next two, sent at once, the second is bound to the other worker (the
    first worker's work counted is more than the prefill it would save), which pulls both models' KV
    of the prompt's start from there instead of computing it. Output is HF's greedy output of the
    target alone either way; with ``prefix_pulls`` off that request computes its prompt."""
    max_new = 40  # (long enough that one request's work outweighs the prefill its placement saves)
    prompts = [SHARED + [200 + i, 201 + i, 202 + i] for i in range(3)]
    cfg = deploy_config(tiny_pair, "colocated", 0, 2, max_batch=1)
    cfg.broker.policy = cfg.broker.policy.replace(prefix_pulls=pulls)
    with Deployment(cfg, worker_changes={"kv_skip_slow_pulls": False}) as dep, Client(dep.address) as client:
        first = client.generate(token_ids=prompts[0], max_new_tokens=max_new, ignore_eos=True)

        async def both() -> list:  # noqa: ANN001
            async with AsyncClient(dep.address) as aclient:
                return await asyncio.gather(*(aclient.generate(token_ids=p, max_new_tokens=max_new, ignore_eos=True)
                                              for p in prompts[1:]))
        later = asyncio.run(both())
        kv = [w["kv"] for w in client.status()["workers"]]
    for out, p in zip([first, *later], prompts):
        ref = hf_greedy(tiny_pair / "target", p, max_new)
        assert out.token_ids[:len(ref)] == ref
    assert all(k["pull_failures"] == 0 for k in kv), kv
    pulled = sorted((k["prefix_pulls"], k["prefix_pulled"]) for k in kv)
    if pulls:  # (the draft's KV and the target's: a pull of 96 positions each, the whole blocks placement knows)
        assert pulled == [(0, 0), (2, 192)], kv
        assert [o.stats["cached_tokens"] for o in later] == [len(SHARED), 96]  # (a copy there: to the token)
    else:
        assert pulled == [(0, 0), (0, 0)], kv
        assert [o.stats["cached_tokens"] for o in later] == [len(SHARED), 0]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm+zmq", "zmq"])
def test_a_prompt_start_another_worker_holds_is_pulled_and_output_is_unchanged(tiny_pair, transport: str) -> None:  # noqa: ANN001
    """A first request leaves the shared system prompt's KV on the one target worker; a second target
    worker joins; the next request's first verify goes to it (``migrate``: never the worker whose KV
    the task would use), which pulls the prompt's start from the first request's KV on the other
    instead of computing it (``Holder.source``), and reports those positions as cached. Every output
    is HF's greedy output of the target alone; with ``prefix_pulls`` off the newcomer computes it."""
    import os
    import subprocess
    import sys
    import time

    prompts = [SHARED + [200 + i, 201 + i, 202 + i] for i in range(3)]
    refs = [hf_greedy(tiny_pair / "target", p, MAX_NEW) for p in prompts]
    for pulls in (True, False):
        cfg = deploy_config(tiny_pair, "pooled", 1, 1, max_batch=1)
        cfg.broker.policy = cfg.broker.policy.replace(prefix_pulls=pulls, migrate=True)
        cfg.kv_transport = transport
        with Deployment(cfg, worker_changes={"kv_skip_slow_pulls": False}) as dep, Client(dep.address) as client:
            first = client.generate(token_ids=prompts[0], max_new_tokens=MAX_NEW, ignore_eos=True)
            joined = subprocess.Popen([sys.executable, "-m", "nebula_flow.cli", "worker", "--role", "target", "--model",
                                       str(tiny_pair / "target"), "--broker", cfg.broker.worker_address, "--max-batch",
                                       "1", "--kv-transport", transport, "--kv-always-pull", "--name", "newcomer"],
                                      env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                deadline = time.monotonic() + 120
                while sum(w["role"] == "target" for w in client.status()["workers"]) < 2:
                    assert time.monotonic() < deadline and joined.poll() is None, "the second target worker never joined"
                    time.sleep(0.1)
                later = [client.generate(token_ids=p, max_new_tokens=MAX_NEW, ignore_eos=True) for p in prompts[1:]]
                kv = {w["name"]: w["kv"] for w in client.status()["workers"] if w["role"] == "target"}
            finally:
                joined.terminate()
                joined.wait(30)
        for out, ref in zip([first, *later], refs):
            assert out.token_ids[:len(ref)] == ref
        newcomer = kv["newcomer"]
        assert newcomer["pull_failures"] == 0, newcomer
        if pulls:  # (whole blocks the placement knows of: prefixes.py keys 1, 2, 4, ... blocks and the last, learnt
            # at the first request's first tokens too, when its tokens were its prompt's 6 whole blocks and 7 more)
            assert newcomer["prefix_pulls"] == 1 and newcomer["prefix_pulled"] == 96, newcomer
            assert later[0].stats["cached_tokens"] == 96
        else:
            assert newcomer["prefix_pulls"] == 0 and later[0].stats["cached_tokens"] == 0, newcomer


# -- requests that arrive together: one computes their shared start, the rest wait for it ---------------------------
def _topics(s: Scheduler) -> set[int]:
    return {rid for topic in s.topics.values() for rid in topic}


def test_requests_that_arrive_together_wait_for_the_one_computing_their_shared_start() -> None:
    """Requests whose prompts share a start with one whose prompt is being computed wait for its first
    tokens (``wait_for_prefix``), then start placed where its KV holds that start (and name it as the
    source a worker pulls from); too short a shared start, or too small a share of what the first
    computes, or the knob at 0: they start at once. One that waits and is cancelled never starts."""
    def pooled(share: float = 0.5) -> Scheduler:
        s = Scheduler("pooled", PolicyConfig(k=2, wait_for_prefix=share))
        s.prefixes = PrefixRoutes()
        s.register(1, "draft", 8)
        s.register(2, "target", 8)
        return s

    doc = list(range(4000, 4200))
    s = pooled()
    first, same, other, little, cancelled = (_request(1, doc + [1]), _request(2, doc + [2]),
                                             _request(3, list(range(9000, 9200))), _request(4, doc[:60] + [5] * 140),
                                             _request(5, doc[:150] + [3]))
    for r in (first, same, other, little, cancelled):
        s.admit(r)
    assert [r.waits_for for r in (first, same, other, little, cancelled)] == [None, 1, None, None, 1]
    assert _topics(s) == {1, 3, 4}  # (the two that wait are in the pool, on no topic)
    assert s.prefixes.waiting(s.requests) == 2
    s.finish(5)
    assert s.prefixes.waiting(s.requests) == 1  # (the status counts those still in the pool)
    s.pull(1, 8, idle=True, now=0.0)
    [(_, drafts)] = s.dispatch()
    for r in drafts:
        s.draft_done(r, 1, [7, 7], {})
    s.pull(2, 8, idle=True, now=1.0)
    [(_, verifies)] = s.dispatch()
    assert sorted(r.rid for r in verifies) == [1, 3, 4]
    s.end_round(first, 2, [7, 7, 8])  # (its first tokens: its prompt's KV is held, on both workers)
    assert same.waits_for is None and _topics(s) == {1, 2}  # (the cancelled one stays out)
    assert same.affinity == {"target": (2, 192, 1, len(first.prompt)), "draft": (1, 192, 1, len(first.prompt))}
    # a request that shares too little of what the first computes starts at once: 96 of 400 tokens
    s = pooled()
    s.admit(_request(1, list(range(5000, 5400))))
    s.admit(_request(2, list(range(5000, 5100)) + [1]))
    assert s.requests[2].waits_for is None and _topics(s) == {1, 2}
    # an urgent request never waits behind a less urgent one (priority scheduling); the other way round it does
    s = pooled()
    s.admit(_request(1, doc + [1]))
    for rid, priority, waits in ((2, -1, None), (3, 1, 1)):
        s.admit(req := Request(rid, str(rid), doc + [rid], SamplingParams(max_new_tokens=8, priority=priority), seed=rid))
        assert req.waits_for == waits, priority
    # the knob at 0: never waits
    s = pooled(0.0)
    s.admit(_request(1, doc + [1]))
    s.admit(_request(2, doc + [2]))
    assert s.requests[2].waits_for is None and _topics(s) == {1, 2}
    # the first's worker dies while it computes: it runs again elsewhere, and those that waited start from there
    s = pooled()
    s.register(3, "target", 8)
    s.admit(first := _request(1, doc + [1]))
    s.admit(waiting := _request(2, doc + [2]))
    s.pull(1, 8, idle=True, now=0.0)
    [(_, [running])] = s.dispatch()
    s.draft_done(running, 1, [7, 7], {})
    s.pull(2, 8, idle=True, now=1.0)
    [(_, [running])] = s.dispatch()
    assert s.unregister(2) == [1] and waiting.waits_for == 1 and _topics(s) == {1}
    s.pull(3, 8, idle=True, now=2.0)
    [(_, [running])] = s.dispatch()
    s.end_round(first, 3, [7, 7, 8])
    assert waiting.waits_for is None and waiting.affinity["target"] == (3, 192, 1, len(first.prompt)) and _topics(s) == {1, 2}
    # the first cancelled before its first tokens: the one that waited starts, placed as it arrived
    s = pooled()
    s.admit(_request(1, doc + [1]))
    s.admit(waiting := _request(2, doc + [2]))
    s.finish(1)
    assert waiting.waits_for is None and _topics(s) == {2} and waiting.affinity == {}


def test_a_policy_log_replays_requests_that_waited_for_a_shared_start() -> None:
    s = _recording_elastic()
    doc = list(range(3000, 3200))
    for rid in range(4):
        s.admit(_request(rid, doc + [rid]))
    for step in range(6):
        for wid in (1, 2):
            s.pull(wid, 4, idle=True, now=float(2 * step + wid))
            for _, batch in s.dispatch():
                for req in batch:
                    s.end_round(req, wid, [7, 7, 8])
    assert [r[8] for r in s.records if r[0] == "admit"] == [None, [0, 192], [0, 192], [0, 192]]
    assert sum(r[0] == "end_round" for r in s.records) >= 4
    assert policy_log.replay(s.records, Scheduler("elastic", PolicyConfig(k=2))).identical
    # the check can fail: without the recorded waits the same events are decided otherwise
    blind = [r[:8] if r[0] == "admit" else r for r in s.records]
    assert not policy_log.replay(blind, Scheduler("elastic", PolicyConfig(k=2))).identical


@pytest.mark.parametrize("mode", ["pooled", "elastic"])
def test_requests_that_arrive_together_compute_their_shared_start_once(tiny_pair, mode: str) -> None:  # noqa: ANN001
    """Three requests with the same 100-token start sent at once to a fresh deployment: the first computes
    it, the others wait for it and start from its KV (their usage counts those positions as cached), and
    every output is HF's greedy output of the target alone; with ``wait_for_prefix`` at 0 none waits. Then
    three seeded samples of another shared start, at once: the same tokens whether they waited or not."""
    prompts = _prompts()
    sampled = [list(range(300, 400)) + [200 + i] for i in range(3)]
    refs = [hf_greedy(tiny_pair / "target", p, MAX_NEW) for p in prompts]
    samples = {}
    for share in (0.5, 0.0):
        cfg = deploy_config(tiny_pair, mode, *((1, 1) if mode == "elastic" else (1, 2)))
        cfg.broker.policy = cfg.broker.policy.replace(wait_for_prefix=share)

        async def at_once(address: str, prompts: list[list[int]], **params: object) -> list:
            async with AsyncClient(address) as client:
                return await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=MAX_NEW, ignore_eos=True,
                                                              **{k: v + i if k == "seed" else v for k, v in params.items()})
                                              for i, p in enumerate(prompts)))

        with Deployment(cfg, worker_changes={"kv_skip_slow_pulls": False}) as dep, Client(dep.address) as client:
            done = asyncio.run(at_once(dep.address, prompts))
            waits = client.status()["counters"].get("prefix_waits", 0)
            samples[share] = [d.token_ids for d in asyncio.run(at_once(dep.address, sampled, temperature=0.8, seed=3))]
            state = client.status()
        assert waits == (2 if share else 0) and state["waiting_for_prefix"] == 0  # (counted; none left waiting)
        for out, ref in zip(done, refs):
            assert out.token_ids[:len(ref)] == ref, (mode, share)
        # (at least the whole 16-token blocks placement keys. Without waiting, whether a later request finds
        # the first's KV on its worker is timing; the scheduler's tests above say who waits, deterministically)
        cached = sorted(d.stats["cached_tokens"] for d in done)
        assert cached[0] == 0, (mode, share, cached)
        if share:
            assert min(cached[1:]) >= 96, (mode, cached)
    assert samples[0.5] == samples[0.0] and len({tuple(t) for t in samples[0.5]}) == 3


def test_wait_for_prefix_is_a_share_from_zero_to_one_wherever_it_is_set(tmp_path) -> None:  # noqa: ANN001
    from click.testing import CliRunner

    from nebula_flow.cli import main
    from nebula_flow.config import ConfigError, load_config
    from nebula_flow.policy import PolicyError

    path = tmp_path / "c.toml"
    base = 'mode = "pooled"\n[draft]\nmodel = "/m/d"\n[target]\nmodel = "/m/t"\n[policy]\n'
    for value, want in (("0.25", 0.25), ("1", 1.0), ("0", 0.0)):
        path.write_text(base + f"wait_for_prefix = {value}\n")
        assert load_config(path).broker.policy.wait_for_prefix == want
    for bad in ("1.5", "-0.1", "true", '"half"', "nan"):
        path.write_text(base + f"wait_for_prefix = {bad}\n")
        with pytest.raises(ConfigError, match="wait_for_prefix"):
            load_config(path)
    assert PolicyConfig().with_setting("wait_for_prefix=0.75").wait_for_prefix == 0.75
    with pytest.raises(PolicyError, match="must be a number"):
        PolicyConfig().with_setting("wait_for_prefix=true")
    result = CliRunner().invoke(main, ["broker", "--wait-for-prefix", "0.25", "--print-options"])
    assert result.exit_code == 0 and '"wait_for_prefix": 0.25' in result.output, result.output
    result = CliRunner().invoke(main, ["broker", "--wait-for-prefix", "2", "--print-options"])
    assert result.exit_code != 0 and "wait_for_prefix must be in 0.0..1.0" in result.output
