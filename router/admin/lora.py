"""LoRA adapters: the names an engine serves besides its model (read from its /v1/models at
boot) route to it and are listed with their parent; runtime loading and unloading are admin
actions only (POST /admin/lora/{load,unload}?model=ENGINE), never forwarded from clients.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from engines.vllm import EngineError, EngineHTTPError
from router.errors import APIError, json_answer

log = logging.getLogger("hotswap")
ADMIN_TIMEOUT_S = 120


async def admin_lora(request: web.Request, router) -> web.Response:
    """Load or unload an adapter on one engine (which must run with --enable-lora and
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=true), then re-read the names it serves."""
    action = request.match_info["action"]
    model = request.query.get("model")
    if not model:
        raise APIError(400, f"POST /admin/lora/{action} needs ?model=NAME (the engine)", "missing_model", param="model")
    engine = router.lookup(model)
    try:
        body: Any = await request.json()
    except (ValueError, RecursionError):  # json's parser recurses per nesting level
        raise APIError(400, 'The body must be JSON: {"lora_name": ..., "lora_path": ...} (unload: lora_name only).', "invalid_json") from None
    name = body.get("lora_name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name or (action == "load" and not isinstance(body.get("lora_path"), str)):
        raise APIError(400, "Give lora_name (and, to load, lora_path) as strings.", "invalid_request")
    if action == "load" and name in router.by_name:
        raise APIError(400, f"'{name}' is a roster name; an adapter needs its own name.", "invalid_request")
    scheduler = router.placement
    await scheduler.acquire(engine, admin=True)  # an operator's action: a parked engine is woken first, no demand counted
    try:
        async with asyncio.timeout(ADMIN_TIMEOUT_S):
            await engine.client.request("POST", f"/v1/{action}_lora_adapter", json=body, timeout=ADMIN_TIMEOUT_S, expect_json=False)
            engine.served_names = frozenset(await engine.client.served_models(timeout=30))
    except EngineHTTPError as exc:
        raise APIError(exc.status if 400 <= exc.status < 500 else 502, f"engine '{engine.name}' refused {action} of '{name}': "
                       f"{exc.body[:500]}", "lora_refused") from None
    except (EngineError, TimeoutError) as exc:
        raise APIError(502, f"engine '{engine.name}': {action} of '{name}' failed: {exc}", "engine_error") from None
    finally:
        scheduler.release(engine)
    log.info("admin: lora %s %s on %s", action, name, engine.name)
    return json_answer({"model": engine.name, "action": f"lora_{action}", "lora_name": name,
                              "adapters": sorted(a for a, e, _ in router.adapters() if e is engine)})
