"""HTTP routes. They only parse, check and translate: the work is behind the EngineClient
(app/engine_client.py). They import neither torch nor the engine nor the pool, so that HTTP
front processes can serve them (tests/test_entrance.py checks).

The encode route is the entrance: it takes an admission permit (app/admission.py) for its
images before parsing any header, parses the headers off the event loop, adds their decoded
bytes to the permit, and only then hands the images to the engine."""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from app.admission import Admission, BoundedExecutor
from app.engine_client import (
    EncodeOptions,
    EngineClient,
    EngineDeadError,
    FeatureQuery,
    ImageIn,
    engine_client,
)
from app.errors import ApiError
from app.featindex import check_id, content_digest, scope_of
from app.imaging import (
    Header,
    check_content_type,
    image_limits,
    inspect,
    media_type,
    request_decoded_bytes,
)
from app.metrics import HttpMetrics, Metrics
from app.settings import Settings
from pool.descriptor import MIN_TTL_S, EncodeResponse, FeatureInfo, LeaseDescriptor


def _api_keys(settings: Settings) -> list[str]:
    keys = [settings.api_key] if settings.api_key is not None else []
    return [k.get_secret_value() for k in [*keys, *settings.api_keys]]


async def check_api_key(request: Request) -> None:
    # async: FastAPI runs a plain def dependency on a worker thread, one hop per request (15 %
    # of a front's interpreter time at ~450 requests/s in a py-spy profile)
    keys = _api_keys(request.app.state.settings)
    if not keys:
        return
    given = request.headers.get("authorization", "").encode()
    # Compare with every key (no early exit), so the time taken does not say which matched.
    matches = [hmac.compare_digest(given, f"Bearer {k}".encode()) for k in keys]
    if not any(matches):
        raise ApiError("unauthorized", "missing or wrong 'Authorization: Bearer <api key>'")


def caller_scope(request: Request) -> str:
    """The feature-cache scope of an authenticated caller: one per API key ("" without)."""
    if not _api_keys(request.app.state.settings):
        return ""
    return scope_of(request.headers.get("authorization", "").removeprefix("Bearer "))


class RenewIn(BaseModel):
    # Strict: a number, as the socket protocol takes it (lax mode read true as 1 s, "5" as 5).
    model_config = ConfigDict(strict=True)

    ttl_s: float | None = Field(
        None,
        ge=MIN_TTL_S,
        description=f"new deadline from now, at least {MIN_TTL_S} s; default TTL if unset",
    )


TtlQuery = Annotated[
    float | None,
    Query(ge=MIN_TTL_S, description=f"lease deadline in seconds, at least {MIN_TTL_S}"),
]
PooledQuery = Annotated[
    bool,
    Query(description="publish the mean over tokens, shape [D], instead of every token, [T, D]"),
]
IdQuery = Annotated[
    str | None,
    Query(
        description="a name of your own for the image's features (one image per request; "
        "multipart: one 'id' field per image), usable in place of the hash in /v1/features",
    ),
]
ShapeQuery = Annotated[
    str | None,
    Query(
        pattern=r"^[0-9]{1,9}(,[0-9]{1,9}){0,3}$",
        description="the shape you expect, e.g. 196,768: refused (409) if it disagrees",
    ),
]
DtypeQuery = Annotated[
    Literal["float32", "bfloat16", "float16"] | None,
    Query(description="dtype of the published features; default: the encoder's"),
]

# Every process that answers HTTP serves these three; only the GPU process serves /metrics.
encode_router = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
ops = APIRouter()  # health: every process that answers HTTP
metrics_router = APIRouter()  # /metrics: the GPU process, which adds up the fronts' metrics


# The route reads its body itself (it streams and limits it), so FastAPI cannot describe it.
ENCODE_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["image"],
                    "properties": {
                        "image": {
                            "type": "array",
                            "minItems": 1,
                            "items": {"type": "string", "format": "binary"},
                        }
                    },
                }
            },
            **{
                ct: {"schema": {"type": "string", "format": "binary"}}
                for ct in ("image/jpeg", "image/png", "image/webp", "application/octet-stream")
            },
        },
    }
}


