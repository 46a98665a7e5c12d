"""The activity log's store: the ring, the SQLite file's rotation and refill (the answer's numbers
it records are read by the proxy: tests/unit/test_answers.py)."""

from __future__ import annotations

import logging
import sqlite3

import pytest

from config.schema import Activity
from router.admin import ActivityFileError
from router.admin.activity import ActivityLog, Record
from tests.support import until


def done(log: ActivityLog, engine: str = "a", status: int = 200) -> None:
    log.request_done(key_name="team", model=engine, engine=engine, peer=None, endpoint="completions", status=status, found_awake=True,
                     swap_id=None, queue_wait_s=0.0, ttfb_s=None, duration_s=0.01, prompt_tokens=3, completion_tokens=5,
                     mean_acceptance_length=None)


def test_the_ring_keeps_the_newest_records_and_answers_newest_first():
    log = ActivityLog(Activity(ring=3))
    for engine in "abcde":
        done(log, engine)
    assert [r.engine for r in log.query()] == ["e", "d", "c"]
    assert [r.engine for r in log.query(model="d")] == ["d"]
    assert [r.engine for r in log.query(limit=1)] == ["e"]
    assert [r.engine for r in log.query(since=log.query()[1].at)] == ["e"]


def test_ring_zero_records_nothing():
    log = ActivityLog(Activity(ring=0))
    done(log)
    assert not log.enabled and not log.wants_answers and log.query() == []


def test_the_file_rotates_by_row_count_and_refills_the_ring_after_a_restart(tmp_path):
    path = tmp_path / "activity.db"
    first = ActivityLog(Activity(ring=10, path=str(path), max_rows=4))
    for engine in "abcdef":
        done(first, engine)
    first.close()
    with sqlite3.connect(path) as db:
        assert [row[0] for row in db.execute("SELECT engine FROM activity ORDER BY id")] == ["c", "d", "e", "f"]

    second = ActivityLog(Activity(ring=3, path=str(path), max_rows=4))
    assert [r.engine for r in second.query()] == ["f", "e", "d"]  # the newest `ring` rows, in order
    assert second.query()[0].key_name == "team" and second.query()[0].found_awake is True
    second.close()


