"""What of a roster is secret, and how it is shown wherever it is printed or logged.

An engine's command line and environment carry its secrets (`--api-key`, `--hf-token`, a
`VLLM_API_KEY`), and `hotswap check`, `/admin` and the engine's log file show them. So every
argv shown is masked: the value of a secret flag, and every value the roster gave as `${ENV}`
(the loader hands over the values it substituted), become `***`. So does the userinfo of an
attached engine's `url` (`http://user:pw@host`), written in the file or not.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, Optional
from urllib.parse import unquote, urlsplit, urlunsplit

MASK = "***"
# vLLM's flags whose value is a credential; any other flag's secret comes in as ${ENV}.
SECRET_FLAGS = frozenset({"--api-key", "--hf-token"})
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)  # env names that hold one
# Shorter substituted values (a tensor-parallel size, a port) are no secrets worth hiding, and
# masking each of their occurrences would garble every argument that happens to contain them.
MIN_MASKED_LEN = 6


def _flag(arg: str) -> str:
    name = arg.split("=", 1)[0]
    return name.replace("_", "-") if name.startswith("--") else name  # vLLM reads --api_key as --api-key


def mask_argv(argv: Iterable[str], from_env: Iterable[str] = ()) -> list[str]:
    """`argv` safe to print: secret flags' values and values substituted from ${ENV} as `***`."""
    values = sorted((v for v in set(from_env) if len(v) >= MIN_MASKED_LEN), key=len, reverse=True)
    shown: list[str] = []
    secret_next = False
    for arg in argv:
        if secret_next:
            arg, secret_next = MASK, False
        elif _flag(arg) in SECRET_FLAGS:
            if "=" in arg:
                arg = arg.split("=", 1)[0] + "=" + MASK
            else:
                secret_next = True
        for value in values:
            arg = arg.replace(value, MASK)
        shown.append(arg)
    return shown


def mask_env(env: Mapping[str, str], from_env: Iterable[str] = ()) -> dict[str, str]:
    """`env` safe to print: a secret-named variable, or one whose value came from ${ENV}, as `***`."""
    return {k: MASK if SECRET_NAME.search(k) else mask_argv([v], from_env)[0] for k, v in env.items()}


def mask_tree(value: Any, from_env: Iterable[str] = ()) -> Any:
    """Plain data (a JSON-shaped `speculative` config) safe to print: each string masked as an argument is."""
    if isinstance(value, str):
        return mask_argv([value], from_env)[0]
    if isinstance(value, dict):
        return {k: mask_tree(v, from_env) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_tree(v, from_env) for v in value]
    return value


def mask_url(url: str) -> str:
    """`url` safe to print: its userinfo (`user:password@`, however it was written) as `***@`."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=MASK + "@" + parts.netloc.rpartition("@")[2]))


def split_userinfo(url: str) -> tuple[str, Optional[tuple[str, str]]]:
    """`url` without its userinfo, and the (user, password) it carried (percent-decoded), if any: an
    engine's address is then printed, pooled and sent as a Host header without its credentials."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=host)), (unquote(user), unquote(password))
