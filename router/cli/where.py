"""Which router a client command (`status`, `activity`, `reload`) talks to, and what to say when nothing answers there.

In order: `--url`; else `--config ROSTER.yaml`'s `listen:` (a router bound to every address is reached over
loopback); else `$HOTSWAP_URL`; else http://127.0.0.1:8080, `listen:`'s own default. A refused connection names the
URL tried, where it came from, and the ways to name another."""

from __future__ import annotations

import ipaddress
import os
from typing import Optional

import yaml
from pydantic import ValidationError

from config.sections import Listen

URL_ENV = "HOTSWAP_URL"
DEFAULT_URL = "http://127.0.0.1:8080"
HOW_TO_NAME = f"--url URL, {URL_ENV}=URL, or --config ROSTER.yaml (its listen:)"


class NoRouterURL(Exception):
    """--config names a roster whose listen: cannot be read; str() says what is wrong and where."""


class RouterURL(str):
    """The router's URL (a str, so every caller that takes one takes it), and where it came from."""

    origin: str

    def __new__(cls, url: str, origin: str) -> "RouterURL":
        self = super().__new__(cls, url)
        self.origin = origin
        return self


def unreachable(command: str, url: str, reason: object) -> str:
    """What `hotswap <command>` says when nothing answers at `url` (a RouterURL says where it came from)."""
    what = "nothing listens there (connection refused)" if _refused(reason) else str(reason)
    origin = f" ({url.origin})" if isinstance(url, RouterURL) else ""
    return f"hotswap {command}: cannot reach a router at {url}{origin}: {what}. Is the router running there? " \
           f"To ask another, name it with {HOW_TO_NAME}"


def router_url(url: Optional[str], config: Optional[str], environ: Optional[dict[str, str]] = None) -> RouterURL:
    environ = os.environ if environ is None else environ
    if url:
        return RouterURL(url, "from --url")
    if config:
        host, port = _listen(config)
        return RouterURL(f"http://{_reach(host)}:{port}", f"from listen: in {config}")
    if environ.get(URL_ENV):
        return RouterURL(environ[URL_ENV], f"from ${URL_ENV}")
    return RouterURL(DEFAULT_URL, "the default")


def _listen(path: str) -> tuple[str, int]:
    """listen.host and listen.port of the roster at `path`, read alone: the rest (its secrets' ${ENV} included) is
    the running router's business."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError) as exc:
        raise NoRouterURL(f"{path}:1:1: roster: cannot read file: {exc}") from None
    except yaml.YAMLError as exc:
        raise NoRouterURL(f"{path}: yaml: not a roster ({exc}); run `hotswap check --config {path}`") from None
    listen = data.get("listen") if isinstance(data, dict) else None
    try:
        parsed = Listen.model_validate(listen or {})
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(["listen", *map(str, first["loc"])])
        raise NoRouterURL(f"{path}: {field}: {first['msg']}; run `hotswap check --config {path}`") from None
    return parsed.host, parsed.port


def _reach(host: str) -> str:
    """The address to reach a router bound to `host` from this machine."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host  # a name
    if address.is_unspecified:  # 0.0.0.0 or ::: every address, loopback among them
        return "127.0.0.1" if address.version == 4 else "[::1]"
    return f"[{host}]" if address.version == 6 else host


def _refused(reason: object) -> bool:
    return isinstance(reason, ConnectionRefusedError) or "refused" in str(reason).lower()
