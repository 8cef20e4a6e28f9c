"""The choices of one answer (``n``, a batch of prompts), each a request of its own at the broker,
read as one stream: every choice is sampled on its own, so each follows the target's distribution
exactly, as a single request does, and the broker batches them like any other requests.

All or nothing: if the broker refuses one choice (its admission limit, a bad prompt), the others
are cancelled and the caller gets the refusal; a caller that goes away cancels them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

from nebula_flow.client import Chunk, Completion

Item = Chunk | Completion


async def close_all(streams: list[AsyncIterator[Item]]) -> None:
    """Close every stream: a request not finished yet is cancelled at the broker."""
    for s in streams:
        with contextlib.suppress(Exception):
            await s.aclose()


async def heads(streams: list[AsyncIterator[Item]]) -> list[Item]:
    """Each stream's first item (its admission, or a refusal, which is raised); on any failure,
    or if the caller is cancelled, every stream is closed."""
    if len(streams) == 1:  # (the usual case: no task of its own)
        try:
            return [await anext(streams[0])]
        except BaseException:
            await close_all(streams)
            raise
    tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_all(streams)
        raise


async def merged(first: list[Item], streams: list[AsyncIterator[Item]]) -> AsyncIterator[tuple[int, Item]]:
    """``(choice, item)`` from every stream as its items come (each stream's ``first`` item first),
    until each has ended with its ``Completion``; a failure of one is raised, and closing this
    generator, or a failure, closes every stream."""
    if len(streams) == 1:
        item = first[0]
        try:
            yield 0, item
            while not isinstance(item, Completion):
                item = await anext(streams[0])
                yield 0, item
        finally:
            await close_all(streams)
        return
    queue: asyncio.Queue[tuple[int, Item | Exception]] = asyncio.Queue()

    async def pump(i: int) -> None:
        item = first[i]
        try:
            queue.put_nowait((i, item))
            while not isinstance(item, Completion):
                item = await anext(streams[i])
                queue.put_nowait((i, item))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
    try:
        running = len(streams)
        while running:
            i, got = await queue.get()
            if isinstance(got, Exception):
                raise got
            running -= isinstance(got, Completion)
            yield i, got
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_all(streams)


async def completions(items: AsyncIterator[tuple[int, Item]], count: int) -> list[Completion]:
    """The ``count`` choices' ``Completion``s, in the order of their indexes."""
    outs: list[Completion | None] = [None] * count
    async for i, item in items:
        if isinstance(item, Completion):
            outs[i] = item
    return [out for out in outs if out is not None]


async def prompt_only(items: AsyncIterator[tuple[int, Item]]) -> AsyncIterator[tuple[int, Item]]:
    """Echo with ``max_tokens`` 0 (as vLLM's): each choice's items without the token its request made
    (the prompt's text and log-probabilities, which come with the first item, stay), and its end
    ``length``: no token was to be made. Closing this closes ``items``."""
    try:
        async for i, item in items:
            if isinstance(item, Completion):
                item = dataclasses.replace(item, text="", token_ids=[], finish_reason="length", rounds=0,
                                           tokens_per_round=[], chunk_tokens=[], chunk_times_s=[],
                                           logprobs=None if item.logprobs is None else [])
            else:
                item = dataclasses.replace(item, text="", token_ids=[], logprobs=None)
            yield i, item
    finally:
        await items.aclose()
