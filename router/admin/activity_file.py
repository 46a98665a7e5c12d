"""`activity.path`: the activity log's SQLite file, so records survive a restart.

Rows are written by one thread of its own, in batches, never on the event loop: a request only
puts its row on a bounded queue. Past `activity.max_rows` the oldest rows are deleted (by
rowid, so rotation costs a range delete). A file that cannot be written is logged once, with
its traceback, and its rows are dropped: the activity log never fails a request.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

log = logging.getLogger("hotswap")

TABLE = "activity"
QUEUE_ROWS = 10_000  # rows waiting for the writer; past it (a stuck disk) new rows are dropped
BATCH_ROWS = 500
CLOSE_S = 5.0  # how long stop waits for the writer to flush
CONNECT_S = 5.0  # sqlite3's wait for a lock held by another process
_STOP = None


class ActivityFile:
    def __init__(self, path: str, max_rows: int, columns: Sequence[str]) -> None:
        self.path = Path(path)
        self.max_rows = max_rows
        self.columns = tuple(columns)
        self.queue: queue.Queue[Optional[tuple[Any, ...]]] = queue.Queue(QUEUE_ROWS)
        self.dropped = 0
        self._failed = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:  # here, so a file that cannot be opened fails the start, plainly
            db.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} (id INTEGER PRIMARY KEY, {', '.join(self.columns)})")
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
        try:
            self.queue.put_nowait(row)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.error("activity file %s: the writer is %d rows behind; new rows are dropped until it catches up",
                          self.path, QUEUE_ROWS)

    def close(self) -> None:
        """Flush what is queued (for at most CLOSE_S) and stop the writer."""
        try:
            self.queue.put(_STOP, timeout=CLOSE_S)
        except queue.Full:
            pass
        self._thread.join(CLOSE_S)

    def _write(self) -> None:
        db = self._connect()
        insert = f"INSERT INTO {TABLE} ({', '.join(self.columns)}) VALUES ({', '.join('?' * len(self.columns))})"
        try:
            while True:
                batch = [self.queue.get()]
                while len(batch) < BATCH_ROWS and batch[-1] is not _STOP:
                    try:
                        batch.append(self.queue.get_nowait())
                    except queue.Empty:
                        break
                stop = batch[-1] is _STOP
                rows = [row for row in batch if row is not _STOP]
                if rows:
                    self._insert(db, insert, rows)
                if stop:
                    return
        finally:
            db.close()

    def _insert(self, db: sqlite3.Connection, insert: str, rows: list) -> None:
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
