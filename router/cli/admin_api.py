"""The admin API as the CLI calls it: the admin key as a bearer token (never printed), and a refusal in words."""

from __future__ import annotations

import os
import urllib.request
from typing import Optional

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
