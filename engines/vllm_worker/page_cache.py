"""The page cache of a checkpoint's files: how much of them is resident, reading them in, dropping them.

Standard library only (it runs inside vLLM's worker).
Residency is mincore(2) over a read-only shared mapping of the file, through ctypes: the only way to
ask the kernel which pages of a file are cached without reading (and so caching) them.

Staging reads each file front to back in large chunks after posix_fadvise(WILLNEED): a sequential read
is what a cold NVMe or a network volume serves fastest, where vLLM's safetensors loader reads the same
bytes through an mmap, page fault by page fault, in the order of the model's parameters.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import time
from typing import Iterable, Optional

CHUNK = 16 << 20  # bytes per read: large enough for readahead to stream, small enough not to matter in RAM
WINDOW_PAGES = 1 << 18  # mincore's vector per call (256 KiB for 1 GiB of 4 KiB pages)
PAGE = mmap.PAGESIZE
# mincore's vector: one byte per page, bit 0 set when it is resident, the other bits reserved. Counted in C
# (translate, then count), not by a Python loop over each byte: 35M pages for 140 GB took seconds before
# every Level-2 wake's reload (issue 54, item 18).
_LOW_BIT = bytes(b & 1 for b in range(256))

_libc: Optional[ctypes.CDLL] = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        _libc = libc
    return _libc


def resident_pages(vector: bytes) -> int:
    """The pages a mincore vector says are resident (bit 0 of each byte; the other bits are reserved)."""
    return vector.translate(_LOW_BIT).count(1)


def resident_bytes(path: str) -> tuple[int, int]:
    """(bytes of `path` in the page cache, its size). Raises OSError when it cannot be mapped."""
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    libc = _c()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap: {os.strerror(err)}", path)
        try:
            pages = (size + PAGE - 1) // PAGE
            resident = 0
            vec = (ctypes.c_ubyte * min(pages, WINDOW_PAGES))()
            for first in range(0, pages, WINDOW_PAGES):
                n = min(WINDOW_PAGES, pages - first)
                if libc.mincore(addr + first * PAGE, n * PAGE, vec) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"mincore: {os.strerror(err)}", path)
                resident += resident_pages(ctypes.string_at(vec, n))
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(resident * PAGE, size), size


def residency(paths: Iterable[str]) -> float:
    """The fraction of the files' bytes in the page cache (1.0 for no bytes at all)."""
    held = total = 0
    for path in paths:
        r, s = resident_bytes(path)
        held, total = held + r, total + s
    return held / total if total else 1.0


def read_in(path: str, buf: Optional[bytearray] = None) -> int:
    """Read `path` front to back so its pages are resident; the bytes read."""
    buf = buf if buf is not None else bytearray(CHUNK)
    view = memoryview(buf)
    done = 0
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)  # start readahead of the whole file now
        while n := f.readinto(view):
            done += n
    return done


def stage(paths: list[str], read: bool = True) -> dict:
    """Make `paths` resident: files already (almost) wholly resident are not read again, since
    re-reading them costs a copy at page-cache speed for nothing. The report the router logs and times.
    `read=False` only looks (mincore): what a wake asks when reading first would cost it more than its
    reload reading the disk itself."""
    started = time.perf_counter()
    sizes = [resident_bytes(p) for p in paths]
    total = sum(s for _, s in sizes)
    before = sum(r for r, _ in sizes) / total if total else 1.0
    buf = bytearray(CHUNK) if read else None
    done = 0
    for path, (held, size) in zip(paths, sizes):
        if read and size and held < size * 0.999:
            done += read_in(path, buf)
    return {"files": len(paths), "bytes": total, "read_bytes": done, "seconds": round(time.perf_counter() - started, 4),
            "resident_before": round(before, 4)}


def drop(path: str) -> None:
    """Ask the kernel to evict `path`'s pages (advisory: check with resident_bytes). Dirty pages are
    never dropped, so a file just written is synced first."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
