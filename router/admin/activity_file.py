"""`activity.path`: the activity log's SQLite file, so records survive a restart.

Rows are written by one thread of its own, never on the event loop: a request appends its row
to a bounded deque (no lock, no wake-up but the first of a batch), and the thread writes what
gathered in one transaction at most FLUSH_S later (WAL journal, so a commit does not wait for
the disk). Past `activity.max_rows` the oldest rows are deleted (by rowid: a range delete).

A file that cannot be opened (not SQLite, a directory nobody may write) fails the router's start
with a message naming it (ActivityFileError): an operator who configured a path expects the log
kept there, and a router that quietly kept it in memory would lose it at the next restart. A file
written by a version with fewer columns gets the new ones (NULL in its old rows). Once running, a
write that fails is logged once, with its traceback, and its rows are dropped: the activity log
never fails a request. A crash loses at most the last FLUSH_S of rows.
"""

from __future__ import annotations

import collections
import logging
import sqlite3
import threading
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger("hotswap")

TABLE = "activity"
QUEUE_ROWS = 100_000  # rows waiting for the writer; past it (a stuck disk) new rows are dropped
FLUSH_S = 0.5  # a row is written at most this long after its request ended
CLOSE_S = 5.0  # how long stop waits for the writer to flush
CONNECT_S = 5.0  # sqlite3's wait for a lock held by another process


class ActivityFileError(Exception):
    """activity.path cannot be used: str() says which file and why, for the operator."""


class ActivityFile:
    def __init__(self, path: str, max_rows: int, columns: Sequence[str]) -> None:
        self.path = Path(path)
        self.max_rows = max_rows
        self.columns = tuple(columns)
        self.rows: collections.deque[tuple[Any, ...]] = collections.deque()  # append and popleft are thread-safe
        self.dropped = 0
        self._failed = False
        self._pending = threading.Event()  # rows are waiting
        self._closing = threading.Event()
        try:  # here, so a file that cannot be opened fails the start, plainly
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = self._connect()
            try:
                with db:
                    db.execute("PRAGMA journal_mode=WAL")
                    db.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} (id INTEGER PRIMARY KEY, {', '.join(self.columns)})")
                    have = {row[1] for row in db.execute(f"PRAGMA table_info({TABLE})")}
                    for column in self.columns:
                        if column not in have:
                            db.execute(f"ALTER TABLE {TABLE} ADD COLUMN {column}")
                self.max_swap_id = db.execute(f"SELECT max(swap_id) FROM {TABLE}").fetchone()[0] or 0
            finally:
                db.close()
        except (sqlite3.Error, OSError) as exc:
            raise ActivityFileError(f"activity.path {self.path}: cannot be used as the activity log's file: {exc}. Move it "
                                    "away, point activity.path elsewhere, or unset it to keep the log in memory") from None
        self._thread = threading.Thread(target=self._write, name="activity-file", daemon=True)
        self._thread.start()

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=CONNECT_S, check_same_thread=False)

    def last(self, n: int) -> list[tuple[Any, ...]]:
        """The newest `n` rows, oldest first (the ring's order)."""
        db = self._connect()
        try:
            rows = db.execute(f"SELECT {', '.join(self.columns)} FROM {TABLE} ORDER BY id DESC LIMIT ?", (n,)).fetchall()
        finally:
            db.close()
        return rows[::-1]

    def put(self, row: tuple[Any, ...]) -> None:
        if len(self.rows) >= QUEUE_ROWS:
            self.dropped += 1
            if self.dropped == 1:
                log.error("activity file %s: the writer is %d rows behind; new rows are dropped until it catches up",
                          self.path, QUEUE_ROWS)
            return
        self.rows.append(row)
        if not self._pending.is_set():
            self._pending.set()

    def close(self) -> None:
        """Write what is waiting (for at most CLOSE_S) and stop the writer."""
        self._closing.set()
        self._pending.set()
        self._thread.join(CLOSE_S)

    def _write(self) -> None:
        db = self._connect()
        db.execute("PRAGMA synchronous=NORMAL")  # with WAL: durable across a process crash, not a power cut
        insert = f"INSERT INTO {TABLE} ({', '.join(self.columns)}) VALUES ({', '.join('?' * len(self.columns))})"
        try:
            while True:
                self._pending.wait()
                self._closing.wait(FLUSH_S)  # let a batch gather (at once when closing)
                self._pending.clear()  # before taking the rows: one appended meanwhile sets it again
                rows = [self.rows.popleft() for _ in range(len(self.rows))]
                if rows:
                    self._insert(db, insert, rows)
                if self._closing.is_set() and not self.rows:
                    return
        finally:
            db.close()

    def _insert(self, db: sqlite3.Connection, insert: str, rows: list[tuple[Any, ...]]) -> None:
        try:
            with db:
                db.executemany(insert, rows)
                db.execute(f"DELETE FROM {TABLE} WHERE id <= (SELECT max(id) FROM {TABLE}) - ?", (self.max_rows,))
        except Exception:
            if not self._failed:
                self._failed = True
                log.exception("activity file %s: writing %d rows failed; rows are dropped until a write succeeds",
                              self.path, len(rows))
            return
        if self._failed:
            self._failed = False
            log.info("activity file %s: writing again", self.path)