@encode_router.post(
    "/encode",
    response_model=EncodeResponse,
    summary="Encode images into pooled features",
    openapi_extra=ENCODE_BODY,
    responses={400: {}, 413: {}, 415: {}, 422: {}, 429: {}, 503: {}},
)
async def encode(
    request: Request,
    ttl_s: TtlQuery = None,
    pooled: PooledQuery = False,
    dtype: DtypeQuery = None,
    id: IdQuery = None,
) -> EncodeResponse:
    """Multipart with one or more ``image`` parts, or a raw image body. Returns one lease per
    image, in order. Images whose features are still in the pool (same bytes, same encoder)
    are not encoded again: their lease holds a copy of those features (``cached``)."""
    s: Settings = request.app.state.settings
    ctype = request.headers.get("content-type", "")
    ids: list[str | None] | None = None
    if media_type(ctype) == "multipart/form-data":
        images, form_ids = await _multipart_images(request, s)
        if form_ids:
            if id is not None:
                raise ApiError("validation_error", "give ids as ?id= or as 'id' fields, not both")
            if len(form_ids) != len(images):
                raise ApiError(
                    "validation_error",
                    f"{len(form_ids)} 'id' fields for {len(images)} images: give one per image",
                )
            ids = list(form_ids)
    else:
        check_content_type(ctype)
        images = [("image", await request.body())]
    if id is not None:
        if len(images) != 1:
            raise ApiError("validation_error", "?id= names one image; use 'id' fields for more")
        ids = [id]
    for i in ids or []:
        check_id(i or "")
    client = engine_client(request)
    options = EncodeOptions(
        ttl_s=ttl_s,
        pooled=pooled,
        dtype=dtype,
        scope=caller_scope(request),
        ids=tuple(ids) if ids is not None else None,
    )
    return EncodeResponse(items=await admit_and_encode(request, client, images, options))


async def admit_and_encode(
    request: Request,
    client: EngineClient,
    images: Sequence[tuple[str, bytes]],
    options: EncodeOptions,
) -> list[LeaseDescriptor]:
    """The permit first (images), then the headers off the event loop, then the permit's
    decoded bytes, then the engine; the permit is held until the engine is done."""
    s: Settings = request.app.state.settings
    admission: Admission = request.app.state.admission
    inspector: BoundedExecutor = request.app.state.inspector
    metrics: HttpMetrics = request.app.state.metrics
    admitted = False
    try:
        with admission.try_acquire(len(images)) as permit:
            inspected = await inspector.run(_inspect_all, images, s)
            headers = [h for h, _ in inspected]
            permit.grow(request_decoded_bytes(headers, s.max_request_decoded_bytes))
            admitted = True
            return await client.encode(
                [
                    ImageIn(label, data, h, digest)
                    for (label, data), (h, digest) in zip(images, inspected, strict=True)
                ],
                options,
            )
    except ApiError as e:
        # Refused for want of room, here or (behind a front) by the GPU process's own permit;
        # or refused at the header (not an image, over a limit) before the engine saw it.
        if e.type == "queue_full":
            metrics.admission.labels("refused").inc(len(images))
            admitted = False
        elif not admitted:
            metrics.admission.labels("invalid").inc(len(images))
        raise
    finally:
        if admitted:
            metrics.admission.labels("admitted").inc(len(images))


def _inspect_all(images: Sequence[tuple[str, bytes]], s: Settings) -> list[tuple[Header, bytes]]:
    """On the inspector's threads: one hop per request, not per image. Each image's header,
    and its content digest: SHA-256 of a ~200 KB photo takes ~0.13 ms, which here runs beside
    the event loop (hashlib lets go of the interpreter lock) instead of on it."""
    limits = image_limits(s)
    return [(inspect(d, **limits, label=lb), content_digest(d)) for lb, d in images]


async def _multipart_images(
    request: Request, s: Settings
) -> tuple[list[tuple[str, bytes]], list[str]]:
    try:
        form = await request.form(
            max_files=s.max_images_per_request,
            max_fields=32 + s.max_images_per_request,  # an 'id' field per image
            max_part_size=s.max_image_bytes,
        )
    except (MultiPartException, HTTPException) as e:
        # Starlette reports multipart limits as a 400 carrying the parser's message.
        message = str(e.detail if isinstance(e, HTTPException) else e.message)
        kind = (
            "too_many_images"
            if "Too many files" in message
            else "image_too_large"
            if "exceeded maximum size" in message
            else "invalid_request"
        )
        raise ApiError(kind, f"bad multipart body: {message}") from None
    try:
        parts = form.getlist("image")
        if not parts:
            raise ApiError(
                "validation_error",
                "the multipart body has no 'image' part (send -F image=@file.jpg)",
            )
        images = []
        for i, part in enumerate(parts):
            if not isinstance(part, UploadFile):
                raise ApiError("invalid_request", f"part 'image' #{i} is a field, not a file")
            check_content_type(part.content_type, f"image #{i} ({part.filename})")
            images.append((f"image #{i} ({part.filename})", await part.read()))
        ids = form.getlist("id")
        if not all(isinstance(i, str) for i in ids):
            raise ApiError("invalid_request", "an 'id' part is a file, not a field")
        return images, [str(i) for i in ids]
    finally:
        await form.close()


