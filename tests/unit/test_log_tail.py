"""The tail of an engine's log, read backwards from its end (router.admin.logs.read_tail)."""

from __future__ import annotations

from router.admin.logs import MAX_LINE_CHARS, TAIL_MAX_BYTES, read_tail


def test_the_tail_is_the_last_lines_and_the_one_still_being_written(tmp_path):
    log = tmp_path / "e.log"
    log.write_bytes(b"".join(b"line %d\n" % i for i in range(200_000)) + b"half a li")
    tail = read_tail(log, 3)
    assert tail.lines == ["line 199997", "line 199998", "line 199999"] and tail.partial == ["half a li"]
    assert tail.end == log.stat().st_size and tail.rest == b"half a li"


def test_a_huge_line_is_read_no_further_back_than_the_cap(tmp_path):
    log = tmp_path / "e.log"
    log.write_bytes(b"start\n" + b"y" * (3 * TAIL_MAX_BYTES) + b"\nend\n")
    tail = read_tail(log, 5)
    assert tail.lines[-1] == "end" and all(len(line) <= MAX_LINE_CHARS for line in tail.lines)
    assert "start" not in tail.lines and sum(map(len, tail.lines)) <= TAIL_MAX_BYTES + 64 * 1024


def test_a_log_not_written_yet_has_no_lines(tmp_path):
    tail = read_tail(tmp_path / "none.log", 10)
    assert (tail.lines, tail.partial, tail.end, tail.identity) == ([], [], 0, None)
