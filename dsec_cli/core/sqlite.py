"""Small embedded databases (node state, admission): one connection per thread, kept open,
and write transactions that take the database lock up front."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def thread_connection(local: threading.local, attr: str, path: Path,
                      pragmas: tuple[str, ...] = ()) -> sqlite3.Connection:
    """This thread's connection to ``path``, opened once (opening one per statement, which
    also checkpoints the WAL on close, would cost more than the statements)."""
    db: sqlite3.Connection | None = getattr(local, attr, None)
    if db is None:
        db = sqlite3.connect(path, timeout=60, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA busy_timeout=60000")
        for pragma in pragmas:
            db.execute(f"PRAGMA {pragma}")
        setattr(local, attr, db)
    return db


@contextmanager
def immediate(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """A write transaction holding the lock from its start (BEGIN IMMEDIATE)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
