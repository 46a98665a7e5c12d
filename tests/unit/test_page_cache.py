"""engines.vllm_worker.page_cache: how much of a checkpoint file the page cache holds, as mincore(2) says.

A Level-2 wake asks it of every weight file before its reload (the stage step's look), so it is counted
in C; these check the count against mincore's vector read byte by byte, on a real file.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

from engines.vllm_worker import page_cache
from engines.vllm_worker.page_cache import PAGE, drop, resident_bytes, resident_pages


def resident_bytes_byte_by_byte(path: Path) -> int:
    """mincore's vector for the whole file, each byte's bit 0 tested in Python (how it was counted before)."""
    size = path.stat().st_size
    libc = page_cache._c()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            assert libc.mincore(addr, pages * PAGE, vec) == 0
            return min(sum(1 for i in range(pages) if vec[i] & 1) * PAGE, size)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def test_a_partly_cached_checkpoint_file_counts_the_pages_mincore_reports(tmp_path):
    # 3 MiB and a tail that is not a whole page, written, dropped from the page cache, then every
    # third 64 KiB block read back: some pages resident, some not, as a checkpoint after an eviction.
    path = tmp_path / "model-00001-of-00002.safetensors"
    path.write_bytes(os.urandom((3 << 20) + 123))
    drop(str(path))
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # no readahead past the blocks read
        for offset in range(0, path.stat().st_size, 3 << 16):
            f.seek(offset)
            f.read(1 << 16)
    held, size = resident_bytes(str(path))
    assert size == path.stat().st_size
    assert held == resident_bytes_byte_by_byte(path)
    assert 0 < held <= size


def test_a_wholly_cached_file_counts_its_size_and_an_empty_one_nothing(tmp_path):
    path = tmp_path / "small.safetensors"
    path.write_bytes(b"x" * (2 * PAGE + 1))
    with open(path, "rb") as f:
        f.read()
    assert resident_bytes(str(path)) == (2 * PAGE + 1, 2 * PAGE + 1) == (resident_bytes_byte_by_byte(path), 2 * PAGE + 1)
    (tmp_path / "empty").write_bytes(b"")
    assert resident_bytes(str(tmp_path / "empty")) == (0, 0)


def test_only_bit_0_of_a_vector_byte_means_resident_the_reserved_bits_do_not():
    vector = bytes([0, 1, 2, 3, 0xFE, 0xFF, 0x80, 0x81, 1])
    assert resident_pages(vector) == sum(b & 1 for b in vector) == 5
    assert resident_pages(b"") == 0