def test_a_file_that_cannot_be_written_is_logged_once_and_never_fails_a_request(tmp_path, caplog):
    path = tmp_path / "activity.db"
    log = ActivityLog(Activity(ring=10, path=str(path)))
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE activity")  # every insert fails from now on
    with caplog.at_level(logging.ERROR, logger="hotswap"):
        for _ in range(3):  # three batches, each failing
            done(log)
            until(lambda: not log.file.rows, 10, "the writer took the row")
        log.close()
    assert len(log.query()) == 3, "the ring still has them"
    failures = [r for r in caplog.records if "writing" in r.getMessage() and "failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None


def test_a_file_that_cannot_be_the_activity_log_fails_the_start_naming_it(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("an operator's notes, not SQLite " * 100)
    with pytest.raises(ActivityFileError) as refused:
        ActivityLog(Activity(ring=10, path=str(path)))
    assert str(refused.value).startswith(f"activity.path {path}: cannot be used as the activity log's file: ")
    assert "unset it to keep the log in memory" in str(refused.value)


def test_a_file_of_an_older_version_gets_the_new_columns_and_keeps_its_rows(tmp_path):
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:  # as a version that recorded fewer things wrote it
        db.execute("CREATE TABLE activity (id INTEGER PRIMARY KEY, at, key_name, model, engine, endpoint, status, "
                   "found_awake, queue_wait_s, swap_id)")
        db.execute("INSERT INTO activity (at, key_name, model, engine, endpoint, status, found_awake, queue_wait_s, swap_id) "
                   "VALUES (1.5, 'team', 'a', 'a', 'completions', 200, 0, 0.25, 7)")
    log = ActivityLog(Activity(ring=10, path=str(path)))
    try:
        [old] = log.query()
        assert (old.engine, old.swap_id, old.found_awake, old.duration_s) == ("a", 7, False, None)
        assert log.last_swap_id == 7, "this run's swaps are numbered past the file's"
    finally:
        log.close()


def test_without_a_file_swap_ids_start_at_one():
    assert ActivityLog(Activity(ring=10)).last_swap_id == 0


def test_a_file_written_before_the_peer_column_gains_it_and_keeps_its_rows(tmp_path):
    path = tmp_path / "activity.db"
    older = list(Record._fields[:Record._fields.index("peer")])  # neither peer nor request_class yet
    with sqlite3.connect(path) as db:
        db.execute(f"CREATE TABLE activity (id INTEGER PRIMARY KEY, {', '.join(older)})")
        db.execute(f"INSERT INTO activity ({', '.join(older)}) VALUES ({', '.join('?' * len(older))})",
                   (1.0, "team", "a", "a", "completions", 200, 1, 0.0, None, None, 0.01, 3, 5, None))
    log = ActivityLog(Activity(ring=10, path=str(path)))
    assert log.file is not None, "the file of an earlier version is still the log's file"
    [old] = log.query()
    assert old.engine == "a" and old.peer is None and old.found_awake is True
    log.request_done(key_name="team", model="b", engine=None, peer="node-b", endpoint="completions", status=200,
                     found_awake=None, swap_id=None, queue_wait_s=None, ttfb_s=None, duration_s=0.01, prompt_tokens=None,
                     completion_tokens=None, mean_acceptance_length=None)
    log.close()
    assert [r.peer for r in ActivityLog(Activity(ring=10, path=str(path))).query()] == ["node-b", None]


def test_a_record_carries_its_request_class_as_class_and_the_file_keeps_it(tmp_path):
    path = tmp_path / "activity.db"
    log = ActivityLog(Activity(ring=10, path=str(path)))
    for klass in ("batch", None):
        log.request_done(key_name="evals", model="a", engine="a", peer=None, endpoint="chat", status=200, found_awake=True,
                         swap_id=None, queue_wait_s=0.0, ttfb_s=None, duration_s=0.01, prompt_tokens=None,
                         completion_tokens=None, mean_acceptance_length=None, request_class=klass)
    log.close()
    records = [r.as_dict() for r in ActivityLog(Activity(ring=10, path=str(path))).query()]
    assert [r["class"] for r in records] == [None, "batch"] and "request_class" not in records[0]


def test_a_record_reads_back_from_the_file_exactly_as_it_was_written(tmp_path):
    from router.admin.activity import FIELDS, Record, _from_row
    from router.admin.activity_file import ActivityFile

    path = tmp_path / "activity.db"
    written = [Record(1796179092.2620955, 'k"ey ☃', "m'odel\n", None, "chat", 200, True, 0.1234567890123, 7, None, 1e-9, 5, 16,
                      2.3456, "peer-a"),
               Record(1796179092.75, "k", "m", "m", "chat", 200, True, 0.0, None, 0.1, 9.5, 5, 16, None, None, "batch",
                      "drain_deadline,preempted", 3.123456789, "tools"),
               Record(1796179093.5, None, None, "e", "completions", 499, False, None, None, 0.5, 3.0, None, None, None, None)]
    file = ActivityFile(str(path), 100, FIELDS)
    for record in written:
        file.put(record)
    file.close()
    assert [_from_row(row) for row in ActivityFile(str(path), 100, FIELDS).last(10)] == written


def test_a_model_name_that_is_no_utf8_text_is_kept_with_a_replacement_and_loses_no_row(tmp_path):
    path = tmp_path / "activity.db"
    log = ActivityLog(Activity(path=str(path)))
    for model in ("bad\ud800x", "fine"):
        log.request_done(key_name="k", model=model, engine=None, peer=None, endpoint="chat", status=404, found_awake=None,
                         swap_id=None, queue_wait_s=None, ttfb_s=None, duration_s=0.1, prompt_tokens=None, completion_tokens=None,
                         mean_acceptance_length=None)
    log.close()
    again = ActivityLog(Activity(path=str(path)))
    assert [r.model for r in again.query()] == ["fine", "bad?x"]
    again.close()


def resumed_stream(log: ActivityLog, resumed=None, paused_s=None, cut=None) -> None:
    log.request_done(key_name="team", model="a", engine="a", peer=None, endpoint="chat", status=200, found_awake=True,
                     swap_id=None, queue_wait_s=0.0, ttfb_s=0.05, duration_s=4.0, prompt_tokens=3, completion_tokens=40,
                     mean_acceptance_length=None, request_class="interactive", resumed=resumed, paused_s=paused_s, cut=cut)


def test_a_stream_that_was_paused_or_cut_says_so_in_its_record_and_the_file_keeps_it(tmp_path):
    path = tmp_path / "activity.db"
    log = ActivityLog(Activity(ring=10, path=str(path)))
    resumed_stream(log)  # a plain answer
    resumed_stream(log, resumed="drain_deadline,preempted", paused_s=3.1234567891)
    resumed_stream(log, cut="tools")
    resumed_stream(log, resumed="restart", paused_s=0.5, cut="wait")  # resumed once, then cut by its second pause
    log.close()
    records = [r.as_dict() for r in ActivityLog(Activity(ring=10, path=str(path))).query()][::-1]
    assert [(r["status"], r["resumed"], r["paused_s"], r["cut"]) for r in records] == [
        (200, None, None, None), (200, "drain_deadline,preempted", 3.123457, None), (200, None, None, "tools"),
        (200, "restart", 0.5, "wait")]


def test_a_file_written_before_the_resume_columns_gains_them_and_keeps_its_rows(tmp_path):
    path = tmp_path / "activity.db"
    older = list(Record._fields[:Record._fields.index("resumed")])  # peer and request_class, no resumed, paused_s, cut
    with sqlite3.connect(path) as db:
        db.execute(f"CREATE TABLE activity (id INTEGER PRIMARY KEY, {', '.join(older)})")
        db.execute(f"INSERT INTO activity ({', '.join(older)}) VALUES ({', '.join('?' * len(older))})",
                   (1.0, "team", "a", "a", "chat", 200, 1, 0.0, None, 0.1, 2.0, 3, 5, None, None, "batch"))
    log = ActivityLog(Activity(ring=10, path=str(path)))
    [old] = log.query()
    assert (old.request_class, old.resumed, old.paused_s, old.cut) == ("batch", None, None, None)
    resumed_stream(log, resumed="migrated", paused_s=1.5)
    log.close()
    with sqlite3.connect(path) as db:
        assert {"resumed", "paused_s", "cut"} <= {row[1] for row in db.execute("PRAGMA table_info(activity)")}
    assert [(r.resumed, r.paused_s) for r in ActivityLog(Activity(ring=10, path=str(path))).query()] == [
        ("migrated", 1.5), (None, None)]


def test_the_ui_marks_a_resumed_or_cut_request_beside_its_status():
    from router.admin.ui_activity import recent_requests

    log = ActivityLog(Activity(ring=10))
    resumed_stream(log, cut="tools")
    resumed_stream(log, resumed="drain_deadline,preempted", paused_s=3.14)
    resumed_stream(log)
    page = recent_requests(log.query(), ["a"], None, True)
    plain, resumed, cut = [row.split("</td>")[5] for row in page.split("<tr class='activity'>")[1:]]  # the status cells
    assert plain == "<td class='ok'>200"
    assert resumed == ("<td class='ok'>200 <span class='resumed warn' title='paused and resumed: drain_deadline, preempted, "
                       "paused 3.1 s'>resumed ×2</span>")
    assert cut == "<td class='ok'>200 <span class='cut bad' title='its answer was cut for good: tools'>cut: tools</span>"
