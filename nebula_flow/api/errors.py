"""The gateway's errors, answered in OpenAI's shape."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from nebula_flow.api.access_log import entry_of
from nebula_flow.params import did_you_mean


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def error_response(exc: ApiError, request: Request | None = None) -> JSONResponse:
    """``exc`` answered in OpenAI's shape (and noted for the request log, ``api/access_log.py``)."""
    if request is not None and (logged := entry_of(request.scope)) is not None:
        logged.failed(exc)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def no_such_model(asked: str, served: str) -> ApiError:
    """A request for another model than the one served (a 404, as OpenAI's)."""
    return ApiError(404, f"the model {asked[:200]!r} does not exist; this server serves {served!r}", param="model",
                    code="model_not_found")


def fields_known(body: Any, known: set[str] | frozenset[str]) -> dict[str, Any]:  # noqa: ANN401
    """``body`` if it is a JSON object of ``known`` fields only (OpenAI refuses others too), else a 400."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if unknown := sorted(set(body) - known):
        raise ApiError(400, f"unrecognized request argument(s): {', '.join(map(str, unknown))[:200]}"
                       + did_you_mean(unknown, known, 0.75), param=str(unknown[0])[:64], code="unknown_parameter")
    return body


async def unrouted(request: Request, exc: Any) -> JSONResponse:  # noqa: ANN401
    """A path this gateway does not serve (404) or a method its path does not take (405), answered
    in OpenAI's shape as every other error (Starlette's own is plain text, which the ``openai``
    client shows as a bare ``Error code: 404``), naming what is served."""
    asked = f"{request.method} {request.url.path[:200]}"
    if exc.status_code == 405:
        allowed = ", ".join(sorted(filter(None, (exc.headers or {}).get("Allow", "").split(", "))))  # (a set's order)
        error = ApiError(405, f"{asked}: this path takes {allowed or 'other methods'}", code="method_not_allowed",
                         headers={"Allow": allowed} if allowed else None)
    elif exc.status_code == 404:
        paths = ", ".join(route.path.replace(":path", "") for route in request.app.routes)
        error = ApiError(404, f"Invalid URL ({asked}): this server serves {paths}", code="not_found")
    else:
        error = ApiError(exc.status_code, str(exc.detail), headers=exc.headers)
    return error_response(error, request)
