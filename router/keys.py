"""API keys and what each may use: the roster's `auth` as a table the auth middleware asks.

`api_keys` and `admin_key` are shorthands for scoped keys (`models: ["*"]`, `admin: true`).
A key may use a model when one of the model's names or aliases matches one of its globs; a
LoRA adapter when its own name matches or its engine may be used. A model a key may not use
is answered exactly as a model that does not exist, so a key learns nothing of the others.
"""

from __future__ import annotations

import fnmatch
import functools
import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional

from aiohttp import web

from config.sections import INTERACTIVE, REQUEST_CLASSES, Auth
from router.errors import APIError

if TYPE_CHECKING:
    from engines.engine import Engine


# The request's class, lowered by its client (never raised: `request_class`), and sent on
# with a request passed to a peer, which lowers its own key's class by it in turn.
CLASS_HEADER = "X-Hotswap-Class"
# vLLM's priority scheduler serves lower values first ("lower means earlier handling; default: 0",
# vllm/entrypoints/openai/chat_completion/protocol.py:393 in vLLM 0.32), and refuses any value but 0
# from an engine without `--scheduling-policy priority`: so only such an engine is sent one.
PRIORITY = {klass: rank for rank, klass in enumerate(REQUEST_CLASSES)}


@dataclass(frozen=True)
class Grant:
    """One key's scope. `name` is what logs and metrics say; the key itself appears nowhere."""

    name: str
    models: tuple[str, ...]
    admin: bool = False
    metrics: bool = False  # may read /metrics (an admin key may too)
    klass: str = INTERACTIVE  # its requests' class (auth.keys[].class); a header may lower it, never raise it

    def may_use(self, names: Iterable[str]) -> bool:
        return _matches(self.models, tuple(names))

    def names_exactly(self, name: str) -> bool:
        """Whether `name` is written in this key's scope as it is, not matched by a glob: a virtual model
        named so is given whole (`router.virtuals`)."""
        return name in self.models

    def allows(self, engine: Engine, name: str) -> bool:
        """Whether this key may use `engine` for a request that names it `name`: the one scope check
        of name resolution, Responses pins and model lists. A glob matching one of the engine's roster
        names or aliases opens everything it serves; a key scoped to a LoRA adapter (or another name
        the engine serves besides its roster names) opens that name only."""
        return self.may_use(engine.spec.names) or (name in engine.other_names and self.may_use([name]))


@functools.lru_cache(maxsize=4096)  # asked on every proxied request, of a few roster names and globs
def _matches(globs: tuple[str, ...], names: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, glob) for name in names for glob in globs)


EVERYTHING = Grant("", ("*",))  # no client auth configured: every model, for anyone
NOTHING = Grant("", ())  # client auth on and no key presented: no model


class KeyTable:
    def __init__(self, auth: Auth):
        grants = [(key, Grant(f"api_keys[{i}]", ("*",))) for i, key in enumerate(auth.api_keys)]
        if auth.admin_key:
            grants.append((auth.admin_key, Grant("admin_key", (), admin=True, metrics=True)))
        grants += [(k.key, Grant(k.name or f"keys[{i}]", tuple(k.models), k.admin, k.metrics or k.admin,
                                     k.klass)) for i, k in enumerate(auth.keys)]
        self._keys = [(key.encode(), grant) for key, grant in grants]
        self.client_auth = any(grant.models for _, grant in self._keys)
        self.admin_auth = any(grant.admin for _, grant in self._keys)
        # The model and key names /metrics lists are what client auth keeps from a caller without a key.
        self.metrics_auth = self.client_auth and not auth.open_metrics

    def identify(self, presented: bytes) -> Optional[Grant]:
        """The grant of the key presented, or None. Every key is compared, in constant time each,
        so the time taken says neither which key was close nor where it sits in the table."""
        found = None
        for key, grant in self._keys:
            if hmac.compare_digest(presented, key) and presented:
                found = grant
        return found


def request_class(request: web.Request, grant: Grant) -> str:
    """The request's class: its key's (auth.keys[].class), lowered by X-Hotswap-Class, never raised."""
    text = request.headers.get(CLASS_HEADER)
    if text is None:
        return grant.klass
    asked = text.strip().lower()
    if asked not in REQUEST_CLASSES:
        raise APIError(400, f"{CLASS_HEADER} must be one of {', '.join(REQUEST_CLASSES)} (found {text[:40]!r})", "invalid_header")
    # Lowering only: a key whose class is batch stays batch whatever its client sends.
    return max(asked, grant.klass, key=REQUEST_CLASSES.index)


def class_priority(asked: Any, klass: str) -> Any:
    """The `priority` an engine with priority scheduling gets: the class's, or the client's own when that is
    served later. A key's class bounds its place in the engine's queue as it bounds its class: lowered, never
    raised, so a batch key's `priority: -10` is not served before interactive traffic."""
    floor = PRIORITY[klass]
    if asked is None:
        return floor
    if isinstance(asked, bool) or not isinstance(asked, (int, float)):
        # vLLM would take "-10" as -10: a string is refused here, not passed on past the bound.
        raise APIError(400, f"'priority' must be an integer, lower served earlier (found {json_type(asked)}).",
                       "invalid_request", param="priority")
    return asked if asked >= floor else floor  # NaN compares false: the class's


def json_type(value: Any) -> str:
    return {str: "a string", bool: "a boolean", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)
