"""The admin API as the CLI calls it: the admin key as a bearer token (never printed), a refusal in words, and an
answer that is not a router's (a web page, another service's JSON) said as such rather than as a traceback."""

from __future__ import annotations

import json
import os
import urllib.request
from typing import Any, Iterable, Optional

KEY_ENV = "HOTSWAP_ADMIN_KEY"


def admin_request(url: str, path: str, admin_key: Optional[str], method: str = "GET") -> urllib.request.Request:
    request = urllib.request.Request(url.rstrip("/") + path, data=b"" if method == "POST" else None, method=method)
    key = admin_key or os.environ.get(KEY_ENV)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    return request


def refusal(command: str, url: str, status: int, admin_key: Optional[str]) -> Optional[str]:
    """What to do about a 401 or 403 from the router's /admin/*; None for any other status."""
    given = admin_key or os.environ.get(KEY_ENV)
    if status == 401:
        which = "refused the admin key given" if given else "wants the admin key"
        return (f"hotswap {command}: {url} {which}: pass --admin-key KEY or set {KEY_ENV} to the roster's auth.admin_key "
                "(or a key of auth.keys with admin: true)")
    if status == 403:
        return (f"hotswap {command}: {url} answers /admin/* only over loopback while its roster sets no admin key: run "
                f"this on the router's host, or set auth.admin_key in the roster and pass it (--admin-key or {KEY_ENV})")
    return None


class NotARouter(Exception):
    """The URL answered, but not as a hotswap router does: str() says what was found, for the operator."""


def fetch_json(url: str, path: str, admin_key: Optional[str], timeout: float, keys: Iterable[str]) -> dict[str, Any]:
    """GET `path`'s JSON object, which must carry `keys`; else NotARouter naming what came back instead."""
    with urllib.request.urlopen(admin_request(url, path, admin_key), timeout=timeout) as response:
        kind = response.headers.get_content_type()
        body = response.read()
    where = url.rstrip("/") + path.split("?")[0]
    if kind != "application/json":
        raise NotARouter(f"{where}: not a hotswap router: {kind}")
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise NotARouter(f"{where}: not a hotswap router: its application/json is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise NotARouter(f"{where}: not a hotswap router: a JSON {type(data).__name__}, not an object")
    missing = [k for k in keys if k not in data]
    if missing:
        found = ", ".join(sorted(data)[:8]) or "none"
        raise NotARouter(f"{where}: not a hotswap router: JSON without {', '.join(missing)} (its keys: {found})")
    return data
