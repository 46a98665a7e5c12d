"""API keys and what each may use: the roster's `auth` as a table the auth middleware asks.

`api_keys` and `admin_key` are shorthands for scoped keys (`models: ["*"]`, `admin: true`).
A key may use a model when one of the model's names or aliases matches one of its globs; a
LoRA adapter when its own name matches or its engine may be used. A model a key may not use
is answered exactly as a model that does not exist, so a key learns nothing of the others.

Holds (the end of this file): a model held for an operator's trial takes only requests that carry the hold's
token, whatever their key may use.
"""

from __future__ import annotations

import fnmatch
import functools
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

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


# -- holds -------------------------------------------------------------------------------------------
# Models held for an operator's trial (`hotswap trial --url`): while held, a client request for the model is
# answered 503 `model_held` (with Retry-After) instead of waiting on, or waking, the engine the trial is moving.
# Only requests carrying the hold's token (header `X-Hotswap-Hold`, known to the admin caller that took it) pass.
#
# A hold lasts `seconds` from its last renewal, so a trial that dies lets go on its own; its holder renews it
# while it runs and releases it (seconds=0) at the end. Requests already waiting when a hold begins are served
# as before, by an engine the gate promoted.

HOLD_HEADER = "X-Hotswap-Hold"
HOLD_MAX_S = 3600.0


@dataclass
class Hold:
    token: str
    until: float


class HeldElsewhere(Exception):
    """Another holder has the model: str() says for how long."""


class Holds:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._holds: dict[str, Hold] = {}

    def active(self, name: str) -> Optional[Hold]:
        hold = self._holds.get(name)
        if hold is not None and hold.until <= self.clock():
            del self._holds[name]
            return None
        return hold

    def take(self, name: str, seconds: float, token: Optional[str] = None) -> str:
        """Hold (or renew, with its token) `name` for `seconds`; the token. HeldElsewhere if someone else holds it."""
        current = self.active(name)
        if current is not None and current.token != token:
            raise HeldElsewhere(f"'{name}' is held by another trial for {current.until - self.clock():.0f} s more")
        token = current.token if current is not None else secrets.token_urlsafe(18)
        self._holds[name] = Hold(token, self.clock() + min(seconds, HOLD_MAX_S))
        return token

    def release(self, name: str, token: Optional[str]) -> bool:
        current = self.active(name)
        if current is None or current.token != token:
            return False
        del self._holds[name]
        return True

    def remaining(self, name: str, token: Optional[str] = None) -> Optional[float]:
        """Seconds `name` stays held against a request carrying `token` (None: it may pass)."""
        current = self.active(name)
        if current is None or (token is not None and secrets.compare_digest(current.token, token)):
            return None
        return current.until - self.clock()
