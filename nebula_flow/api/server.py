"""The gateway's server: uvicorn on uvloop in front of the ASGI application (``api/app.py``),
bound before anything else starts, drained on SIGTERM, gone when the deployment that started it is."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from nebula_flow.api.app import Gateway, build_app
from nebula_flow.listen import listening_socket
from nebula_flow.process import orphaned

log = logging.getLogger("nebula_flow.api")
ORPHAN_CHECK_S = 0.5  # how often the gateway checks that the deployment that started it is alive


def serve_api(gateway: Gateway, host: str, port: int, ready: Any = None, drain_s: float = 35.0) -> None:  # noqa: ANN401
    """Run the gateway until SIGINT/SIGTERM (uvicorn's handlers); ``ready(port)`` once it listens.
    Stopping, it takes no new connection and gives the requests in flight ``drain_s`` to finish
    (more than the broker's drain time, whose shutting-down errors then still reach the callers).

    It runs on uvloop and parses HTTP with httptools (what ``uvicorn[standard]`` picks): each token
    chunk of each stream is a few event-loop turns here, and on a host whose cores the workers use,
    the gateway's CPU per chunk is what serving through it costs (``docs/benchmarks.md``)."""
    import uvicorn
    import uvloop

    config = uvicorn.Config(build_app(gateway), host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=drain_s, lifespan="on", http="httptools")
    sock = listening_socket(host, port)  # (OSError: taken, or not this host's address)
    server = uvicorn.Server(config)

    async def leave_when_orphaned() -> None:
        # (the broker and the workers leave when the deployment that started them is gone; so must
        # the gateway, or a killed `serve` leaves it holding its port, answering 503 for ever)
        while not server.should_exit:
            if orphaned():
                log.warning("the deployment that started this gateway is gone: stopping")
                server.should_exit = True
            await asyncio.sleep(ORPHAN_CHECK_S)

    async def run() -> None:
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        watch = asyncio.ensure_future(leave_when_orphaned())
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started and ready is not None:
            ready(server.servers[0].sockets[0].getsockname()[1])
        await task
        watch.cancel()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # (the loop uvicorn.run would pick)
        runner.run(run())
