"""KV follows the request: peer-to-peer pulls over ZeroMQ and UCX, only what is missing."""

from __future__ import annotations

import asyncio
import signal
import time

import numpy as np
import pytest
import torch

from nebula_flow.client import AsyncClient, Client
from nebula_flow.deploy import Deployment
from nebula_flow.kv.store import KVStore
from nebula_flow.kv.transport import ZmqTransport, make_transport
from nebula_flow.models.loader import load_model
from tests.conftest import deploy_config, hf_greedy, workers_lost

TRANSPORTS = ["zmq", "shm", "shm+zmq", pytest.param("ucx", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("ucxx") is None, reason="ucxx not installed"))]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_incremental_pull_moves_only_missing_positions(tiny_pair, transport: str, caplog) -> None:  # noqa: ANN001
    model = load_model(tiny_pair / "target")
    holder, puller = KVStore(model), KVStore(model)
    tokens = np.arange(1, 61, dtype=np.int64)
    server = make_transport(transport)
    client = ZmqTransport() if transport == "zmq" else server  # UCX is one context per process
    endpoint = server.serve("127.0.0.1", lambda rid, role, s, e: holder.snapshot(rid, s, e))
    if server.share_folder is not None:  # a shared-memory holder keeps its caches in files the puller maps
        holder.share_into(server.share_folder, "target")
    holder.prepare(7, tokens)
    model([holder.caches[7]], [tokens[:-1].tolist()], [1])  # the holder computed positions 0..58
    holder.publish([7])
    try:
        row_bytes = holder.caches[7].buf[0].numel() * 4
        # The puller already holds the first 30 positions plus 5 stale ones (rejected drafts).
        cache = puller.prepare(7, tokens[:31])
        model([cache], [tokens[:30].tolist()], [1])
        model([cache], [[400, 401, 402, 403, 404]], [1])
        puller.fetch(7, "target", tokens, 59, endpoint, client)
        assert puller.stats.pulled == 29 and puller.stats.bytes_pulled == 29 * row_bytes
        assert puller.caches[7].tokens == tokens[:59].tolist()
        # The pulled rows are the holder's bytes; the kept prefix was computed here (equal up to rounding).
        assert np.array_equal(puller.caches[7].buf[30:59].numpy(), holder.caches[7].buf[30:59].numpy())
        assert np.allclose(puller.caches[7].buf[:30].numpy(), holder.caches[7].buf[:30].numpy(), atol=1e-5)
        # A holder without the request answers "missing": nothing is pulled, recompute follows.
        with caplog.at_level("WARNING", logger="nebula_flow.kv"):
            puller.fetch(8, "target", tokens, 59, endpoint, client)
        assert puller.stats.pull_failures == 1 and puller.stats.pulls == 1
        (said,) = [r.getMessage() for r in caplog.records]  # (loud: the worker's log says it)
        assert f"1 of 1 items not received (0 of {59 * row_bytes} bytes in " in said and said.endswith("; recomputed")
        # Logits after the pull equal those of a cache computed locally.
        got = model([puller.prepare(7, tokens)], [tokens[59:].tolist()], [1])[0]
        ref = model([model.new_cache()], [tokens.tolist()], [1])[0]
        assert np.allclose(got.numpy(), ref.numpy(), atol=1e-5)
    finally:
        server.close()
        if client is not server:
            client.close()


@pytest.mark.parametrize("transport", ["zmq", pytest.param("ucx", marks=TRANSPORTS[-1].marks)])
def test_one_exchange_brings_several_requests_and_a_missing_one_reads_as_missing(transport: str) -> None:
    """A batch's pulls from one holder are one exchange (UCX: every request and receive posted at
    once); a request the holder lacks reads as missing without upsetting the others or the next
    exchange on the same endpoint."""
    server = make_transport(transport)
    client = ZmqTransport() if transport == "zmq" else server  # UCX is one context per process
    rows, tokens = torch.randn(64, 2, 16), np.arange(100, 164, dtype=np.int32)
    endpoint = server.serve("127.0.0.1", lambda rid, role, s, e: None if rid == 2 else (tokens[s:e], rows[s:e]))
    try:
        for _ in range(3):
            dest = torch.zeros(64, 2, 16)
            got = client.pull_many(endpoint, [(1, "target", 0, 8, dest[:8]), (2, "target", 8, 16, dest[8:16]),
                                              (3, "target", 16, 40, dest[16:40]), (4, "target", 40, 41, dest[40:41])])
            assert [None if g is None else g.tolist() for g in got] == [
                list(range(100, 108)), None, list(range(116, 140)), [140]]
            assert torch.equal(dest[:8], rows[:8]) and torch.equal(dest[16:41], rows[16:41])
        dest = torch.zeros(64, 2, 16)  # more requests than a UCX batch's first message holds
        got = client.pull_many(endpoint, [(rid, "target", 2 * rid, 2 * rid + 2, dest[2 * rid:2 * rid + 2]) for rid in range(3, 30)])
        assert [g.tolist() for g in got] == [[100 + 2 * rid, 101 + 2 * rid] for rid in range(3, 30)]
        assert torch.equal(dest[6:60], rows[6:60])
        if transport == "ucx":  # a malformed request is counted and ends only its own connection
            import ucxx

            async def malformed(*messages: list[int]) -> None:
                host, port = endpoint.removeprefix("ucx://").rsplit(":", 1)
                ep = await ucxx.create_endpoint(host, int(port))
                for m in messages:
                    await ep.send(np.array(m, dtype=np.int64))

            server._call(malformed([9, 1], [1, 1, 5, 2]), 10)  # end before start
            server._call(malformed(list(range(100))), 10)  # longer than any batch's first message
            server._call(malformed([9, 0]), 10)  # an empty batch
            deadline = time.monotonic() + 10
            while server.errors < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server.errors == 3
            assert client.pull_many(endpoint, [(1, "target", 0, 8, dest[:8])])[0].tolist() == list(range(100, 108))
    finally:
        server.close()
        if client is not server:
            client.close()


PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n", "for i in range(10):", "return {", "The quick"]


async def _gen_all(address: str, prompts: list[str], n: int) -> list:
    async with AsyncClient(address, timeout_s=120) as client:
        return await asyncio.gather(*(client.generate(p, max_new_tokens=n) for p in prompts))


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_forced_migration_pulls_kv_and_stays_lossless(tiny_pair, transport: str) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair / "target"))
    refs = [hf_greedy(tiny_pair / "target", tok(p)["input_ids"], 40) for p in PROMPTS]
    cfg = deploy_config(tiny_pair, "pooled", 2, 2, max_batch=4)
    cfg.broker.policy = cfg.broker.policy.replace(migrate=True)
    cfg.kv_transport = transport
    # (every pull made: the tiny model recomputes a round's positions quicker than loopback moves
    # them, which tests/test_link_fit.py and tests/test_hosts.py cover; here the transports are tested)
    with Deployment(cfg, worker_changes={"kv_skip_slow_pulls": False}) as dep:
        outs = asyncio.run(_gen_all(dep.address, PROMPTS, 40))
        with Client(dep.address) as c:
            workers = c.status()["workers"]
    assert [o.token_ids for o in outs] == refs
    for role in ("draft", "target"):
        kv = [w["kv"] for w in workers if w["role"] == role]
        pulled = sum(k["pulled"] for k in kv)
        assert all(k["transport"] == {"ucx": "ucx", "shm": "shm", "shm+zmq": "shm+tcp"}.get(transport, "tcp") for k in kv)
        if transport == "shm+zmq":  # every worker shares this host: all pulls read files, none asks the network
            assert sum(k["routes"]["local"] for k in kv) == sum(k["pulls"] for k in kv)
            assert sum(k["routes"]["remote"] for k in kv) == 0
            # Same-host reads run at compute start, not on the prefetch thread: none overlaps compute.
            assert sum(k["overlap_s"] for k in kv) == 0 and sum(k["stall_s"] for k in kv) >= sum(k["pull_s"] for k in kv)
        assert sum(k["pulls"] for k in kv) > 10 and sum(k["pull_failures"] for k in kv) == 0
        # After its first round a request never recomputes: every later prefix arrives by pull.
        computed = sum(k["computed"] for k in kv)
        prompt_tokens = sum(len(tok(p)["input_ids"]) for p in PROMPTS)
        assert computed <= prompt_tokens, f"{role}: {computed} positions recomputed"
        assert pulled > computed


