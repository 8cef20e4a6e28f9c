"""The gateway's request log (``nebula_flow/api/access_log.py``): a line for each request when its
answer ends, with what an operator needs to tell what happened."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from nebula_flow.api import access_log
from nebula_flow.api.access_log import AccessLog
from nebula_flow.api.errors import ApiError, error_response
from nebula_flow.deploy import Deployment
from tests.conftest import deploy_config


@pytest.fixture(scope="module")
def logged(tiny_pair):  # noqa: ANN001, ANN201
    """Colocated on one worker, its gateway logging every request."""
    with Deployment(deploy_config(tiny_pair, "colocated", 0, 1)) as dep:
        dep.start_api("127.0.0.1", 0, model_name="tiny", access_log="all")
        yield dep


def line_for(dep: Deployment, pattern: str, timeout_s: float = 10.0) -> str:
    """The gateway log's line matching ``pattern`` (the line is written once the answer has ended,
    which may be a moment after the client read it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [ln for ln in (dep.log_dir / "api.log").read_text().splitlines() if re.search(pattern, ln)]
        if found:
            return found[-1]
        assert time.monotonic() < deadline, f"no line matching {pattern!r} in:\n{dep.log_tail('api')}"
        time.sleep(0.05)


def test_each_request_gets_a_line_with_its_id_tokens_and_outcome(logged) -> None:  # noqa: ANN001
    client = openai.OpenAI(base_url=logged.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    done = client.completions.create(model="tiny", prompt="def fibonacci(n):", max_tokens=7, temperature=0,
                                     extra_body={"ignore_eos": True})
    req_id = done.id.removeprefix("cmpl-")
    line = line_for(logged, f"request {req_id}")
    assert re.search(r'127\.0\.0\.1:\d+ "POST /v1/completions" 200 in \d+\.\d{3} s: ', line), line
    assert f"{done.usage.prompt_tokens} prompt + 7 completion tokens, finish length" in line

    two = client.completions.create(model="tiny", prompt=["def f(x):", "import os"], max_tokens=3, temperature=0, n=2,
                                    extra_body={"ignore_eos": True})
    line = line_for(logged, f"request {two.id.removeprefix('cmpl-')}")  # (each prompt counted once, as in usage)
    assert f": request {two.id.removeprefix('cmpl-')}, 4 choices, {two.usage.prompt_tokens} prompt + 12 completion" in line

    events = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                                 temperature=0, stream=True))
    line = line_for(logged, f"request {events[0].id.removeprefix('chatcmpl-')}")
    assert re.search(r'"POST /v1/chat/completions" 200 in \S+ s \(first byte \S+ s\): request \w+, streamed, '
                     r"\d+ prompt \+ \d+ completion tokens, finish (stop|length)$", line), line

    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=7)
    line = line_for(logged, '"POST /v1/completions" 400')
    assert "(temperature): " in line and "request " not in line  # (refused before it reached the broker)

    assert httpx.get(logged.http_url + "/v1/embeddings").status_code == 404
    assert "not_found: Invalid URL (GET /v1/embeddings)" in line_for(logged, r'"GET /v1/embeddings" 404')
    assert httpx.get(logged.http_url + "/health").status_code == 200
    assert httpx.get(logged.http_url + "/v1/models").status_code == 200
    line_for(logged, r'"GET /v1/models" 200')
    assert '"GET /health"' not in (logged.log_dir / "api.log").read_text()  # (a probe that answers is not logged)


