"""The gateway's CPU per streamed chunk: a chat stream's events as server-sent events, against the
same events reshaped into the Responses API's (``api/response_items.ResponseStream``).

    PYTHONPATH=. .venv/bin/python tools/bench_responses.py [--chunks 20000] [--repeats 5]

Both sides start from the chat pipeline's event dicts (``Shaper.chunk``, one chunk of a few tokens'
text each, as the broker commits them), so the difference is what reshaping costs per chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from nebula_flow.api.app import _sse
from nebula_flow.api.response import Shaper
from nebula_flow.api.response_items import ResponseShaper, ResponseStream
from nebula_flow.api.responses import ResponseStore, parse


def events(count: int) -> list:
    shaper = Shaper("0" * 32, "model", chat=True)
    usage = {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": count, "total_tokens": 30 + count}}
    return [shaper.chunk(None, role=True), *(shaper.chunk(" word" * 3) for _ in range(count)),
            shaper.chunk(None, "stop"), usage, "[DONE]"]


async def drain(stream) -> int:  # noqa: ANN001
    return sum([len(b) async for b in stream])


async def source(items: list):  # noqa: ANN201
    for item in items:
        yield item


def chat_sse(items: list) -> float:
    t = time.process_time()
    asyncio.run(drain(_sse(source(items))))
    return time.process_time() - t


def responses(items: list) -> float:
    ask = parse({"model": "model", "input": "hi"}, ResponseStore())
    t = time.process_time()
    asyncio.run(drain(ResponseStream(ResponseShaper(ask, "model", "0" * 32), lambda _: None).events(source(items))))
    return time.process_time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    items = events(args.chunks)
    times: dict[str, list[float]] = {"chat": [], "responses": []}
    for _ in range(args.repeats):  # (in turns: this machine's speed drifts)
        times["chat"].append(chat_sse(items))
        times["responses"].append(responses(items))
    chat, resp = (statistics.median(times[k]) / args.chunks * 1e6 for k in ("chat", "responses"))
    print(f"chat completions events: {chat:.2f} us a chunk; responses events: {resp:.2f} us a chunk "
          f"({resp / chat:.2f}x; medians of {args.repeats} passes of {args.chunks} chunks)")


if __name__ == "__main__":
    main()
