"""The floor for a Python reverse proxy: what bench/peers.py compares hotswap against.

`python bench/bare_proxy.py --upstream http://127.0.0.1:8001 --port 8002`

aiohttp server + client on uvloop, one shared ClientSession with an unlimited connector,
POST bodies passed through as bytes, SSE passed through chunk by chunk with iter_any.
No auth, no routing, no metrics, no logging: anything hotswap costs on top of this is
the price of its features.
"""

import argparse
import asyncio
import signal

import aiohttp
import uvloop
from aiohttp import web

TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600)


async def proxy(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    async with request.app["session"].post(request.app["upstream"] + request.path, data=body,
                                           headers={"Content-Type": "application/json"}, timeout=TIMEOUT) as up:
        ctype = up.headers.get("Content-Type", "application/json")
        if not ctype.startswith("text/event-stream"):
            return web.Response(status=up.status, body=await up.read(), headers={"Content-Type": ctype})
        resp = web.StreamResponse(status=up.status, headers={"Content-Type": ctype, "Cache-Control": "no-cache"})
        await resp.prepare(request)
        async for chunk in up.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def main(upstream: str, host: str, port: int) -> None:
    """Serve the proxy routes until SIGTERM/SIGINT."""
    app = web.Application()
    app["upstream"] = upstream.rstrip("/")
    app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    app.on_cleanup.append(lambda app: app["session"].close())
    app.router.add_post("/v1/completions", proxy)
    app.router.add_post("/v1/chat/completions", proxy)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--upstream", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args()
    uvloop.run(main(a.upstream, a.host, a.port))
