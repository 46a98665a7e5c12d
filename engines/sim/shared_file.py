"""One JSON object that simulated engines in separate processes read and change together: the GPU
ledger (memory.py) and the host page cache (page_cache.py). Each change is a read-modify-write
under an exclusive `fcntl.flock`, so two engines booting at once cannot both take the last GB."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Optional


@contextlib.contextmanager
def locked(path: Path, key: str) -> Iterator[dict]:
    """The file's `key` (an empty dict for a new file), under the lock; written back if it changed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with os.fdopen(os.dup(fd), "r+") as f:
            text = f.read()
            data = json.loads(text).get(key, {}) if text.strip() else {}
            before = json.dumps(data, sort_keys=True)
            yield data
            if json.dumps(data, sort_keys=True) != before:
                f.seek(0)
                f.truncate()
                json.dump({key: data}, f, sort_keys=True)
                f.flush()
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def locked_or_own(path: Optional[Path], key: str, own: dict) -> Iterator[dict]:
    """`locked(path, key)`, or `own` (this process's) when there is no file to share."""
    if path is None:
        yield own
        return
    with locked(path, key) as data:
        yield data
