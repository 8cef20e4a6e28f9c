"""One blocking ``Client`` shared by threads, and streams of one thread read in turns. Both hung:
every caller read the one socket and dropped the messages of requests not its own (as a late
message of an abandoned request), so two of four threads' requests waited out their whole timeout
(a ZeroMQ socket is not thread-safe either). Now each thread has its own connection, and a
thread's messages for another of its streams wait in that stream's mailbox. An ``AsyncClient``
serves the event loop it is used on, one after another. A process forked after a ``Client`` was
made (multiprocessing) opens connections of its own. And a request id used again for another
request is that request, not a retry of the first."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import pytest

from nebula_flow.client import AsyncClient, Client, Completion
from nebula_flow.deploy import Deployment
from tests.conftest import deploy_config, hf_greedy

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]


@pytest.fixture(scope="module")
def deployment(tiny_pair):  # noqa: ANN001, ANN201
    with Deployment(deploy_config(tiny_pair, "pooled", 1, 1)) as dep:
        yield dep


def test_threads_share_one_client(deployment, tiny_pair) -> None:  # noqa: ANN001
    with Client(deployment.address, timeout_s=30) as client, ThreadPoolExecutor(4) as pool:
        def run(prompt: list[int]) -> list[int]:
            assert client.status()["mode"] == "pooled"  # (a STATE among the others' TOKENS: this thread's)
            return client.generate(token_ids=prompt, max_new_tokens=10, ignore_eos=True).token_ids

        outs = list(pool.map(run, PROMPTS * 2))
        assert len(client._opened) >= 3  # (the threads did run side by side, each on its own connection)
    assert outs == [hf_greedy(tiny_pair / "target", p, 10) for p in PROMPTS * 2]


def test_streams_of_one_thread_read_in_turns(deployment, tiny_pair) -> None:  # noqa: ANN001
    with Client(deployment.address, timeout_s=30) as client:
        streams = [client.stream(token_ids=p, max_new_tokens=10, ignore_eos=True) for p in PROMPTS[:3]]
        done, pieces = {}, {i: [] for i in range(3)}
        for items in itertools.zip_longest(*streams):
            for i, item in enumerate(items):
                if isinstance(item, Completion):
                    done[i] = item.token_ids
                elif item is not None:
                    pieces[i].extend(item.token_ids)
        assert client.tokenize(token_ids=[5, 6]).token_ids == [5, 6]  # (after them: nothing left over)
        assert client.status()["pool"] == 0
    want = [hf_greedy(tiny_pair / "target", p, 10) for p in PROMPTS[:3]]
    assert [done[i] for i in range(3)] == want and [pieces[i] for i in range(3)] == want


def test_an_async_client_serves_one_event_loop_after_another(deployment, tiny_pair) -> None:  # noqa: ANN001
    """A module-level AsyncClient used by `asyncio.run` twice: its readers ended with the first loop,
    and every request of the second waited out its timeout in silence."""
    import asyncio

    client = AsyncClient(deployment.address, timeout_s=30)

    async def ask() -> list[int]:
        return (await client.generate(token_ids=PROMPTS[0], max_new_tokens=6, ignore_eos=True)).token_ids

    outs = [asyncio.run(ask()) for _ in range(2)]
    asyncio.run(client.close())
    assert outs == [hf_greedy(tiny_pair / "target", PROMPTS[0], 6)] * 2


def test_a_forked_child_uses_the_parents_client(deployment, tiny_pair) -> None:  # noqa: ANN001
    """multiprocessing (fork) workers calling a Client made before the fork: they used the parent's
    sockets and hung until killed. A child now opens connections of its own."""
    import multiprocessing

    with Client(deployment.address, timeout_s=30) as client:
        assert client.generate(token_ids=PROMPTS[0], max_new_tokens=6, ignore_eos=True).token_ids  # (parent's open)
        global _FORKED
        _FORKED = client
        with multiprocessing.get_context("fork").Pool(2) as pool:
            outs = pool.map_async(_generate_in_child, PROMPTS[:2]).get(timeout=60)  # (they hung for ever)
        assert client.status()["pool"] == 0  # (the parent's connection still works)
    assert outs == [hf_greedy(tiny_pair / "target", p, 6) for p in PROMPTS[:2]]


_FORKED: Client | None = None


def _generate_in_child(prompt: list[int]) -> list[int]:
    return _FORKED.generate(token_ids=prompt, max_new_tokens=6, ignore_eos=True).token_ids


def test_an_id_used_again_for_another_request_is_that_request(deployment, tiny_pair) -> None:  # noqa: ANN001
    """A client that gave two requests the same id (a job id, say) got the first one's answer back
    for the second, as if it were a retry. A retry (the same request again) still re-attaches or
    replays; another request under a finished one's id runs; under a running one's it is refused."""
    from nebula_flow.client import RequestError

    with Client(deployment.address, timeout_s=30) as client:
        first = client.generate(token_ids=PROMPTS[0], max_new_tokens=6, ignore_eos=True, request_id="job-1")
        replayed = client.status()["counters"].get("requests_replayed", 0)
        assert client.generate(token_ids=PROMPTS[0], max_new_tokens=6, ignore_eos=True,
                               request_id="job-1").token_ids == first.token_ids
        assert client.status()["counters"]["requests_replayed"] == replayed + 1
        other = client.generate(token_ids=PROMPTS[1], max_new_tokens=8, ignore_eos=True, request_id="job-1")
        running = client.stream(token_ids=PROMPTS[2], max_new_tokens=200, ignore_eos=True, request_id="job-2")
        next(running)
        with pytest.raises(RequestError, match="request 'job-2' is running with another prompt or parameters"):
            client.generate(token_ids=PROMPTS[3], max_new_tokens=4, request_id="job-2")
        running.close()
    assert first.token_ids == hf_greedy(tiny_pair / "target", PROMPTS[0], 6)
    assert other.token_ids == hf_greedy(tiny_pair / "target", PROMPTS[1], 8)