def test_a_client_that_leaves_mid_stream_is_logged_so(logged) -> None:  # noqa: ANN001
    body = {"model": "tiny", "prompt": "def forever():", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", logged.http_url + "/v1/completions", json=body, timeout=60) as res:
        first = next(res.iter_lines())
    req_id = re.search(r'"id":"cmpl-(\w+)"', first).group(1)
    line = line_for(logged, f"request {req_id}")
    assert '"POST /v1/completions" 200' in line and "streamed, the client left before the answer ended" in line


async def refuse(request: Request) -> JSONResponse:
    if request.query_params.get("ok"):
        return JSONResponse({})
    return error_response(ApiError(400, "no", param="temperature", code="invalid_value"), request)


def test_by_default_only_failures_are_logged_and_a_flood_of_them_is_capped(caplog) -> None:  # noqa: ANN001
    caplog.set_level(logging.INFO, logger="nebula_flow.api.access")
    app = AccessLog(Starlette(routes=[Route("/x", refuse)]))
    assert app.level == "errors"
    second = [100.0]
    app.cap.clock = lambda: second[0]

    async def ask(n: int, query: str = "") -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as http:
            for _ in range(n):
                await http.get("/x" + query)

    asyncio.run(ask(3, "?ok=1"))
    assert caplog.records == []
    asyncio.run(ask(access_log.ERRORS_PER_S + 5))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == access_log.ERRORS_PER_S
    assert all('"GET /x" 400' in ln and "invalid_value (temperature): no" in ln for ln in lines)
    second[0] += 1  # (the next second: lines again, the first saying how many were left out)
    asyncio.run(ask(1))
    assert caplog.records[-1].getMessage().endswith("[5 more not logged before this]")
    with pytest.raises(ValueError, match="one of off, errors, all"):
        AccessLog(app, "some")


def test_the_gateways_log_can_be_cut_under_it(logged) -> None:  # noqa: ANN001
    """logrotate's copytruncate: the gateway appends, so after its log is cut the next line is at the
    start of the file (written at the old offset, it would follow a hole of NUL bytes as long as the log was)."""
    assert httpx.get(logged.http_url + "/v1/nothing-here").status_code == 404
    line_for(logged, r'"GET /v1/nothing-here" 404')
    with open(logged.log_dir / "api.log", "r+b") as log:
        log.truncate(0)
    assert httpx.get(logged.http_url + "/v1/nothing-either").status_code == 404
    line_for(logged, r'"GET /v1/nothing-either" 404')
    assert (logged.log_dir / "api.log").read_bytes().startswith(b"20")  # (its timestamp: 2026-...)


async def broken(_request: Request) -> JSONResponse:
    raise RuntimeError("a bug")


def test_a_request_that_hits_a_bug_is_logged_with_it(caplog) -> None:  # noqa: ANN001
    caplog.set_level(logging.INFO, logger="nebula_flow.api.access")
    app = AccessLog(Starlette(routes=[Route("/bug", broken)]))

    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            return await http.get("/bug")

    assert asyncio.run(ask()).status_code == 500
    line = caplog.records[-1].getMessage()
    assert re.search(r'"GET /bug" 500 in \d+\.\d{3} s: internal error: RuntimeError: a bug$', line), line


def test_a_failed_request_is_one_story_across_the_gateways_brokers_and_workers_logs(logged) -> None:  # noqa: ANN001
    """A request whose rules leave no token (the one id allowed, "ith", is a bad word) fails at the
    worker: the gateway's line names the broker's request id, the broker's line that id beside the
    number workers know the request by, and the worker's line that number."""
    res = httpx.post(logged.http_url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 5, "allowed_token_ids": [445], "bad_words": ["ith"]})
    assert res.status_code == 500 and "no token is allowed" in res.json()["error"]["message"]
    line = line_for(logged, '"POST /v1/completions" 500')
    req_id = re.search(r"request (\w+), worker_error: the request failed: .*no token is allowed", line).group(1)
    broker = re.search(rf"request {req_id} \(rid (\d+)\) failed after 0 output tokens: worker_error: .*no token is allowed",
                       (logged.log_dir / "broker.log").read_text())
    assert broker is not None, logged.log_tail("broker")
    workers = [p.read_text() for p in logged.log_dir.glob("*.log") if p.stem not in ("api", "broker")]
    assert any(f"request {broker.group(1)}'s" in text for text in workers), workers
