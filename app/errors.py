"""One error shape for every failure: ``{"error": {"type", "message"}}``, and one table from
error kind to HTTP status. A bad request never becomes a 500."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pool.errors import PoolError

log = logging.getLogger(__name__)

# Every error kind the API can answer with, and its status. Pool errors use their ``type``.
STATUS: dict[str, int] = {
    "invalid_image": 400,
    "empty_image": 400,
    "invalid_request": 400,
    "unauthorized": 401,
    "not_found": 404,
    "lease_not_found": 404,
    "feature_not_found": 404,
    "method_not_allowed": 405,
    "lease_expired": 410,
    "lease_released": 410,
    "stale_lease": 410,
    "pool_restarted": 410,
    "body_timeout": 408,
    "payload_too_large": 413,
    "image_too_large": 413,
    "too_many_images": 413,
    "tensor_too_large": 413,
    "id_conflict": 409,
    "feature_mismatch": 409,
    "unsupported_media_type": 415,
    "validation_error": 422,
    "queue_full": 429,
    "client_disconnected": 499,  # nginx's code: the client hung up before the answer
    "internal_error": 500,
    "invalid_tensor": 500,
    "cuda_error": 500,
    "pool_exhausted": 503,
    "lease_slots_exhausted": 503,  # every slot taken while bytes were free: --max-leases
    "not_ready": 503,
    "gpu_out_of_memory": 503,  # the batch failed alone; the service lives on
    "cuda_unavailable": 503,
}


# Requests turned away before any work, counted in featpool_rejected_total{reason}.
REJECTIONS = {
    "queue_full",
    "not_ready",
    "pool_exhausted",
    "lease_slots_exhausted",
    "payload_too_large",
    "body_timeout",
}


def count_rejection(request: Request, kind: str) -> None:
    if kind in REJECTIONS:
        request.app.state.metrics.rejected.labels(kind).inc()


# The header of a refusal that a retry shortly after may pass (429 queue full, 503 GPU out of
# memory, ...).
RETRY_AFTER = {"Retry-After": "1"}


class ApiError(Exception):
    def __init__(self, type_: str, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.type = type_
        self.message = message
        self.status = STATUS[type_]
        self.headers = headers


def error_response(type_: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"type": type_, "message": message}},
        status_code=STATUS.get(type_, 500),
        headers=headers,
    )


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(request: Request, e: ApiError) -> JSONResponse:
        count_rejection(request, e.type)
        return error_response(e.type, e.message, e.headers)

    @app.exception_handler(PoolError)
    async def _pool(request: Request, e: PoolError) -> JSONResponse:
        count_rejection(request, e.type)
        if STATUS.get(e.type, 500) >= 500:
            log.warning("pool error: %s", e)
        return error_response(e.type, str(e))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()]
        return error_response("validation_error", "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {
            404: "not_found",
            405: "method_not_allowed",
            413: "payload_too_large",
            401: "unauthorized",
        }.get(e.status_code, "invalid_request")
        resp = error_response(kind, str(e.detail))
        resp.status_code = e.status_code
        return resp

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, __: ClientDisconnect) -> JSONResponse:
        # The client closed the connection while sending its body: nothing was queued or
        # leased for it, and nobody reads this answer. Counted as a 4xx, not logged as a bug.
        return error_response("client_disconnected", "the client closed the connection")

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return error_response("internal_error", f"{type(e).__name__}: {e}")