@pytest.mark.slow
def test_holder_killed_between_rounds_recomputes_and_output_is_unchanged(tiny_pair) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair / "target"))
    prompt = "while True:\n    line = f.readline()"
    ref = hf_greedy(tiny_pair / "target", tok(prompt)["input_ids"], 120)
    # Three workers a role: every worker a task of the request went to (its holders, and the one a
    # migrated round may be pulling into) is killed, and at least one of each role is left that
    # never saw the request, so what it holds after the kill it rebuilt from tokens.
    cfg = deploy_config(tiny_pair, "pooled", 3, 3, max_batch=4)
    cfg.broker.policy = cfg.broker.policy.replace(migrate=True)
    cfg.broker.liveness_s = 2.0
    cfg.broker.heartbeat_s = 0.5  # four beats per liveness window: a beat late on a loaded machine is no death
    cfg.kv_transport = "zmq"
    with Deployment(cfg) as dep:
        with Client(dep.address) as c:
            names = [w["name"] for w in c.status()["workers"]]
            stream = c.stream(prompt, max_new_tokens=120)
            first = next(stream)
            # Frozen, no worker moves the request on while the broker says who was given a task of
            # it (counted when sent: one still computing, or pulling its KV, is among them).
            for name in names:
                dep.kill(name, signal.SIGSTOP)
            frozen = c.status()["workers"]
            touched = sorted(w["name"] for w in frozen if any(w["batches"].values()))
            before = {w["name"]: w["kv"] for w in frozen}
            holders = {n for n, kv in before.items() if kv and kv["held_requests"]}
            survivors = sorted(set(names) - set(touched))
            assert holders <= set(touched) and {h.split("-")[0] for h in holders} == {"draft", "target"}, frozen
            assert {n.split("-")[0] for n in survivors} == {"draft", "target"}, frozen
            for name in touched:
                dep.kill(name)  # SIGKILL: a holder vanishes mid-request
            for name in survivors:
                dep.kill(name, signal.SIGCONT)
            rest = list(stream)
            final = rest[-1]
            # The request may finish before the broker's liveness check (2 s) declares them dead.
            deadline = time.monotonic() + 15
            while workers_lost(state := c.status()) < len(touched) and time.monotonic() < deadline:
                time.sleep(0.2)
    assert final.token_ids == ref and first.token_ids == ref[: len(first.token_ids)]
    assert workers_lost(state) == len(touched)
    # the lost KV was rebuilt from tokens by the survivors, after the kill: at least the prompt's
    rebuilt = {w["name"]: w["kv"]["computed"] - ((before.get(w["name"]) or {}).get("computed", 0))
               for w in state["workers"]}
    prompt_len = len(tok(prompt)["input_ids"])
    assert set(rebuilt) == set(survivors), rebuilt
    for role in ("draft", "target"):  # (a role's rebuild is one survivor's work, or shared by two)
        assert sum(n for name, n in rebuilt.items() if name.startswith(role)) >= prompt_len, rebuilt


def test_local_first_reads_same_host_files_and_asks_the_network_for_the_rest(tiny_pair) -> None:  # noqa: ANN001
    """shm+zmq: a same-host holder's file is read; a request whose file is missing (kept private,
    evicted), or a holder on another host, is asked over ZeroMQ; single-transport peers interoperate."""
    from nebula_flow.kv.shm import ShmTransport
    from nebula_flow.kv.transport import LocalFirstTransport

    model = load_model(tiny_pair / "target")
    holder, puller = KVStore(model), KVStore(model)
    server = make_transport("shm+zmq")
    client = LocalFirstTransport(ShmTransport(), ZmqTransport())
    plain_zmq, plain_shm = ZmqTransport(), ShmTransport()
    endpoint = server.serve("127.0.0.1", lambda rid, role, s, e: holder.snapshot(rid, s, e))
    holder.share_into(server.share_folder, "target")
    tokens = np.arange(1, 41, dtype=np.int64)
    try:
        shm_part, tcp_part = endpoint.split(";")
        assert shm_part.startswith("shm://") and tcp_part.startswith("tcp://")
        # Which pulls are copies from this host's memory (the worker runs those at compute start).
        elsewhere = f"shm:///nonexistent/{shm_part[-8:]};{tcp_part}"
        assert client.reads_locally(endpoint) and plain_shm.reads_locally(endpoint)
        assert not client.reads_locally(elsewhere) and not client.reads_locally(tcp_part)
        assert not plain_zmq.reads_locally(endpoint)
        for rid in (1, 2, 3, 4, 5):
            model([holder.prepare(rid, tokens)], [tokens[:-1].tolist()], [1])
        holder.publish([1, 2, 3, 4, 5])
        holder.caches[2].shared_path.unlink()  # rid 2's KV is private to the holder now
        puller.fetch_many("target", [(1, tokens, 39, 1, None), (2, tokens, 39, 2, None)], endpoint, client)
        assert client.routes == {"local": 1, "remote": 1} and puller.stats.pulls == 2
        # The holder on "another host": its folder is not visible here, so the network serves it.
        puller.fetch(3, "target", tokens, 39, elsewhere, client)
        assert client.routes == {"local": 1, "remote": 2}
        # Peers running one transport pick their part of the endpoint.
        puller.fetch(4, "target", tokens, 39, endpoint, plain_zmq)
        puller.fetch(5, "target", tokens, 39, endpoint, plain_shm)
        assert puller.stats.pulls == 5 and puller.stats.pull_failures == 0
        for rid in (1, 2, 3, 4, 5):
            assert torch.equal(puller.caches[rid].buf[:39], holder.caches[rid].buf[:39])
        # A shm-only endpoint with no file to read: nothing to ask over the network, recompute follows.
        puller.fetch(9, "target", tokens, 39, shm_part, client)
        assert puller.stats.pull_failures == 1 and client.routes == {"local": 1, "remote": 2}
    finally:
        for t in (server, client, plain_zmq, plain_shm):
            t.close()


