import asyncio, time, sys
from app.middleware import ServiceMiddleware
from app.metrics import Metrics

async def trivial(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})

async def main():
    from app.metrics import HttpMetrics
    from prometheus_client import CollectorRegistry
    m = HttpMetrics(CollectorRegistry())
    mw = ServiceMiddleware(trivial, m, max_body_bytes=1 << 20, body_timeout_s=30.0)
    scope = {"type": "http", "path": "/v1/leases/abc", "method": "GET", "headers": [(b"host", b"x")]}
    never = asyncio.Event()
    def make_receive():
        sent = False
        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await never.wait()
        return receive
    async def send(msg): pass
    for _ in range(500): await mw(dict(scope), make_receive(), send)
    n = 20000; t = time.perf_counter()
    for _ in range(n): await mw(dict(scope), make_receive(), send)
    print(f"{(time.perf_counter()-t)/n*1e6:.1f} us per GET through the middleware")
asyncio.run(main())
