"""LoRA adapters in the simulated engine: `--enable-lora --lora-modules name=path ...` at
boot, `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` at runtime (only with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`, as in vLLM), each adapter listed in `/v1/models`
with its `parent`.

An adapter's output differs from the base model's (the adapter path salts the text), so
"the adapter answered" and "the base model answered" can be told apart. With
`--sim-lora-lost-on-level2`, a Level-2 wake brings adapters back silently wrong (they
answer like the base model), the adapter analogue of the draft collapse.
"""

from __future__ import annotations

import json
import logging
import os

from aiohttp import web

log = logging.getLogger("vllm.sim")


def parse_module(text: str) -> tuple[str, str]:
    """`name=path` or vLLM's JSON form `{"name": ..., "path": ...}`."""
    if text.lstrip().startswith("{"):
        spec = json.loads(text)
        return spec["name"], spec["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"invalid LoRA module {text!r}: expected name=path")
    return name, path


def runtime_updates_allowed() -> bool:
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


class Adapters:
    def __init__(self, modules: dict[str, str], base: str) -> None:
        self.paths = dict(modules)
        self.base = base
        self.lost = False  # Level-2 wake with --sim-lora-lost-on-level2

    def salt(self, model: str) -> str:
        """What an adapter adds to the text it generates ('' for the base model or a lost adapter)."""
        path = self.paths.get(model)
        return "" if path is None or self.lost else f"lora:{path}:"

    def cards(self, created: int) -> list[dict]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": path,
                 "parent": self.base, "max_model_len": None,
                 "permission": []} for name, path in self.paths.items()]


def add_routes(app: web.Application, adapters: Adapters, base_names: list[str], read_json, error_response) -> None:
    async def load(request: web.Request) -> web.Response:
        body = await read_json(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return error_response(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name in base_names:
            return error_response(400, f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput")
        if name in adapters.paths and not body.get("load_inplace"):
            return error_response(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                  "adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
        adapters.paths[name] = path
        log.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(request: web.Request) -> web.Response:
        body = await read_json(request)
        name = body.get("lora_name")
        if not name:
            return error_response(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if name not in adapters.paths:
            return error_response(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del adapters.paths[name]
        log.info("Removed LoRA adapter: name '%s'", name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/unload_lora_adapter", unload)