@v1.get("/leases/{lease_id}", response_model=LeaseDescriptor, responses={404: {}, 410: {}})
async def get_lease(request: Request, lease_id: str) -> LeaseDescriptor:
    return await engine_client(request).lease(lease_id)


@v1.get(
    "/leases/{lease_id}/tensor",
    responses={
        200: {
            "content": {"application/octet-stream": {}},
            "description": "safetensors file with one tensor 'features'",
        },
        404: {},
        410: {},
    },
)
async def get_tensor(request: Request, lease_id: str) -> Response:
    """The features as a safetensors file (one tensor named ``features``)."""
    body = await engine_client(request).tensor(lease_id)
    disposition = f'attachment; filename="{lease_id}.safetensors"'
    return Response(
        body, media_type="application/octet-stream", headers={"Content-Disposition": disposition}
    )


@v1.post(
    "/leases/{lease_id}/renew",
    response_model=LeaseDescriptor,
    responses={400: {}, 404: {}, 410: {}},
)
async def renew_lease(
    request: Request, lease_id: str, body: RenewIn | None = None
) -> LeaseDescriptor:
    return await engine_client(request).renew(lease_id, body.ttl_s if body else None)


@v1.delete("/leases/{lease_id}", status_code=204, responses={404: {}, 410: {}})
async def delete_lease(request: Request, lease_id: str) -> Response:
    await engine_client(request).release(lease_id)
    return Response(status_code=204)


def _query(request: Request, ref: str, shape: str | None, dtype: str | None) -> FeatureQuery:
    dims = tuple(int(x) for x in shape.split(",")) if shape is not None else None
    return FeatureQuery(caller_scope(request), ref, dims, dtype)


@v1.get("/features/{ref}", response_model=FeatureInfo, responses={404: {}, 409: {}})
async def get_features(
    request: Request, ref: str, shape: ShapeQuery = None, dtype: DtypeQuery = None
) -> FeatureInfo:
    """Whether features named by their hash or by your id are resident; their shape and
    dtype. No lease is made."""
    return await engine_client(request).features(_query(request, ref, shape, dtype))


@v1.post(
    "/features/{ref}/lease",
    response_model=LeaseDescriptor,
    responses={404: {}, 409: {}, 503: {}},
)
async def lease_features(
    request: Request,
    ref: str,
    ttl_s: TtlQuery = None,
    shape: ShapeQuery = None,
    dtype: DtypeQuery = None,
) -> LeaseDescriptor:
    """A new lease on resident features named by their hash or by your id, without encoding:
    the lease holds a copy of them (device-to-device on the GPU tier). 404 if they are no
    longer resident; 409 if they disagree with the ``shape``/``dtype`` you expect."""
    return await engine_client(request).lease_features(_query(request, ref, shape, dtype), ttl_s)


@v1.get("/pool")
async def pool_info(request: Request) -> dict[str, Any]:
    return await engine_client(request).pool_info()


@ops.get("/health/live")
@ops.head("/health/live", include_in_schema=False)  # HEAD: load balancers' probes
async def live(request: Request) -> JSONResponse:
    try:
        await engine_client(request).check_health()
    except EngineDeadError as e:
        return JSONResponse({"status": "dead", "reason": str(e)}, status_code=503)
    return JSONResponse({"status": "alive"})


@ops.get("/health/ready")
@ops.head("/health/ready", include_in_schema=False)
async def ready(request: Request) -> JSONResponse:
    h = await engine_client(request).health()
    if not h.ready or h.dead_reason:
        return JSONResponse({"status": "not_ready"}, status_code=503)
    return JSONResponse({"status": "ready"})


@metrics_router.get("/metrics", response_class=PlainTextResponse)  # documented as text/plain
@metrics_router.head("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    m: Metrics = request.app.state.metrics
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
