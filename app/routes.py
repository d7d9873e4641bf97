"""HTTP routes. They only parse, check and translate: the work is in the engine and the pool."""

from __future__ import annotations

import hmac
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from safetensors.torch import save
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from app.engine import Engine
from app.errors import ApiError
from app.imaging import check_content_type
from app.jobs import EncodeFn
from app.metrics import Metrics
from app.settings import Settings
from pool.descriptor import EncodeResponse, LeaseDescriptor
from pool.featurepool import FeaturePool


def engine(request: Request) -> Engine:
    return request.app.state.engine  # type: ignore[no-any-return]


def pool(request: Request) -> FeaturePool:
    p = engine(request).pool
    if p is None:
        raise ApiError("not_ready", "the pool is not built yet")
    return p


def check_api_key(request: Request) -> None:
    key = request.app.state.settings.api_key
    if key is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key.get_secret_value()}".encode()):
        raise ApiError("unauthorized", "missing or wrong 'Authorization: Bearer <api key>'")


class RenewIn(BaseModel):
    ttl_s: float | None = Field(
        None, gt=0, description="new deadline from now; default TTL if unset"
    )


TtlQuery = Annotated[float | None, Query(gt=0, description="lease deadline in seconds")]
PooledQuery = Annotated[
    bool,
    Query(description="publish the mean over tokens, shape [D], instead of every token, [T, D]"),
]
DtypeQuery = Annotated[
    Literal["float32", "bfloat16", "float16"] | None,
    Query(description="dtype of the published features; default: the encoder's"),
]

# The encode route on its own router: HTTP front processes serve it and proxy the rest.
encode_router = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
ops = APIRouter()


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
    request: Request, ttl_s: TtlQuery = None, pooled: PooledQuery = False, dtype: DtypeQuery = None
) -> EncodeResponse:
    """Multipart with one or more ``image`` parts, or a raw image body. Returns one lease per
    image, in order."""
    s: Settings = request.app.state.settings
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("multipart/form-data"):
        images = await _multipart_images(request, s)
    else:
        check_content_type(ctype)
        data = await request.body()
        images = [("image", data)]
    # The engine in this process, or the GPU process behind a front (app/front.py).
    encode_images: EncodeFn = request.app.state.encode_images
    return EncodeResponse(items=await encode_images(images, ttl_s, pooled, dtype))


async def _multipart_images(request: Request, s: Settings) -> list[tuple[str, bytes]]:
    try:
        form = await request.form(
            max_files=s.max_images_per_request, max_fields=32, max_part_size=s.max_image_bytes
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
        return images
    finally:
        await form.close()


@v1.get("/leases/{lease_id}", response_model=LeaseDescriptor, responses={404: {}, 410: {}})
async def get_lease(request: Request, lease_id: str) -> LeaseDescriptor:
    p = pool(request)
    return p.describe(p.get(lease_id))


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
    p = pool(request)
    import asyncio

    tensor = await asyncio.to_thread(p.read, lease_id)
    body = save({"features": tensor.contiguous()}, metadata={"lease_id": lease_id})
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
    p = pool(request)
    return p.describe(p.renew(lease_id, body.ttl_s if body else None))


@v1.delete("/leases/{lease_id}", status_code=204, responses={404: {}, 410: {}})
async def delete_lease(request: Request, lease_id: str) -> Response:
    pool(request).release(lease_id)
    return Response(status_code=204)


@v1.get("/pool")
async def pool_info(request: Request) -> dict[str, Any]:
    eng = engine(request)
    stats = pool(request).stats()
    stats["epoch"] = f"{stats['epoch']:016x}"
    stats["fallbacks"] = [
        {"reason": r, "tier": t, "count": n} for (r, t), n in stats["fallbacks"].items()
    ]
    stats["socket_path"] = str(eng.settings.socket_path)
    stats["capabilities"] = vars(eng.caps) if eng.caps else {}
    return stats


@ops.get("/health/live")
async def live(request: Request) -> JSONResponse:
    reason = engine(request).dead_reason
    if reason:
        return JSONResponse({"status": "dead", "reason": reason}, status_code=503)
    return JSONResponse({"status": "alive"})


@ops.get("/health/ready")
async def ready(request: Request) -> JSONResponse:
    eng = engine(request)
    if not eng.ready or eng.dead_reason:
        return JSONResponse({"status": "not_ready"}, status_code=503)
    return JSONResponse({"status": "ready"})


@ops.get("/metrics", response_class=PlainTextResponse)  # documented as text/plain
async def metrics(request: Request) -> Response:
    m: Metrics = request.app.state.metrics
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