def test_a_shared_cache_grown_inside_a_forward_still_publishes(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """A cache that outgrows its file during a forward gets a new file made in inference mode;
    publishing it afterwards (outside that mode) must work, and a peer that kept the old file
    mapped reads the new one; once the request is freed, the peer reads nothing and lets go."""
    from nebula_flow.kv.shm import PeerFiles, kv_path

    model = load_model(tiny_pair / "target")
    store = KVStore(model)
    store.share_into(tmp_path, "target")
    tokens = np.arange(1, 101, dtype=np.int64)
    path = str(kv_path(tmp_path, "target", 3))
    peer = PeerFiles()
    cache = store.prepare(3, tokens[:4])  # room for 64 positions
    model([cache], [tokens[:10].tolist()], [1])
    store.publish([3])
    dest = torch.empty((100, *cache.row_shape), dtype=cache.buf.dtype)
    assert peer.read(path, 3, 0, 10, dest[:10]).tolist() == tokens[:10].tolist()
    first_file = peer.maps[peer.names[path][0]]
    model([cache], [tokens[10:].tolist()], [1])  # 100 positions: grows inside the forward
    store.publish([3])
    assert first_file.head[4] == 1  # the old file says it no longer follows the cache
    assert peer.read(path, 3, 0, 100, dest).tolist() == tokens.tolist()
    assert torch.equal(dest, cache.buf[:100])
    assert peer.maps[peer.names[path][0]] is not first_file and len(peer.maps) == 1
    assert peer.mapped_bytes == peer.maps[peer.names[path][0]].nbytes
    # A peer's rolled-back and recomputed positions are read afresh from the same mapping.
    cache.truncate(50)
    model([cache], [[7] * 50], [1])
    store.publish([3])
    assert peer.read(path, 3, 40, 100, dest[40:]).tolist() == tokens[40:50].tolist() + [7] * 50
    assert torch.equal(dest[40:], cache.buf[40:100])
    store.free([3])  # its file goes to the pool: read as missing, under any name
    assert peer.read(path, 3, 0, 10, dest[:10]) is None and not peer.names
    store.pool.clear()  # deleted for good: the peer lets go of the mapping, and its memory
    assert peer.read(path, 3, 0, 10, dest[:10]) is None
    peer._sweep()
    assert not peer.maps and peer.mapped_bytes == 0


def test_a_finished_requests_file_is_recycled_and_never_read_as_another_request(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """A freed cache's file is kept by its holder and given to the next request that fits; a
    peer reads the new request through the mapping it already has, and never reads the old
    request's name (or the new one mid-copy) as the other request's KV."""
    from nebula_flow.kv.shm import PeerFiles, kv_path

    model = load_model(tiny_pair / "target")
    store = KVStore(model)
    store.share_into(tmp_path, "target")
    peer = PeerFiles()
    old, new = np.arange(1, 41, dtype=np.int64), np.arange(100, 140, dtype=np.int64)
    old_path, new_path = str(kv_path(tmp_path, "target", 1)), str(kv_path(tmp_path, "target", 2))
    cache = store.prepare(1, old)
    model([cache], [old.tolist()], [1])
    store.publish([1])
    dest = torch.empty((40, *cache.row_shape), dtype=cache.buf.dtype)
    assert peer.read(old_path, 1, 0, 40, dest).tolist() == old.tolist()
    first = peer.names[old_path][0]
    store.free([1])
    assert cache.buf.shape[0] == 0 and not cache.tokens  # the freed cache holds nothing any more
    assert [p.name for p in tmp_path.iterdir()] == ["target-pool-0.kv"]

    recycled = store.prepare(2, new)  # same size: it gets the pooled file
    assert store.stats.files_recycled == 1 and store.pool.entries == []
    assert peer.read(new_path, 2, 0, 1, dest[:1]) is None  # installed, but nothing published yet
    model([recycled], [new.tolist()], [1])
    store.publish([2])
    assert peer.read(old_path, 1, 0, 40, dest) is None  # the old name is gone ...
    assert peer.read(new_path, 1, 0, 40, dest) is None  # ... and the file is not request 1's
    assert peer.read(new_path, 2, 0, 40, dest).tolist() == new.tolist()
    assert torch.equal(dest, recycled.buf[:40])
    assert peer.names[new_path][0] == first and len(peer.maps) == 1  # the same mapping, pages in

    # A copy that races with the file's recycling reads as missing, not as the next request.
    from nebula_flow.kv import shm

    real_memmove = shm.ctypes.memmove

    def recycle_midway(*args):  # noqa: ANN002, ANN202
        store.free([2])
        store.prepare(3, new)
        return real_memmove(*args)

    shm.ctypes.memmove = recycle_midway
    try:
        assert peer.read(new_path, 2, 0, 40, dest) is None
    finally:
        shm.ctypes.memmove = real_memmove


def test_room_for_a_large_same_host_read_is_made_ahead_and_kept_until_its_batch(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """``make_room`` and ``prepare_reads`` (the prefetch thread, while the previous batch
    computes) make the cache a pull will fill and map the holder's file, pages in on both
    sides; eviction leaves the cache alone; the pull at compute start then only copies."""
    import resource

    from nebula_flow.kv.shm import ShmTransport

    model = load_model(tiny_pair / "target")
    holder, puller = KVStore(model), KVStore(model, max_bytes=0)  # a budget that evicts all it may
    server, client = ShmTransport(), ShmTransport()
    try:
        holder.share_into(server.share_folder, "target")
        puller.share_into(client.share_folder, "target")
        tokens = np.arange(1, 2001, dtype=np.int64) % 500
        cache = holder.prepare(5, tokens)
        model([cache], [tokens[:-1].tolist()], [1])
        holder.publish([5])
        endpoint = server.serve("127.0.0.1", None)
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        puller.make_room([(5, tokens, 1999, 5, None)])
        made = puller.caches[5]
        faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
        assert faulted >= 1999 * made.row_bytes // 4096 * 0.9, faulted  # its pages are in, one call
        assert made.length == 0 and made.buf.shape[0] >= 1999 and 5 in puller.pinned
        puller.evict(protect=set())
        assert puller.caches.get(5) is made  # pinned: its batch has not run yet
        puller.make_room([(5, tokens, 1999, 5, None)])  # held already: left as it is
        assert puller.caches[5] is made
        client.prepare_reads(endpoint, [(5, "target", 0, 1999)])  # the holder's file: mapped, pages in
        assert client.files.names  # (kept for the read)
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        puller.fetch_many("target", [(5, tokens, 1999, 5, None)], endpoint, client)
        assert puller.caches[5] is made and made.length == 1999 and torch.equal(made.buf[:1999], cache.buf[:1999])
        # the copy found the pages on both sides already in
        # (without prepare_reads, reading the holder's file alone faults once per 16 pages)
        assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0 < faulted // 16
        puller.unpin([5])
        puller.evict(protect=set())
        assert 5 not in puller.caches
    finally:
        server.close()
        client.close()


def test_a_file_made_inside_a_forward_is_reused_outside_one(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """A cache that grew inside a forward got its file there; recycled for the next request,
    that file is written outside inference mode (copies, pulls, growth) and inside (forwards)."""
    model = load_model(tiny_pair / "target")
    store = KVStore(model)
    store.share_into(tmp_path, "target")
    tokens = np.arange(1, 101, dtype=np.int64)
    cache = store.prepare(3, tokens[:4])  # room for 64 positions
    model([cache], [tokens.tolist()], [1])  # 100: a new file made inside the forward
    store.publish([3])
    store.free([3])
    nxt = store.prepare(4, tokens[:80])  # fits the pooled 128 rows
    assert store.stats.files_recycled == 1 and not nxt.buf.is_inference()
    nxt.reserve(300)  # grows outside inference mode: a copy into a new file
    nxt.buf[:1] = 0.0
    got = model([nxt], [tokens[:79].tolist()], [1])[0]
    store.publish([4])
    fresh = model.new_cache()
    assert torch.equal(got, model([fresh], [tokens[:79].tolist()], [1])[0])


def test_the_pool_size_is_a_setting_and_zero_keeps_no_file(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    model = load_model(tiny_pair / "target")
    tokens = np.arange(1, 41, dtype=np.int64)
    for pool_bytes, recycled in ((None, 1), (0, 0), (1 << 30, 1)):
        folder = tmp_path / str(pool_bytes)
        folder.mkdir()
        store = KVStore(model, max_bytes=64 << 20)
        store.share_into(folder, "target", pool_bytes)
        assert store.pool.max_bytes == (8 << 20 if pool_bytes is None else pool_bytes)
        store.prepare(1, tokens)
        store.free([1])
        store.prepare(2, tokens)
        assert store.stats.files_recycled == recycled
        assert sorted(p.name for p in folder.iterdir()) == ["target-2.kv"]  # (with 0: request 1's file deleted)


def test_the_pool_is_bounded_and_waits_before_reusing_a_file_a_network_peer_was_sent(tmp_path) -> None:  # noqa: ANN001
    """Pooled files stay within the pool's bytes (oldest deleted first); a file whose rows were
    just sent over the network is not reused until that send can no longer be accepted."""
    import time

    from nebula_flow.kv.cache import KVCache
    from nebula_flow.kv.shm import POOL_QUARANTINE_S, FilePool, kv_path

    def shared(rid: int, capacity: int, pool: FilePool) -> KVCache:
        cache = KVCache(2, 1, 4, capacity=capacity)
        cache.share(kv_path(tmp_path, "target", rid), rid, pool)
        return cache

    one = shared(0, 64, None).shared.nbytes
    pool = FilePool(tmp_path, "target", max_bytes=2 * one)
    caches = [shared(rid, 64, pool) for rid in (1, 2, 3)]
    caches[2].served_at = time.monotonic()  # rows of request 3 were just sent to a network peer
    for c in caches:
        c.release()
    assert pool.bytes == 2 * one and len(pool.entries) == 2  # request 1's file was deleted
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target-0.kv", "target-pool-1.kv", "target-pool-2.kv"]
    assert shared(4, 300, pool).shared.capacity == 300  # nothing that size pooled: a new file
    small = shared(5, 16, pool)  # fits in 64 rows; request 3's file is still in quarantine
    assert small.shared.capacity == 64 and small.shared.staged == small.shared_path and pool.reused == 1
    assert shared(6, 16, pool).shared.capacity == 16  # only the quarantined file is left
    pool.entries[0] = (time.monotonic() - 1, pool.entries[0][1])  # as if POOL_QUARANTINE_S had passed
    assert POOL_QUARANTINE_S > 2 and shared(7, 64, pool).shared.capacity == 64 and not pool.entries


def test_received_rows_land_byte_exact_and_a_reply_in_another_dtype_or_shape_is_refused() -> None:
    from nebula_flow import protocol
    from nebula_flow.kv.transport import _receive, host_view
    from nebula_flow.protocol import KvData, KvRows

    def reply(rows: torch.Tensor) -> KvRows:
        msg = KvData(1, [KvRows(np.arange(len(rows), dtype=np.int32), host_view(rows))])
        return protocol.decode([bytes(memoryview(f).cast("B")) for f in protocol.encode(msg)]).items[0]

    rows = torch.randn(3, 2, 8).to(torch.bfloat16)
    for dest in (torch.zeros(3, 2, 8, dtype=torch.bfloat16), torch.zeros(2, 8, 3, dtype=torch.bfloat16).permute(2, 0, 1)):
        assert _receive(reply(rows), 3, dest).tolist() == [0, 1, 2] and torch.equal(dest, rows)  # (contiguous or not)
    dest = torch.zeros(3, 2, 8, dtype=torch.bfloat16)
    assert _receive(reply(rows.to(torch.float16)), 3, dest) is None  # same width, another format
    assert _receive(reply(rows[:, :1]), 3, torch.zeros(3, 1, 4, dtype=torch.bfloat16)) is None  # shape
    assert _receive(reply(rows), 2, dest) is None and not dest.any()  # not the positions asked


def test_auto_transport_choice() -> None:
    from nebula_flow.kv.transport import resolve_transport

    assert resolve_transport("auto", "cpu") == "shm+zmq"
    assert resolve_transport("auto", "cpu", keys=True) == "zmq"  # CURVE: only ZeroMQ authenticates peers
    assert resolve_transport("shm", "cpu", keys=True) == "zmq" and resolve_transport("none", keys=True) == "none"
    has_ucx = __import__("importlib").util.find_spec("ucxx") is not None
    assert resolve_transport("auto", "cuda:0") == ("ucx" if has_ucx else "zmq")
    with pytest.raises(ValueError, match="unknown KV transport"):
        resolve_transport("rdma")
    with pytest.raises(ValueError, match="for CPU workers"):
        make_transport("shm+zmq", device="cuda")


def test_auto_falls_back_to_zeromq_when_ucx_is_installed_but_does_not_load(monkeypatch) -> None:  # noqa: ANN001
    import importlib.util
    import sys

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "ucxx" else real(name, *a))
    monkeypatch.setitem(sys.modules, "nebula_flow.kv.ucx", None)  # importing it raises ImportError
    transport = make_transport("auto", device="cuda")
    assert isinstance(transport, ZmqTransport)
    transport.close()
    with pytest.raises(ImportError):
        make_transport("ucx", device="cuda")  # asked for by name: say so, do not switch


def test_shared_memory_folders_of_dead_workers_are_removed_whatever_their_pid_says(tmp_path) -> None:  # noqa: ANN001
    """A folder is an orphan when no living worker holds its lock. Its name's pid is no guide
    across PID namespaces that share /dev/shm: a living worker's pid may not exist here, and a
    dead worker's pid may be another process's here."""
    import os
    import subprocess
    import sys

    from nebula_flow.kv.shm import ALIVE, PREFIX, STALE_S, remove_orphans

    holder_code = ("import sys; from pathlib import Path; from nebula_flow.kv.shm import hold_alive; "
                   "hold_alive(Path(sys.argv[1])); print('locked', flush=True); sys.stdin.read()")
    # a living worker whose pid means nothing here (another namespace's): kept
    alive = tmp_path / f"{PREFIX}999999999-abc"
    # a dead worker whose pid is a living process here (this test's): removed
    dead = tmp_path / f"{PREFIX}{os.getpid()}-def"
    # one that died before taking its lock, long ago (removed), and one being made now (kept)
    old_unlocked, new_unlocked = tmp_path / f"{PREFIX}1-old", tmp_path / f"{PREFIX}1-new"
    for folder in (alive, dead, old_unlocked, new_unlocked):
        folder.mkdir()
        (folder / "target-1.kv").write_bytes(b"x")
    os.utime(old_unlocked, (0, os.stat(old_unlocked).st_mtime - 2 * STALE_S))
    (dead / ALIVE).touch()  # (its worker held the lock; the kernel dropped it when it died)
    # one being made has its lock file only under a staged name until it holds the lock: kept
    (new_unlocked / f"{ALIVE}.12345").touch()
    holder = subprocess.Popen([sys.executable, "-c", holder_code, str(alive)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert sorted(remove_orphans(tmp_path)) == sorted([dead, old_unlocked])
        assert alive.exists() and new_unlocked.exists()
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert remove_orphans(tmp_path) == [alive]  # its holder has exited now


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_paced_raw_probe_measures_real_pulls(tmp_path, transport: str) -> None:  # noqa: ANN001
    """The probe bench-kv runs beside the system: real endpoints, paced pulls, JSON samples."""
    import json
    import subprocess
    import sys

    from nebula_flow.kv.probe import RawPair, paced_gbps

    out = tmp_path / "probe.json"
    subprocess.run([sys.executable, "-m", "nebula_flow.kv.probe", "--transport", transport, "--sizes", "8192,65536",
                    "--pace-ms", "5", "--duration-s", "1", "--out", str(out)], check=True, timeout=60)
    samples = {int(k): v for k, v in json.loads(out.read_text()).items()}
    assert set(samples) == {8192, 65536} and all(len(v) >= 5 and min(v) > 0 for v in samples.values())
    mid = paced_gbps(samples, 32768)
    assert min(paced_gbps(samples, 8192), paced_gbps(samples, 65536)) * 0.5 < mid
    pair = RawPair(transport, 4 * 65536)
    try:
        pair.dest.zero_()
        assert pair.gbps(65536, repeats=5) > 0
        assert torch.equal(pair.dest[:16], pair.rows[:16])  # the bytes really arrived
        assert not pair.dest[16:].any()
        # Spread: each pull the next 16 rows, through the whole buffer.
        assert pair.gbps(65536, repeats=4, spread=True) > 0 and torch.equal(pair.dest, pair.rows)
    finally:
        pair.close()


@pytest.mark.parametrize("transport", ["shm", pytest.param("ucx", marks=TRANSPORTS[-1].marks)])
def test_bench_starts_the_probe_and_stops_it(tmp_path, transport: str, monkeypatch) -> None:  # noqa: ANN001
    """bench-kv's probe beside a run: started before the block, pulling from its go (once past any
    library chatter) to its stop, then its samples written. (UCX once printed a warning before
    "ready" and hung this.) A probe stopped before its go measured nothing and still stops."""
    import json

    from nebula_flow.bench_kv import paced_probe

    monkeypatch.setenv("UCX_WARN_UNUSED_ENV_VARS", "y")  # UCX: its warning on stdout comes first

    out = tmp_path / "probe.json"
    t0 = time.monotonic()
    with paced_probe(transport, out) as probe:
        probe.go()
        time.sleep(1.0)  # (pulling for a second: the measurement's length, not a wait for an event)
        probe.stop()
        samples = json.loads(out.read_text())  # (written at the stop, not at the block's end)
    assert time.monotonic() - t0 < 60
    assert sum(len(v) for v in samples.values()) >= 10  # ~one pull per 20 ms
    idle = tmp_path / "never.json"
    with paced_probe(transport, idle) as probe:
        probe.proc.stdout.readline()  # (started, waiting for a go that never comes)
    assert probe.proc.returncode is not None
    assert not idle.exists() or sum(len(v) for v in json.loads(idle.read_text()).values()) == 0


def test_paced_bandwidth_interpolates_time_linearly_in_size() -> None:
    from nebula_flow.kv.probe import paced_gbps

    samples = {1000: [0.5e-3, 1.5e-3], 3000: [2e-3, 2e-3]}  # means: 1 ms and 2 ms
    assert paced_gbps(samples, 2000) == pytest.approx(2000 / 1.5e-3 / 1e9)
    assert paced_gbps(samples, 500) == pytest.approx(500 / 1e-3 / 1e9)  # below the range: nearest time
    assert paced_gbps(samples, 9000) == pytest.approx(3000 / 2e-3 / 1e9)  # above it: the largest size's rate


def test_a_full_shared_memory_folder_keeps_kv_private_instead_of_crashing(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    import errno
    import os

    from nebula_flow.kv.cache import KVCache
    from nebula_flow.kv.shm import kv_path

    path = kv_path(tmp_path, "target", 7)
    cache = KVCache(2, 1, 4, capacity=4)
    cache.share(path, 7)
    cache.buf[:2] = 1.0
    cache.tokens = [5, 6]
    assert cache.shared is not None and path.exists()

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    cache.reserve(100)  # growing needs a bigger file: there is no room
    assert cache.shared is None and not path.exists()  # peers cannot read a stale file; they recompute
    assert cache.buf.shape[0] >= 100 and torch.equal(cache.buf[:2], torch.ones_like(cache.buf[:2]))
    assert not list(tmp_path.iterdir())  # no temporary file left behind
    fresh = KVCache(2, 1, 4, capacity=4)
    fresh.share(kv_path(tmp_path, "target", 8), 8)
    assert fresh.shared is None and fresh.shared_path is None


def test_bench_kv_reports_stall_and_every_bandwidth_ratio(tiny_pair, monkeypatch) -> None:  # noqa: ANN001
    """The benchmark end to end on a short run (the paced probe must be up before it is timed)."""
    import json

    from click.testing import CliRunner

    from nebula_flow.bench_kv import kv_report
    from nebula_flow.cli import main

    monkeypatch.setenv("NEBULA_FLOW_CACHE", str(tiny_pair.parent))
    cfg = tiny_pair.parent / "bench-kv.toml"
    cfg.write_text(f'[draft]\nmodel = "{tiny_pair / "draft"}"\n[target]\nmodel = "{tiny_pair / "target"}"\n')
    res = CliRunner().invoke(main, ["bench-kv", "--config", str(cfg), "--transport", "shm", "--requests", "4",
                                    "--max-new-tokens", "12", "--repeats", "2", "--idle-probe-s", "1",
                                    "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["overlap"]["pulls"] > 0 and 0 <= out["overlap"]["stall_fraction"] < 1
    assert 0 < out["overlap"]["pull_on_cpu"] <= 1.1  # thread CPU time within the pulls' wall time
    # Two runs per mode, alternating order (A B B A); the report is their median.
    order = [line.split()[0] for line in res.stderr.splitlines() if "(1/2)" in line or "(2/2)" in line]
    assert order == ["overlap", "no_overlap", "no_overlap", "overlap"], res.stderr
    for key in ("overlap", "no_overlap"):
        rates = sorted(r["tokens_per_s"] for r in out[key]["runs"])
        assert len(rates) == 2 and out[key]["tokens_per_s"] == (rates[0] + rates[1]) / 2
    for key in ("bandwidth_ratio", "bandwidth_ratio_spread", "bandwidth_ratio_paced_idle", "bandwidth_ratio_paced_loaded"):
        assert out[key] > 0, key
    for run in out["overlap"]["runs"]:  # every exchange is in one size class, with what it asked for
        assert sum(c[0] for c in run["by_size"].values()) == run["transfers"]
        assert sum(c[1] for c in run["by_size"].values()) >= run["bytes_pulled"] > 0
    classes = out["by_size"]["classes"]
    assert classes and all(c["ratio"] == pytest.approx(c["system_gbps"] / c["raw_gbps"]) for c in classes.values())
    assert all(c["ratio_paced"] == pytest.approx(c["system_gbps"] / c["paced_gbps"]) for c in classes.values())
    assert out["by_size"]["size_matched_ratio_b2b"] > 0 and out["by_size"]["size_matched_ratio_paced"] > 0
    text = kv_report(out)  # what bench-kv prints without --json
    assert f"in-system {out['overlap']['system_gbps']:.2f} GB/s" in text
    assert f"would take {out['by_size']['size_matched_ratio_b2b']:.2f} (b2b)" in text
    assert f"data from memory {out['raw_spread_gbps_same_size']:.2f} GB/s" in text and "during the run" in text


def test_long_context_prompts_put_a_different_stretch_of_code_before_each_prompt(tiny_pair) -> None:  # noqa: ANN001
    """bench-kv --context-tokens: long prompts, so a migrated request's first pull is large."""
    from nebula_flow.bench import with_context
    from nebula_flow.tokenizer import TextCodec

    codec = TextCodec(tiny_pair / "target")
    prompts = with_context(["def f(x):", "class A:"], 200, tiny_pair / "target")
    assert prompts[0].endswith("\ndef f(x):") and prompts[1].endswith("\nclass A:")
    sizes = [len(codec.encode(p)) for p in prompts]
    assert all(180 <= n <= 240 for n in sizes), sizes  # about 200 tokens of context (cut, decoded, re-encoded)
    assert prompts[0][:200] != prompts[1][:200]
    assert with_context(["x"], 0, tiny_pair / "target") == ["x"]
